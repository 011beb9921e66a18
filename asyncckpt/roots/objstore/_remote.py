"""Checkpoints on an object store: list remote steps (``ls``), and the clean-ups after a
commit (objects of dead attempts, stale multipart uploads) and retention.

Torch-free (the CLI's ``ls s3://...`` uses it); loading into tensors is the one loader,
reading through ``ObjectStepReader``; push and pull are copies between roots
(``roots._transfer``). Names on the store
(docs/design/object-stores.md, section 1)::

    P/step_00000300/manifest.json                 the commit object, created once (If-None-Match: *)
    P/step_00000300/a-<attempt>/rank00000.safetensors
    P/step_00000300/a-<attempt>/rank00000.json    <attempt>: the manifest's attempt id

A remote step is complete iff its manifest decodes (checksum, canonical form, its step) and
ONE LIST of ``step_N/a-<attempt>/`` shows exactly the manifest's names with their sizes; it is
resumable unless it is also known bad. Discovery and retention are ``_steps``'s (the
store's adapter of the one rule in ``_stepstates``); the newest resumable step is found
through the root (``ObjectRoot``, ``roots._find``) as on any root.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..._errors import CheckpointCorruptError, ObjectStoreError
from ...format._layout import aside_key, step_dir_name
from ...format._layout import data_prefix as data_prefix  # re-exported: the names of the store's keys
from ...format._layout import manifest_key as manifest_key
from ...format._manifest import Manifest
from ...threads._sync import run_sync
from .._scheme import is_url
from ..posix._fileio import read_exact
from ._client import ObjectStore
from ._connection import gather_or_cancel
from ._steps import StepPrefix, aside_keys, dirs_of, observe
from ._steps import check_objects as check_objects
from ._steps import read_manifest as read_manifest
from ._steps import retire as _retire_steps

if TYPE_CHECKING:
    from ._lease import Lease

log = logging.getLogger("asyncckpt")

#: Default deadline of one push, pull or load call (seconds).
DEFAULT_DEADLINE_S = 3600.0
#: Files of one step uploaded or downloaded at a time (each with its own parallel parts).
_FILES_IN_FLIGHT = 2


def open_store(url: str, storage_options: Mapping[str, str] | None = None, **kwargs: Any) -> ObjectStore:
    """An :class:`ObjectStore` for ``url`` (no I/O)."""
    if not is_url(url):
        raise ValueError(f"not an object-store URL (s3://bucket/prefix): {url!r}")
    return ObjectStore(url, storage_options, **kwargs)


@dataclass(frozen=True)
class RemoteStep:
    """One entry under a store root (for ``asyncckpt ls``): a ``step_N/`` commit, complete or
    not, or an attempt set aside (``status`` is the ``_stepstates`` state: ``complete``,
    ``bad``, ``incomplete``, ``aside``; ``complete`` is true only for a complete commit; a
    ``bad`` one may be complete but known bad). ``name`` is its key prefix or record."""

    step: int
    complete: bool
    reason: str
    nbytes: int
    files: int
    world_size: int | None
    created: float | None
    attempt: str | None
    status: str = "complete"
    name: str = ""
    run: str | None = None  # the run of a complete step's manifest (None: none recorded)
    #: what a local ``ls`` shows of a directory, for the same JSON on both: the bytes of every
    #: object of the entry (its manifest included; ``nbytes`` counts the listed files only),
    #: their newest modification time (the store's clock), the problem code of an entry that
    #: is not complete (``_stepstates.Fault.code``, ``set-aside``, ``no-marker``) and the bad
    #: mark of a step known bad (``{step, attempt, path, reason, time}``)
    size: int = 0
    modified: float | None = None
    problem: str | None = None
    bad: dict[str, Any] | None = None


def rows_of(p: Any) -> list[RemoteStep]:
    """The ``ls`` rows of one observed step prefix (``_steps.StepPrefix``)."""
    from ...format._stepstates import state_of, why_bad

    def newest(objs: list[Any]) -> float | None:
        return max((o.last_modified.timestamp() for o in objs), default=None)

    out = []
    sd = step_dir_name(p.step)
    for seen in p.seen:
        state = state_of(seen)
        if seen.kind == "aside":
            mine = [o for o in p.listed if seen.attempt and (
                o.key.startswith(data_prefix(p.step, seen.attempt)) or o.key == aside_key(p.step, seen.attempt))]
            size = sum(o.size for o in mine)
            why = "bad attempt set aside when the step was saved again, kept for inspection (gc --remove-bad)"
            if seen.mark is not None:
                why += f"; verification failed: {seen.mark}"
            out.append(RemoteStep(p.step, False, why, size, 0, None, None, seen.attempt, "aside", seen.name + ".json",
                                  size=size, modified=newest(mine), problem="set-aside"))
            continue
        m = p.manifest
        complete = seen.fault is None
        reason = why_bad(seen) if state == "bad" else ""
        nbytes = sum(f.size for f in m.files) if m is not None and complete else 0
        mine = [o for o in p.listed if o.key == manifest_key(p.step)
                or (m is not None and o.key.startswith(data_prefix(p.step, m.attempt)))]  # fmt: skip
        bad = None
        if state == "bad" and seen.fault is None and seen.mark is not None:
            bad = {"step": p.step, "attempt": seen.attempt, "path": seen.mark.path, "reason": seen.mark.reason,
                   "time": seen.mark.time}  # fmt: skip
        out.append(RemoteStep(p.step, complete, reason, nbytes, len(m.files) + 1 if m is not None and complete else 0,
                              m.world_size if m is not None else None, m.created if m is not None else None,
                              m.attempt if m is not None else None, state, sd + "/",
                              m.run if m is not None else None, size=sum(o.size for o in mine), modified=newest(mine),
                              problem=None if seen.fault is None else seen.fault.code, bad=bad))  # fmt: skip
    stray = [o for o in p.listed if o.key not in p.owned]
    if stray and p.committed is None:
        out.append(RemoteStep(p.step, False, "no manifest (a save or push in progress or interrupted)",
                              sum(o.size for o in stray), len(stray), None, None, None, "incomplete", sd + "/",
                              size=sum(o.size for o in stray), modified=newest(stray), problem="no-marker"))
    return out


def scan(url: str, *, storage_options: Mapping[str, str] | None = None, deadline_s: float = 300.0) -> list[RemoteStep]:
    """Every entry under ``url``, oldest step first: each step prefix (complete, known bad,
    without a manifest) and each attempt set aside, with why it is not resumable."""
    store = open_store(url, storage_options)

    async def go() -> list[RemoteStep]:
        return [row for p in await observe(store, time.monotonic() + deadline_s) for row in rows_of(p)]

    return run_sync(go)


# ------------------------------------------------------- node-tier uploads, clean-ups after a commit


async def upload_files(store: ObjectStore, pinned_path: str, opened: dict[str, int], m: Manifest,
                        names: Iterable[str], deadline: float) -> None:
    """Upload ``names`` (open read-only in ``opened``) read with ``pread`` part by part (never
    mapped: a read error is an ``OSError`` naming the file, not a SIGBUS): one rank's part of
    a node-local tier's step (``saving._nodeupload``); whole steps go by ``roots._transfer``."""
    prefix = data_prefix(m.step, m.attempt)
    sem = asyncio.Semaphore(_FILES_IN_FLIGHT)

    async def one(name: str) -> None:
        f = m.file(name)
        path = os.path.join(pinned_path, name)
        fd = opened[name]

        def read(offset: int, view: memoryview) -> None:
            read_exact(fd, view, offset, path, "reading it to upload")

        async with sem:
            info = await store.put_from(prefix + name, f.size, read, deadline)
        if info.crc32c != f.crc32c:
            # the local file is not what was committed: never commit it remotely
            raise CheckpointCorruptError(
                f"checksum mismatch (CRC-32C {info.crc32c:08x} read, {f.crc32c:08x} in the manifest); not pushed",
                path,
            )

    await gather_or_cancel([one(n) for n in names])


async def sweep_dead_attempts(store: ObjectStore, m: Manifest, deadline: float) -> None:
    """Delete objects under ``step_N/`` of attempts the committed manifest does not name: they
    can never commit (their create_once loses), so they are dead whoever wrote them (but for
    attempts set aside as bad, kept for inspection)."""
    sd = step_dir_name(m.step) + "/"
    keep = data_prefix(m.step, m.attempt)
    listed = [o.key for o in await store.list(sd, deadline)]
    aside = aside_keys(m.step, listed)  # attempts set aside: kept for inspection
    dead = [k for k in listed if k != manifest_key(m.step) and not k.startswith(keep) and k not in aside]
    if dead:
        await store.delete(dead, deadline)
        await store.remove_dirs([d for d in dirs_of(dead, sd) if d != sd], deadline)
        log.info("removed %d object(s) of dead attempts under %s", len(dead), store.object_url(sd))


async def abort_stale_uploads(store: ObjectStore, m: Manifest, deadline: float) -> None:
    """Abort incomplete multipart uploads under the committed step (an earlier push killed
    mid-upload, whose own abort could not reach the store): every object of the step is
    complete now, so no upload there can be one a commit still needs. Best effort."""
    if not store.can_list_uploads:
        return
    sd = step_dir_name(m.step) + "/"
    try:
        n = await store.abort_uploads(sd, deadline=min(deadline, time.monotonic() + 30.0))
    except ObjectStoreError as e:
        log.warning("could not abort stale uploads under %s: %s", store.object_url(sd), e)
        return
    if n:
        log.info("aborted %d stale multipart upload(s) under %s", n, store.object_url(sd))


async def retire_remote(
    store: ObjectStore, keep_last: int, deadline: float, lease: Lease | None = None,
    protect: frozenset[int] = frozenset(), run: str | None = None, *,
    found: list[StepPrefix] | None = None, removed: Callable[[int], None] | None = None,
) -> list[int]:
    """Keep the newest ``keep_last`` resumable remote steps; retire older resumable ones (the
    manifest first, then its objects; ``_steps.retire``: known-bad steps neither count
    nor go, the newest resumable one never goes). With ``lease``: nothing is removed once it
    was taken over (``RootInUseError``). Steps in ``protect`` (tier mode: the step just
    uploaded) are never retired; with ``run``, only that run's steps (``_runs.same_run``)
    count and go: another run's are not this job's. ``found``/``removed``: the lease
    holder's look (``_view``) and what to tell of each step emptied."""
    return await _retire_steps(store, keep_last, deadline, lease, protect, run, found=found, removed=removed)
