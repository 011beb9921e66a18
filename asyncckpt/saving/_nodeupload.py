"""The persistent tier of node-local roots: every rank uploads its own files, rank 0 commits.

``Checkpointer(root, node_local=True, mirror="s3://bucket/run1")``: each step committed on
the nodes' disks (``_nodelocal``) is then uploaded in the background, on every rank, by a
:class:`PartUploads` (a ``Mirror`` whose rounds run on every rank). Theory of operation, one
round per committed step, in commit order (every rank sees the same verdicts, so the same
steps in the same order; no step supersedes another, which keeps the ranks' rounds aligned
without another agreement):

1. every rank reads its own files of the step from its node's disk (opened, sizes checked
   against the manifest) and uploads them under ``step_N/a-<attempt>/`` with the push
   protocol's CRC-32C comparison (``objstore._remote.upload_files``);
2. the ranks exchange their outcomes through the c10d store (their own namespace and
   threads: a round never holds a thread a save needs), bounded by the round's deadline;
3. rank 0, once every part landed, creates the local manifest's exact bytes once
   (``If-None-Match: *``) under the prefix's lease, as ``mirror=`` does: the store's commit
   point; it publishes the outcome, which every rank takes.

A failure anywhere (the store down, a rank's read, a rank that does not take part) fails the
round on every rank with a ``SaveError`` naming the step, the URL and the failed ranks: the
node-local step stays committed, the next round uploads the next step. Local retention keeps
every step above the newest one this rank saw committed on the store (:attr:`floor`), so no
step leaves the disks before it is on the store: while the store is down, the disks keep
every step.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import RankFailure, SaveError
from .._info import CheckpointInfo
from ..format import _manifest
from ..format._bounds import MAX_MANIFEST_BYTES
from ..format._layout import manifest_key, step_dir_name
from ..ranks._coordination import RoundTimeout, StoreCoordinator
from ..roots.posix._discovery import read_manifest, read_regular_file
from ..threads._iopool import IOPool
from ._mirror import Mirror, UploadRecord

if TYPE_CHECKING:
    from ..roots.objstore._lease import Lease

log = logging.getLogger("asyncckpt")
#: How long past a round's deadline the other ranks wait for rank 0's outcome.
_OUTCOME_GRACE_S = 5.0
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def open_part(root: str, step: int, rank: int) -> tuple[str, _manifest.Manifest, bytes, dict[str, int]]:
    """This rank's files of committed ``step`` on its node's ``root``, opened read-only and
    checked against the manifest's sizes: (step dir, manifest, manifest bytes, name -> fd)."""
    step_dir = os.path.join(root, step_dir_name(step))
    m = read_manifest(step_dir)
    raw = read_regular_file(os.path.join(step_dir, _manifest.MANIFEST), MAX_MANIFEST_BYTES)
    opened: dict[str, int] = {}
    try:
        for name in (_manifest.shard_name(rank), _manifest.tree_name(rank)):
            path = os.path.join(step_dir, name)
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
            opened[name] = fd
            if os.fstat(fd).st_size != m.file(name).size:
                raise OSError(f"{path}: size {os.fstat(fd).st_size} is not the manifest's {m.file(name).size}")
    except BaseException:
        for fd in opened.values():
            os.close(fd)
        raise
    return step_dir, m, raw, opened


class PartUploads(Mirror):
    """Uploads of a node-local root's committed steps, on every rank (module docstring)."""

    def __init__(
        self, root: str, url: str, storage_options: Mapping[str, str] | None, *, rank: int, world_size: int,
        connect: Callable[..., Any], namespace: str, keep_last_remote: int | None, timeout: float,
        ranks: Sequence[int], lease_ttl: float | None,
    ) -> None:  # fmt: skip
        super().__init__(root, url, storage_options, keep_last_remote=keep_last_remote, timeout=timeout,
                         retire_local=None, uploads=True, ranks=ranks, lease_ttl=lease_ttl)  # fmt: skip
        self.rank = rank
        self.world_size = world_size
        self._queue: collections.deque[tuple[CheckpointInfo, concurrent.futures.Future[CheckpointInfo]]] = (
            collections.deque()
        )
        #: the newest step this rank saw committed on the store (local retention keeps every step above)
        self.floor = -1
        self._coord_pool = IOPool(2, "asyncckpt-upload-coord")
        # connected now, without the TCP probe (the store is up): a client that connects with
        # its probe while others connect holds the store's connects, and every rank's save, 5 s
        self._coord = StoreCoordinator(lambda: connect(probe=False), rank, world_size, f"{namespace}-up",
                                       self._run_coord)  # fmt: skip
        assert self._thread is not None
        self._thread.submit(self._coord.exchange(-1, "ready", True, 0.0, wait=False)).result(timeout)
        self._retiring: asyncio.Future[None] | None = None  # rank 0: the remote retention running now

    async def _run_coord(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._coord_pool, fn, *args)

    def uploaded(self) -> int:
        """:attr:`floor`, for the node-local backend's retention."""
        return self.floor

    def committed(self, info: CheckpointInfo) -> UploadRecord:
        """Queue committed ``info.step`` for its round (every step, in order); never blocks."""
        fut: concurrent.futures.Future[CheckpointInfo] = concurrent.futures.Future()
        record = UploadRecord(info.step, fut)
        with self._lock:
            if self._stopped or self._thread is None:
                fut.set_exception(self._abandoned(info.step, "the Checkpointer is closing"))
                return record
            self._unsettled[fut] = info.step
            self._queue.append((info, fut))
            start = not self._pumping
            self._pumping = True
        if start:
            try:
                self._thread.submit(self._pump())
            except RuntimeError as e:
                with self._lock:
                    self._pumping = False
                self._settle(fut, error=self._abandoned(info.step, str(e)))
        return record

    async def _pump(self) -> None:
        while True:
            with self._lock:
                if not self._queue or self._stopped:
                    self._pumping = False
                    return
                info, fut = self._queue.popleft()
                self._in_flight = info.step
            try:
                await self._round(info)
            except asyncio.CancelledError:
                self._settle(fut, error=self._abandoned(info.step, "the upload thread was stopped"))
                raise
            except SaveError as e:
                self._settle(fut, error=e)
            except Exception as e:  # noqa: BLE001 - delivered through the record
                self._settle(fut, error=self._failure(info.step, e))
            else:
                self._settle(fut, result=info)
            finally:
                with self._lock:
                    self._in_flight = None

    async def _round(self, info: CheckpointInfo) -> None:
        from ..roots.objstore._remote import upload_files

        step, t0 = info.step, time.monotonic()
        deadline = t0 + self.timeout
        seq = step  # the round's keys: the uploads' own namespace, one round per step
        mine: dict[str, Any] = {"ok": True}
        raw = b""
        try:
            step_dir, m, raw, opened = await asyncio.get_running_loop().run_in_executor(
                self._pool, open_part, self.root, step, self.rank
            )
            try:
                await upload_files(self.store, step_dir, opened, m, list(opened), deadline)
            finally:
                for fd in opened.values():
                    os.close(fd)
        except Exception as e:  # noqa: BLE001 - every rank hears it in the exchange
            mine = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        # rank 0 reads every rank's outcome and tells each the verdict: O(ranks) store reads
        if self.rank == 0:
            try:
                got = await self._coord.exchange(seq, "parts", mine, deadline)
                failed = {int(r): str(v["error"]) for r, v in got.items() if not v["ok"]}
            except RoundTimeout as e:  # ranks that did not take part: named in the outcome every rank hears
                late = f"TimeoutError: did not take part in step {step}'s upload round in time"
                failed = {r: late for r in e.missing}
            outcome: dict[str, Any] = {"ok": False, "failed": failed}
            lease = None
            if not failed:
                try:
                    lease = await self._commit(step, raw, deadline)
                    outcome = {"ok": True}
                except Exception as e:  # noqa: BLE001 - every rank hears it in the outcome
                    outcome = {"ok": False, "failed": {0: f"{type(e).__name__}: {e}"}}
            await self._coord.post_once(seq, "done", outcome)
            if lease is not None:  # after the outcome, in the background: see _retire_soon
                self._retire_soon(step, lease)
        else:
            await self._coord.exchange(seq, "parts", mine, deadline, wait=False)
            heard = await self._coord.wait_for(seq, "done", deadline + _OUTCOME_GRACE_S)
            if heard is None:  # rank 0 is the one that failed: named as such, with this rank's own failure
                what = f"did not publish the outcome of step {step}'s upload in time"
                silent = {0: RankFailure(0, "TimeoutError", what)}
                if not mine["ok"]:
                    msg = str(mine["error"])
                    silent[self.rank] = RankFailure(self.rank, msg.partition(":")[0], msg.partition(": ")[2])
                raise SaveError(step, silent, detail=f"upload to {self.url} failed; the node-local step under "
                                f"{self.root} is committed, and the next commit's upload goes on")  # fmt: skip
            outcome = heard
        if not outcome["ok"]:
            failures = {int(r): RankFailure(int(r), msg.partition(":")[0], msg.partition(": ")[2])
                        for r, msg in outcome["failed"].items()}  # fmt: skip
            raise SaveError(step, failures, detail=f"upload to {self.url} failed; the node-local step under "
                            f"{self.root} is committed, and the next commit's upload goes on")  # fmt: skip
        self.floor = max(self.floor, step)
        if self.rank == 0:
            log.info("uploaded step %d from every rank to %s in %.3fs", step, self.url, time.monotonic() - t0)

    async def _commit(self, step: int, raw: bytes, deadline: float) -> Lease:
        """Rank 0, every part landed: create the manifest once under the prefix's lease (returned)."""
        if not self._probed:
            await self.store.probe(deadline)  # a store that ignores If-None-Match is refused, never raced
            self._probed = True
        lease = await self._hold_lease(deadline)
        until = min(deadline, await lease.confirm(lease.ttl / 3))
        result = await self.store.create_once(manifest_key(step), raw, until)
        if not result.won and result.stored != raw:
            raise SaveError(step, {0: RankFailure(0, "CheckpointError", "committed there by another attempt")},
                            detail=f"step {step} is already committed at {self.url} by another attempt")  # fmt: skip
        return lease

    def _retire_soon(self, step: int, lease: Lease) -> None:
        """Start remote retention after ``step``'s round, after any still running: the others
        wait for this rank's outcome and its part of the next round only until their deadlines,
        and retention (bounded by its own timeout) must make neither late."""
        before = self._retiring

        async def run() -> None:
            if before is not None:
                await asyncio.gather(before, return_exceptions=True)
            await self._retire_remote(step, lease)

        self._retiring = asyncio.ensure_future(run())

    async def _retire_remote(self, step: int, lease: Lease) -> None:
        """Rank 0, after ``step`` committed on the store: remote retention (this run's steps only,
        never this one), bounded by its own timeout; it never fails the committed upload."""
        from ..roots.objstore._remote import retire_remote
        if self.keep_last_remote is not None:
            try:
                removed = await retire_remote(self.store, self.keep_last_remote, time.monotonic() + self.timeout,
                                              lease, protect=frozenset({step}), run=self.run)  # fmt: skip
                if removed:
                    log.info("retired remote steps %s under %s", removed, self.url)
            except Exception as e:  # noqa: BLE001 - retention never fails a committed upload
                log.warning("remote retention under %s failed: %s", self.url, e)

    def stop(self, timeout: float) -> None:
        with self._lock:
            self._stopped = True
            queued = list(self._queue)
            self._queue.clear()
        for info, fut in queued:
            self._settle(fut, error=self._abandoned(info.step, "the Checkpointer was closed first"))
        super().stop(timeout)
        self._coord.shutdown()
        self._coord_pool.shutdown(wait=True, timeout=timeout)
