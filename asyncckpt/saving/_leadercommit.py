"""Phase 3 of the save protocol, on the leader once every rank reported success: the commit.

The global index (when a rank has DTensors or dedupe wrote an index part), durable before the
manifest that lists it, then the manifest; both checked first with the readers' own parsers
(``_committable``: what a reader would refuse is never committed), then the backend's commit
point (the rename of the attempt on POSIX, the conditional create on a store).
"""

from __future__ import annotations

import time

from ..format import _index, _manifest
from ..ranks._coordination import Report, Verdict
from ..roots._backend import Backend
from . import _committable
from ._savejob import SaveJob

#: Test-only switch: False commits without first checking the manifest and the global index
#: with the readers' parsers (tests/test_acceptance.py shows what then commits).
_CHECK_BEFORE_COMMIT = True


async def commit_attempt(
    backend: Backend, job: SaveJob, loc: str, attempt: str, world: int, reports: dict[int, Report]
) -> Verdict:
    """Write the index and the manifest of ``attempt`` (at ``loc``) from every rank's report and
    commit it; return the committed verdict. Raises ``CheckpointCorruptError`` before anything
    is committed if a reader would refuse the index or the manifest."""
    t0 = time.perf_counter()
    created = time.time()
    nbytes = sum(r.nbytes for r in reports.values())
    files = [_manifest.FileEntry(**f) for r in reports.values() for f in r.files]
    ranks = list(job.ranks) if job.ranks is not None else list(range(world))
    fmt = _manifest.FORMAT
    if any(r.index is not None for r in reports.values()):
        # DTensors: the global index, durable before the manifest that lists it
        index = _index.merge(world, {r: rep.index for r, rep in reports.items()})
        if _CHECK_BEFORE_COMMIT:
            _committable.check_index(loc, world, {**{f.name: f.size for f in files}, _index.INDEX: len(index)}, index)
        written = await backend.write_small(job, loc, _index.INDEX, index)
        files.append(_manifest.FileEntry(_index.INDEX, written.size, written.crc32c, 0))
        fmt = _manifest.FORMAT_INDEXED
    if any(r.needs_v2 for r in reports.values()):
        fmt = _manifest.FORMAT_INDEXED
    body = _manifest.encode(job.step, attempt, world, nbytes, created, files, extra={}, ranks=ranks, format=fmt,
                             run=job.run)
    if _CHECK_BEFORE_COMMIT:
        _committable.check_manifest(loc, body)
    await backend.commit(job, loc, attempt, body)
    job.times["commit"] = time.perf_counter() - t0
    return Verdict(committed=True, nbytes=nbytes, created=created)
