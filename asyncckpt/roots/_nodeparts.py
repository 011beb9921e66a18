"""A node's parts of steps on a node-local root, and the agreement on which step every rank holds.

On a node-local root (``saving._nodelocal``) a node's ``step_N/`` holds the whole step's
manifest but only that node's ranks' files; a load reads its part through :class:`NodePart`.
Torch-free; store calls only (``ranks._agree``).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from .._errors import CheckpointCorruptError, CheckpointNotFoundError, CheckpointReadError
from ..format import _manifest
from ..format._layout import step_dir_name, token_of
from ..format._stepstates import same_run
from ..ranks._agree import agree
from ..ranks._distributed import DistContext
from ..threads._deadline import CallTimeout, Deadline, call_by
from ._badmarks import marks
from ._root import StepReader
from .posix._discovery import read_manifest
from .posix._root import CAPS, PosixStepReader

log = logging.getLogger("asyncckpt")
_STEP_DIR = re.compile(r"step_(\d{8,})$")


class NodePart:
    """This node's parts of steps under ``path`` (its disk or its memory tier) as a load reads
    them: a :class:`~asyncckpt.roots._root.Readable` for ``loading._resume.load_step``. A node's
    part is no committed step of a :class:`~asyncckpt.roots.Root` (the whole step's manifest,
    only its node's ranks' files): :meth:`open_reader` holds ``ranks``' files of a step open,
    checked against that manifest, and refuses a read of another rank's file
    (``CheckpointNotFoundError``). No bad marks: a damaged part is no verdict on the step, whose
    same attempt the caller reads from its next tier. :attr:`at` is the file its reads are in
    now (the manifest before a step is open): a caller that gives up waiting names it."""

    caps = CAPS

    def __init__(self, path: str, ranks: Collection[int]) -> None:
        self.path, self.url = path, os.path.abspath(path)
        self.names = frozenset(n for r in ranks for n in (_manifest.shard_name(r), _manifest.tree_name(r)))
        self.at = self.url

    def open_reader(self, step: int) -> StepReader:
        """This node's part of ``step`` held open (errors as ``PosixRoot.open_reader``'s)."""
        self.at = os.path.join(self.url, step_dir_name(step), _manifest.MANIFEST)
        return _PartReader(self, step)

    def mark_bad(self, step: int, attempt: str, path: str, reason: str) -> bool:
        """Keeps no mark (class docstring): False."""
        return False

    def clear_bad(self, step: int, attempt: str) -> bool:
        """Holds no mark: False."""
        return False


class _PartReader(PosixStepReader):
    """A :class:`NodePart`'s step, telling its part which file it reads (a ranged read's, else
    the file whose descriptor it last gave out: the caller reads that one itself)."""

    def __init__(self, part: NodePart, step: int) -> None:
        super().__init__(part.path, step, part.names)
        self._part = part

    def fileno(self, name: str) -> int:
        self._part.at = self.locate(name)
        return super().fileno(name)

    def _fill(self, entry: _manifest.FileEntry, offset: int, out: memoryview) -> None:
        before, self._part.at = self._part.at, self.locate(entry.name)
        super()._fill(entry, offset, out)
        self._part.at = before


def read_part(root: str, step: int) -> _manifest.Manifest:
    """The manifest of ``step`` on this node's ``root`` (whichever ranks' files it holds).
    ``CheckpointNotFoundError`` (no manifest), ``CheckpointCorruptError`` (one that does not
    decode), ``CheckpointReadError`` (the disk could not serve it)."""
    return read_manifest(os.path.join(root, step_dir_name(step)))


def part_state(root: str, step: int, ranks: Collection[int]) -> _manifest.Manifest | None:
    """The manifest of ``step`` on this node's ``root`` if its files of ``ranks`` are all there
    with the sizes it lists (the part is complete for them); ``None`` otherwise."""
    step_dir = os.path.join(root, step_dir_name(step))
    try:
        m = read_part(root, step)
    except (CheckpointNotFoundError, CheckpointCorruptError, OSError):
        return None
    for r in ranks:
        for name in (_manifest.shard_name(r), _manifest.tree_name(r)):
            try:
                size = m.file(name).size
                st = os.stat(os.path.join(step_dir, name), follow_symlinks=False)
            except (CheckpointCorruptError, OSError):
                return None
            if not os.path.isfile(os.path.join(step_dir, name)) or st.st_size != size:
                return None
    return m


def parts(root: str, ranks: Collection[int]) -> dict[int, tuple[str, str | None]]:
    """Every step under this node's ``root`` complete for ``ranks``: step -> (attempt, run)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return {}
    out: dict[int, tuple[str, str | None]] = {}
    for name in names:
        hit = _STEP_DIR.match(name)
        if hit is None:
            continue
        m = part_state(root, int(hit.group(1)), ranks)
        if m is not None and m.step == int(hit.group(1)):
            out[m.step] = (m.attempt, m.run)
    return out


def agree_parts(
    dist: DistContext, key: str, root: str, timeout: float | Deadline, step: int | None = None,
    store_steps: list[list[Any]] | None = None, memory: str | None = None, peer: Sequence[int] | None = None,
) -> list[list[Any]]:  # fmt: skip
    """Collective (store only, bounded by ``timeout``): the steps complete for every rank with
    one attempt, ascending, as ``[step, attempt, run, sources, tiers]``; ``sources[r]`` is where
    rank ``r`` reads its part: ``"memory"`` (its node's memory tier, ``memory``), ``"local"``
    (its node's ``root``), ``"peer"`` (its buddy's memory: the peer replica, ``peer`` names the
    ranks whose replicas this rank holds under ``memory``) or ``"store"`` (the persistent tier,
    whose resumable steps rank 0 passes as ``store_steps``: ``[step, attempt, run]``);
    ``tiers[r]`` every place holding rank ``r``'s part of that attempt, fastest first (a failed
    read goes on to the next). Each rank looks at its own files only; a part is read locally
    wherever the node holds that very attempt (same manifest, CRC-checked files: provably the
    same bytes as on the store).
    With ``step``: that step only, or none. The run rule (``roots._runs``): when some step is
    complete on the nodes' disks alone, only steps of its run count; else any run's (a job
    whose disks are all new resumes its run from the store). ``timeout``: seconds, or the
    ``Deadline`` of the caller's whole operation (as for ``agree``); this rank's look at its
    node's disk ends by it too: one the file system never answers raises
    ``CheckpointReadError`` (``ETIMEDOUT``) naming the rank and the root, and the others time
    out on the agreement naming this rank."""
    by = timeout if isinstance(timeout, Deadline) else Deadline.after(timeout)
    try:  # on a thread of its own: a stat or read held by the file system has no deadline of its own
        # an attempt a load found damaged in every tier is marked bad on the nodes' disks
        # (``loading._nodeload``): never a candidate again, in any tier
        bad = call_by(lambda: set(marks(root)), by, f"asyncckpt-nodemarks-r{dist.rank}")
        found = call_by(lambda: parts(root, [dist.rank]), by, f"asyncckpt-nodescan-r{dist.rank}")
        held = {} if memory is None else call_by(lambda: parts(memory, [dist.rank]), by,
                                                 f"asyncckpt-memscan-r{dist.rank}")  # fmt: skip
        holds = {} if memory is None or not peer else call_by(lambda: _holdings(memory, peer), by,
                                                              f"asyncckpt-peerscan-r{dist.rank}")  # fmt: skip
    except CallTimeout:
        raise CheckpointReadError(errno.ETIMEDOUT, f"rank {dist.rank}: looking at its parts on this node's disk did "
                                  "not finish within the deadline", root) from None  # fmt: skip

    def wanted(s: int, attempt: str) -> bool:
        return (step is None or s == step) and (s, token_of(attempt)) not in bad

    mine: dict[str, Any] = {"parts": {str(s): list(v) for s, v in found.items() if wanted(s, v[0])},
                            "memory": {str(s): list(v) for s, v in held.items() if wanted(s, v[0])},
                            "peer": {r: {s: a for s, a in h.items() if wanted(int(s), a)}
                                     for r, h in holds.items()}}  # fmt: skip
    if dist.rank == 0:
        mine["store"] = [e for e in store_steps or () if step is None or e[0] == step]

    def decide(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
        held_for: list[dict[str, list[Any]]] = [{} for _ in outcomes]  # rank -> its parts its buddy holds
        for o in outcomes:
            for r, h in o.get("peer", {}).items():
                if 0 <= int(r) < len(outcomes):
                    held_for[int(r)].update({s: [a] for s, a in h.items()})
        return {"steps": common_steps([o["parts"] for o in outcomes], outcomes[0].get("store", []),
                                      [o.get("memory", {}) for o in outcomes], held_for)}  # fmt: skip

    return list(agree(dist, key, mine, decide, timeout)["steps"])


def _holdings(memory: str, sources: Sequence[int]) -> dict[str, dict[str, str]]:
    from .replica import holdings  # torch (the replica's transport): imported only where it is used

    return holdings(memory, sources)


def common_steps(
    local: list[dict[str, list[Any]]], store_steps: list[list[Any]], memory: list[dict[str, list[Any]]] | None = None,
    peer: list[dict[str, list[Any]]] | None = None,
) -> list[list[Any]]:  # fmt: skip
    """:func:`agree_parts`'s decision from every rank's parts (on its node's disk, ``local``,
    in its node's memory tier, ``memory``, and in its buddy's memory, ``peer``: step ->
    ``[attempt]``) and the store's steps (pure). A replica is a place to read an attempt found
    in another tier, never a candidate of its own (its record holds no run)."""
    store = {int(e[0]): (str(e[1]), e[2]) for e in store_steps}
    mem = memory if memory is not None else [{} for _ in local]
    buddy = peer if peer is not None else [{} for _ in local]
    steps = {int(s) for p in [*local, *mem] for s in p} | set(store)
    out: list[list[Any]] = []
    for s in sorted(steps):
        found = {(str(p[str(s)][0]), p[str(s)][1]) for p in [*local, *mem] if str(s) in p}
        found |= {store[s]} if s in store else set()
        for attempt, run in sorted(found, key=str):
            tiers = []
            for p, q, b in zip(local, mem, buddy, strict=True):
                held = [name for name, there in (("memory", q), ("peer", b), ("local", p)) if str(s) in there
                        and there[str(s)][0] == attempt]  # fmt: skip
                held += ["store"] if s in store and store[s][0] == attempt else []
                if not held:
                    break
                tiers.append(held)
            else:
                out.append([s, attempt, run, [t[0] for t in tiers], tiers])
                break
    on_disks = [e for e in out if all(x != "store" for x in e[3])]
    if on_disks:
        run = on_disks[-1][2]
        out = [e for e in out if same_run(e[2], run)]
    return out


def store_steps(url: str, storage_options: Mapping[str, str] | None, timeout: float) -> list[list[Any]]:
    """Rank 0: the persistent tier's resumable steps as ``[step, attempt, run]``, within
    ``timeout``; a store that cannot be read is logged and taken as holding none (a resume then
    uses the nodes' disks alone: never a reason not to start)."""
    from ..threads._sync import run_sync
    from .objstore._remote import open_store
    from .objstore._steps import resumable

    try:
        store = open_store(url, storage_options)
        found = run_sync(lambda: resumable(store, time.monotonic() + timeout))
    except Exception as e:  # noqa: BLE001 - ObjectStoreError, a corrupt listing: never fatal here
        log.warning("asyncckpt: could not list the steps under %s (%s: %s): resuming from the nodes' disks only",
                    url, type(e).__name__, e)  # fmt: skip
        return []
    return [[m.step, m.attempt, m.run] for m, _ in found]
