"""The memory tier of node-local roots: each node keeps its newest steps on tmpfs too.

``Checkpointer(root, node_local=True, memory="/dev/shm/run1", memory_keep_last=1,
memory_budget=...)``. The memory tier is one more node-local POSIX root (``_nodelocal``'s
layout and commit discipline) whose path is on tmpfs, so it outlives the training process (not
a reboot). Theory of operation (docs/design/tiers.md):

1. a save due for the memory tier (the first of the job, then every ``memory_every``-th
   ``save()``, or by time; rank 0 decides at its call, every rank takes its word: ``_frequency``)
   carries a
   :class:`~asyncckpt.saving._memwrite.MemoryWrite`: every rank writes its files of the step
   into ``step_N.tmp-<attempt>/`` under the memory root *from the bytes the save holds* (its
   staging arena once it is all staged, beside the disk write; its tree), never from a
   re-read of the disk; the write ends before the save settles (its staging slot is reused
   then). A file larger than ``memory_budget``, or a tmpfs without room (reserved first:
   ``ENOSPC``), fails the write, never the save;
2. once the disks committed the step, the step's round (one per committed due save, in commit
   order on every rank, so the rounds stay aligned without another agreement): the ranks
   exchange their writes' outcomes and sizes through the c10d store (their own namespace,
   bounded by ``timeout``);
3. each node's leader commits its node's part (``_nodelocal.commit_part``) with the manifest
   bytes its node's disk commit wrote (the same attempt, so provably the same bytes) when its
   node's ranks all wrote theirs and the part fits ``memory_budget``, then makes room: it
   removes its node's oldest other memory steps beyond ``memory_keep_last`` and until they fit
   ``memory_budget``. So the budget bounds what the tier keeps between rounds; while a due save
   runs, its attempt's files are on tmpfs on top of it (size the tmpfs for one step more).

With ``disk_every=k`` a save not due for the disks commits into the memory tier itself (the
node-local commit on a backend rooted here, ``Runtime.memory_backend``); its round only makes
room (steps below it: never a newer one, which such a save may have committed meanwhile) and
pushes it to the buddies (docs/design/tiers.md, "Frequencies").

With the peer replica (``replicate=True``, ``roots.replica.PeerTier``), a round that committed
the step in memory on every node (the leaders' words exchanged once more) ends with every rank
pushing its memory files of the step to its buddy on the next node.

A write that fails never fails a save (the durable tiers committed first): it is logged, and
the memory tier lacks that step; a due save that fails removes its files from the memory tier.
Neither the write nor the round re-reads the disk, so they neither compete with the next save
for the disk nor add to ``save()``'s blocking (docs/design/tiers.md, "Measured").
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointError
from ..format._layout import deleting_dir_name, step_dir_name
from ..ranks._coordination import StoreCoordinator
from ..ranks._nodes import Nodes
from ..roots._nodeparts import parts
from ..roots._scheme import is_url
from ..roots.posix._ownership import Ownership, acquire
from ..roots.posix._retention import remove_leftovers
from ..roots.posix._storage import Storage
from ..threads._iopool import IOPool
from ..threads._writer import WriterThread
from ._memwrite import MemoryWrite
from ._nodelocal import commit_part

if TYPE_CHECKING:
    from ..roots.replica import PeerTier

log = logging.getLogger("asyncckpt")

#: The file systems a memory tier may live on (``/proc/self/mountinfo``'s type field).
MEMORY_FS = ("tmpfs", "ramfs")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_options(memory: object, keep_last: object, budget: object, node_local: bool) -> str | None:
    """Raise ``TypeError``/``ValueError`` for memory-tier options that cannot work (no I/O);
    return the memory root made absolute (``None`` without a memory tier)."""
    if memory is None:
        if keep_last is not None or budget is not None:
            raise ValueError("memory_keep_last and memory_budget apply to a memory tier (memory=...)")
        return None
    if not isinstance(memory, (str, os.PathLike)):
        raise TypeError(f"memory must be a path on tmpfs, not {type(memory).__name__}")
    path = os.fspath(memory)
    if not isinstance(path, str) or not path or is_url(path):
        raise ValueError(f"memory must be a directory on tmpfs (e.g. /dev/shm/run1), not {memory!r}")
    if not node_local:
        raise ValueError("memory= is a tier of node-local roots: it needs node_local=True")
    if keep_last is not None and not _is_int(keep_last):
        raise TypeError(f"memory_keep_last must be an int, not {type(keep_last).__name__}")
    if keep_last is not None and keep_last < 1:  # type: ignore[operator]
        raise ValueError(f"memory_keep_last must be at least 1, not {keep_last!r}")
    if budget is not None and not _is_int(budget):
        raise TypeError(f"memory_budget must be an int (bytes), not {type(budget).__name__}")
    if budget is not None and budget < 1:  # type: ignore[operator]
        raise ValueError(f"memory_budget must be a positive number of bytes, not {budget!r}")
    return os.path.abspath(path)


def check_apart(memory: str, root: str) -> None:
    """``ValueError`` when the memory root and the disk root are one, or one holds the other."""
    a, b = os.path.realpath(memory), os.path.realpath(root)
    if a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep):
        raise ValueError(f"memory={memory!r} and the root {root!r} must be two separate directories")


def fs_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The type of the file system holding ``path`` (an existing directory), from the mount
    whose mount point is the longest prefix of its real path."""
    real = os.path.realpath(path)
    best, kind = "", ""
    with open(mountinfo, encoding="utf-8", errors="replace") as f:
        for line in f:
            fields, _, rest = line.partition(" - ")
            point = fields.split()[4].encode().decode("unicode_escape")  # \040 for a space
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, rest.split()[0]
    return kind


def start_memory(memory: str, own: Ownership | None = None, ranks: Sequence[int] = (0,)) -> None:
    """A node's leader at construction: make the memory root, refuse one not on tmpfs
    (``CheckpointError``), take it as a root is taken (``own``: one job per memory root on a
    node, ``RootInUseError`` for a second), remove the attempts a killed process left there."""
    os.makedirs(memory, mode=0o700, exist_ok=True)
    kind = fs_type(memory)
    if kind not in MEMORY_FS:
        raise CheckpointError(f"asyncckpt: memory={memory} is on a {kind or 'unknown'} file system, not tmpfs: "
                              "it would not be memory (use a directory under /dev/shm)")  # fmt: skip
    if own is not None:
        acquire(memory, ranks, into=own)
    remove_leftovers(memory)


def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total


def _remove(memory: str, step: int) -> None:
    """Remove this node's memory part of ``step``: renamed aside first (never a half-removed
    step that looks committed), then deleted."""
    aside = os.path.join(memory, deleting_dir_name(step, uuid.uuid4().hex[:16]))
    os.rename(os.path.join(memory, step_dir_name(step)), aside)
    shutil.rmtree(aside, ignore_errors=True)


def make_room(
    memory: str, ranks: tuple[int, ...], keep_last: int, budget: int | None, newest: int, held: str | None = None
) -> list[int]:
    """After ``newest`` was committed: remove this node's oldest memory steps below it until at
    most ``keep_last`` are left with it and they fit ``budget`` together with the files under
    ``held`` (the peer replicas this node holds for others: they use the same memory); return
    the removed steps. Never ``newest`` nor a step above it: a save that commits into the
    memory tier itself (``disk_every``) may have committed a newer step before this round ran."""
    have = [s for s in sorted(parts(memory, ranks)) if s < newest]
    sizes = {s: _tree_bytes(os.path.join(memory, step_dir_name(s))) for s in [*have, newest]}
    others = _tree_bytes(held) if held is not None and budget is not None else 0
    gone = []

    def over() -> bool:
        return len(have) + 1 > keep_last or (
            budget is not None and sum(sizes[s] for s in have) + sizes[newest] + others > budget
        )

    while have and over():
        s = have.pop(0)
        _remove(memory, s)
        gone.append(s)
    return gone


class MemoryCopies:
    """The rounds that copy committed steps into the memory tier, on every rank (module docstring)."""

    def __init__(
        self, memory: str, nodes: Nodes, *, rank: int, world_size: int, connect: Callable[..., Any],
        namespace: str, keep_last: int, budget: int | None, timeout: float, ownership: Ownership | None = None,
        replica: PeerTier | None = None,
    ) -> None:  # fmt: skip
        self.memory, self.nodes, self.rank = memory, nodes, rank
        self.world_size = world_size
        #: the peer replica (``replicate=True``): each step committed in memory on every node is
        #: pushed to the buddies at the end of its round
        self.replica = replica
        self.node = nodes.node_of(rank)
        self.keep_last, self.budget, self.timeout = keep_last, budget, timeout
        self._ownership = ownership  # a node leader's hold on the memory root: released by stop()
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[int, MemoryWrite, concurrent.futures.Future[bool]]] = collections.deque()
        self._pending: set[concurrent.futures.Future[bool]] = set()
        self._pumping = False
        self._stopped = False
        self._rounds = 0
        self._dead: set[str] = set()
        #: the steps this node committed in memory in this job, in order (monitoring, tests)
        self.copied: list[int] = []
        self._pool = IOPool(2, "asyncckpt-memtier-io")
        self._storage = Storage(self._pool, direct_io="off")
        # the saves' writes into the memory tier (``_memwrite``): a thread of their own
        self._write_pool = IOPool(1, "asyncckpt-memtier-write")
        # one thread, so one store client: a round's store calls are sequential
        self._coord_pool = IOPool(1, "asyncckpt-memtier-coord")
        # connected now, at construction, with no probe (the store is up): a client connecting
        # while a save runs held the c10d store's connects, and so every rank's save, for 5 s
        # (a probe's connect-and-close while others connect, torch 2.13: ranks._distributed)
        self._coord = StoreCoordinator(lambda: connect(probe=False), rank, world_size, f"{namespace}-mem",
                                       self._run_coord)  # fmt: skip
        self._thread = WriterThread("asyncckpt-memtier")
        self._thread.submit(self._coord.exchange(0, "ready", True, 0.0, wait=False)).result(timeout)

    async def _run_coord(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._coord_pool, fn, *args)

    @property
    def _ranks(self) -> tuple[int, ...]:
        return self.nodes.members[self.node]

    def writer(self, step: int, in_save: bool = False) -> MemoryWrite:
        """The memory write of a save of ``step`` due for the memory tier (``save()`` calls it:
        the save's file writer fills it from the bytes it holds; ``_memwrite``). ``in_save``: the
        save commits into the memory tier itself (not due for the disks: ``disk_every``)."""
        return MemoryWrite(self.memory, step, self.budget, self._run_write, in_save)

    async def _run_write(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._write_pool, fn, *args)

    def committed(self, step: int, write: MemoryWrite) -> None:
        """Queue committed ``step`` (whose files ``write`` put in the memory tier) for its round;
        never blocks (the save's writer thread calls it)."""
        fut: concurrent.futures.Future[bool] = concurrent.futures.Future()
        with self._lock:
            if self._stopped:
                return
            self._queue.append((step, write, fut))
            self._pending.add(fut)
            start, self._pumping = not self._pumping, True
        if start:
            try:
                self._thread.submit(self._pump())
            except RuntimeError:
                with self._lock:
                    self._pumping = False

    def failed(self, write: MemoryWrite) -> None:
        """A due save failed: its files leave the memory tier (on a thread of the memory tier;
        once it stopped, the next start removes them)."""
        try:
            self._pool.submit(write.discard)
        except RuntimeError:
            pass

    def pending(self) -> list[concurrent.futures.Future[bool]]:
        """The rounds not finished yet (``flush()`` waits for them); each settles ``True`` when
        this node committed the step in memory, ``False`` otherwise; never with an error."""
        with self._lock:
            return list(self._pending)

    def _done(self, fut: concurrent.futures.Future[bool], ok: bool) -> None:
        with self._lock:
            self._pending.discard(fut)
        if not fut.done():
            fut.set_result(ok)

    async def _pump(self) -> None:
        while True:
            with self._lock:
                if not self._queue or self._stopped:
                    self._pumping = False
                    return
                step, write, fut = self._queue.popleft()
                self._rounds += 1
                seq = self._rounds
            ok = False
            try:
                ok = await self._round(seq, step, write)
            except Exception as e:  # noqa: BLE001 - the memory tier never fails a save: logged
                log.warning("asyncckpt: rank %d: step %d was not committed in the memory tier %s: %s: %s", self.rank,
                            step, self.memory, type(e).__name__, e)  # fmt: skip
            finally:
                self._done(fut, ok)

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _round(self, seq: int, step: int, write: MemoryWrite) -> bool:
        """One round (module docstring); whether this node committed ``step`` in memory. A rank
        whose write failed still takes part: its failure is in the exchange."""
        deadline = time.monotonic() + self.timeout
        leader = self.rank == self.nodes.leader(self.node)
        t0 = time.monotonic()
        mine = await self._run(write.outcome)
        # each rank reads its own node's outcomes only: O(ranks) store reads a round, not O(ranks²)
        got = await self._coord.exchange(seq, "written", mine, deadline, among=self._ranks)
        ok = all(got[r]["ok"] for r in self._ranks)
        if leader:
            ok = await self._commit(step, write, ok, got, t0)
        if self.replica is None:
            return ok
        # the peer replica: once every node's leader committed the step in memory (which needs
        # every rank's write), every rank pushes its files of it to its buddy (collective; a
        # failure is logged, never raised)
        if await self._every_node_kept(seq, ok if leader else None, deadline):
            await self._run(self.replica.push, step, write.attempt, write.crcs)
        return ok

    async def _every_node_kept(self, seq: int, kept: bool | None, deadline: float) -> bool:
        """Whether every node's leader committed the round's step in memory, the same answer on
        every rank: the leaders (``kept``: their word) tell rank 0, which tells every rank
        (``False`` to all when a leader is silent past ``deadline``)."""
        if self.rank != 0:
            if kept is not None:
                await self._coord.exchange(seq, "in-memory", {"ok": kept}, deadline, wait=False)
            word = await self._coord.wait_for(seq, "in-memory-all", deadline)
            return bool(word is not None and word["ok"])
        every = False
        try:
            done = await self._coord.exchange(seq, "in-memory", {"ok": bool(kept)}, deadline,
                                              among=self.nodes.leaders)  # fmt: skip
            every = all(v["ok"] for v in done.values())
        finally:  # a silent leader: every other rank hears "no" now, not at its deadline
            await self._coord.post_once(seq, "in-memory-all", {"ok": every})
        return every

    async def _commit(self, step: int, write: MemoryWrite, ok: bool, got: dict[int, Any], t0: float) -> bool:
        """The leader: commit its node's memory part of ``step`` when its ranks all wrote theirs
        and it fits the budget, then make room (whether it committed; a failure is logged:
        never raised, every rank waits for its word)."""
        if write.in_save:  # the save committed it here itself (disk_every): the only copy, kept whatever its size
            return await self._keep(step, t0)
        need = sum(got[r]["bytes"] for r in self._ranks)
        if self.budget is not None and need > self.budget:
            await self._run(shutil.rmtree, write.loc, True)
            log.warning("asyncckpt: step %d's part of node %r (%d bytes) exceeds memory_budget=%d: not kept in "
                        "memory", step, self.nodes.names[self.node], need, self.budget)  # fmt: skip
            return False
        if not ok or write.manifest is None:
            await self._run(shutil.rmtree, write.loc, True)
            failed = {r: got[r].get("error") for r in self._ranks if not got[r]["ok"]}
            log.warning("asyncckpt: step %d not committed in the memory tier %s: %s", step, self.memory,
                        failed or "no manifest from the disk commit")  # fmt: skip
            return False
        assert write.attempt is not None
        try:
            await commit_part(self._storage, self.memory, write.loc, step, write.attempt, write.manifest, self._ranks,
                              self._dead)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the memory tier never fails a save: logged
            log.warning("asyncckpt: step %d not committed in the memory tier %s: %s: %s", step, self.memory,
                        type(e).__name__, e)  # fmt: skip
            return False
        log.info("asyncckpt: node %r: step %d committed in the memory tier %s in %.3fs", self.nodes.names[self.node],
                 step, self.memory, time.monotonic() - t0)  # fmt: skip
        return await self._keep(step, t0)

    async def _keep(self, step: int, t0: float) -> bool:
        """The leader, ``step`` committed in its node's memory tier: make room (older steps only)."""
        self.copied.append(step)
        try:
            held = None if self.replica is None else self.replica.directory
            gone = await self._run(make_room, self.memory, self._ranks, self.keep_last, self.budget, step, held)
        except OSError as e:
            log.warning("asyncckpt: memory tier %s: could not make room: %s", self.memory, e)
        else:
            if gone:
                log.info("asyncckpt: memory tier %s: removed steps %s", self.memory, gone)
        return True

    def stop(self, timeout: float) -> None:
        """Stop the rounds (a round still running is cancelled; the attempt it leaves is removed
        at the next start). Idempotent."""
        with self._lock:
            self._stopped = True
            queued = list(self._queue)
            self._queue.clear()
        for _, _, fut in queued:
            self._done(fut, False)
        self._thread.stop(timeout=timeout)
        self._coord.shutdown()
        self._coord_pool.shutdown(wait=True, timeout=timeout)
        self._pool.shutdown(wait=True, timeout=timeout)
        self._write_pool.shutdown(wait=True, timeout=timeout)
        for fut in self.pending():
            self._done(fut, False)
        if self._ownership is not None:
            self._ownership.release()
