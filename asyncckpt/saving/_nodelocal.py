"""The node-local tier: each node's ranks save to that node's own disk, at the same path.

``Checkpointer(root, node_local=True)``: ``root`` is the same path on every node with a
different disk behind it (a local NVMe). The save protocol is ``_commit.run_save``'s, unchanged
in its coordination; :class:`NodeLocalBackend` is its storage half. Theory of operation:

1. every rank writes its ``rankRRRRR.*`` files into ``step_N.tmp-<attempt>/`` on its node's
   disk (rank 0 prepares its node's attempt, every other rank makes the directory on its own
   node if it is not there), fsyncs them, and reports to rank 0 as always;
2. rank 0, once every rank reported success (every node's part durable), posts the manifest
   (the whole step's: every rank's files) as the *go* word through the c10d store, commits its
   own node's part, then waits, bounded by the save's deadline, for every other node's leader
   (its lowest rank) to acknowledge its own node's commit; a node that fails or stays silent
   fails the save on every rank (``SaveError`` naming that node's leader and its error, with
   ``NodeCommitError`` as rank 0's failure; ``SaveTimeoutError`` for a silent one), and rank 0
   takes its own node's commit back;
3. each other node's leader, after reporting, waits for the go word (or rank 0's *abort*,
   posted whenever it does not commit), writes the manifest into its node's attempt, fsyncs,
   renames the attempt to ``step_N`` and fsyncs the root: the same commit discipline as a
   shared root, on its own disk.

So a node's ``step_N`` with a manifest is the record, on that node, that every node's part was
durable when rank 0 decided; the part itself is this node's ranks' files only. A node's step is
*complete for a rank* when its manifest is there and that rank's files have the sizes it lists
(:func:`parts`). Which step a job resumes from is agreed among all ranks (:func:`agree_parts`):
the newest step complete for every rank with the same attempt, so a node whose disk is empty,
was wiped, or holds another run's (or another attempt's) files is never read from, and no two
ranks ever read different steps or attempts.

Retention per node (``keep_last``), after each commit on its node: each node's leader keeps
the newest ``keep_last`` steps that rank 0 confirmed committed on every node (rank 0 sends its
list with the go word), plus the step being committed, and removes its parts of every step
below the oldest of these. A step whose save failed on another node is never counted, so a
node never removes the last step every node holds; the price: a node other than rank 0's holds
one step more than ``keep_last`` until the next save (the step just committed is confirmed
only once every node acknowledged it).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import Any

from .._errors import CheckpointCorruptError, CheckpointError, CheckpointReadError
from .._info import CheckpointInfo
from ..format import _manifest
from ..format._layout import deleting_dir_name, step_dir_name
from ..ranks._agree import agree
from ..ranks._coordination import StoreCoordinator
from ..ranks._distributed import DistContext
from ..ranks._nodes import Nodes
from ..ranks._sharedroot import check_node_disks, place_token, remove_token
from ..roots._backend import PhaseTimeout, PosixBackend, StepJob, check_deadline, dir_timeout, landed_late
from ..roots._nodeparts import agree_parts, part_state, parts
from ..roots.posix._storage import Storage
from ..threads._deadline import CallTimeout, Deadline, call_by
from ._cleanup import in_background
from ._savejob import SaveJob

log = logging.getLogger("asyncckpt")

#: How many confirmed steps the go word carries (retention needs only the newest ``keep_last``).
_CONFIRMED_SENT = 64


def _seq(job: StepJob) -> int:
    """The save's sequence number on the coordinator: the node-local tier commits saves only."""
    assert isinstance(job, SaveJob), "the node-local backend commits a save's job"
    return job.seq


def check_option(node_local: object, store_root: bool, allow_earlier_steps: bool) -> None:
    """Raise ``TypeError``/``ValueError`` for a ``node_local=`` that cannot work (no I/O)."""
    if not isinstance(node_local, bool):
        raise TypeError(f"node_local must be a bool, not {node_local!r}")
    if not node_local:
        return
    if store_root:
        raise ValueError("node_local=True needs a file-system root (the same path on every node); this root is an "
                         "object store, which every node shares already")  # fmt: skip
    if allow_earlier_steps:
        raise ValueError("node_local=True does not support allow_earlier_steps=True")


class NodeCommitError(CheckpointError, OSError):
    """A node's leader could not commit its node's part of a step (or did not answer in time)."""


async def commit_part(
    storage: Storage, root: str, loc: str, step: int, attempt: str, manifest: bytes, ranks: Collection[int],
    dead: set[str],
) -> None:  # fmt: skip
    """Commit this node's part of ``attempt`` (in ``loc``) as ``step_N`` under ``root``: the
    manifest durable in ``loc``, the rename, the root fsynced, then a check that the part holds
    ``ranks``' files as listed (else the commit is taken back and the error raised)."""
    tmp = os.path.join(loc, _manifest.MANIFEST + ".tmp")
    await storage.write_bytes(tmp, manifest)
    await storage.rename(tmp, os.path.join(loc, _manifest.MANIFEST))
    await storage.fsync_dir(loc)
    final = os.path.join(root, step_dir_name(step))
    if await storage.run(os.path.lexists, final):
        # a part of an earlier attempt of this step on this node (that save failed elsewhere:
        # rank 0's node did not hold the step, or it would have refused the save): set aside
        await _remove_aside(storage, root, step, final, dead)
    # this node's commit point. The rename runs on the I/O pool: if the save's deadline cancels
    # this coroutine meanwhile, the thread goes on and may land it after every rank was told
    # "failed" (and resume would find it): shielded, and a late landing is taken back
    rename = asyncio.ensure_future(storage.rename(loc, final))
    try:
        await asyncio.shield(rename)
    except asyncio.CancelledError:
        if await landed_late(rename, loc, final):
            await _remove_aside(storage, root, step, final, dead)
        raise
    try:
        await storage.fsync_dir(root)
        m = await storage.run(part_state, root, step, ranks)
        if m is None or m.attempt != attempt:
            raise CheckpointCorruptError(f"holds no complete part of attempt {attempt} for ranks {sorted(ranks)}",
                                         final)  # fmt: skip
    except BaseException:
        await _remove_aside(storage, root, step, final, dead)
        raise


async def _remove_aside(storage: Storage, root: str, step: int, path: str, dead: set[str]) -> None:
    aside = os.path.join(root, deleting_dir_name(step, uuid.uuid4().hex[:16]))
    await storage.rename(path, aside)
    dead.add(os.path.basename(aside))
    await storage.remove_tree(aside)
    dead.discard(os.path.basename(aside))


async def retire_parts(
    storage: Storage, root: str, keep_last: int, confirmed: Sequence[int], current: int, ranks: Collection[int],
    dead: set[str], lock: asyncio.Lock | None = None, above: int | None = None,
) -> list[int]:  # fmt: skip
    """Keep the newest ``keep_last`` steps confirmed on every node and ``current``; remove this
    node's parts of every step below the oldest of them (confirmed or not: a step below steps
    every node holds is never the one a resume agrees on). Never a step above it; with
    ``above`` (the persistent tier's floor), never a step above ``above`` (not on the store yet)."""
    keep = set(sorted(confirmed)[-keep_last:]) | {current}
    async with lock if lock is not None else contextlib.nullcontext():  # overlapping saves: one at a time
        return await _retire(storage, root, keep, ranks, dead, above)


async def _retire(
    storage: Storage, root: str, keep: set[int], ranks: Collection[int], dead: set[str], above: int | None
) -> list[int]:
    on_disk = await storage.run(parts, root, ranks)
    gone = []
    for s in sorted(set(on_disk) - keep):
        if s < min(keep) and (above is None or s <= above):
            await _remove_aside(storage, root, s, os.path.join(root, step_dir_name(s)), dead)
            gone.append(s)
    return gone


def _keep_manifest(job: StepJob, manifest: bytes) -> None:
    """A node's leader: a save due for the memory tier commits its memory part with the very
    manifest bytes of its disk commit (the memory round reads nothing from the disk)."""
    if isinstance(job, SaveJob) and job.memory is not None:
        job.memory.manifest = manifest


class NodeLocalBackend(PosixBackend):
    """The node-local tier's storage half (module docstring): a POSIX backend on this node's
    disk whose commit is one per node. ``coord`` is the save's store coordinator; ``rank``
    this process's rank in the group; ``confirmed`` the steps complete on every node.
    ``tier``: what ``root`` is, named in the infos of its commits: ``"local"`` (the node's
    disk) or ``"memory"`` (its memory tier: the saves ``disk_every`` does not send to the disks
    commit there, by this very protocol, on their own instance)."""

    def __init__(
        self, storage: Storage, root: str, nodes: Nodes, rank: int, coord: StoreCoordinator,
        confirmed: Collection[int] = (), tier: str = "local",
    ) -> None:  # fmt: skip
        super().__init__(storage, root)
        self.tier = tier
        self.nodes = nodes
        self.rank = rank
        self.node = nodes.node_of(rank)
        self.coord = coord
        self.confirmed: set[int] = set(confirmed)
        #: with the persistent tier (``_nodeupload``): the newest step this rank saw on the store;
        #: retention keeps every step above it (``None``: no persistent tier)
        self.uploaded: Callable[[], int] | None = None

    def info(self, step: int, **fields: Any) -> CheckpointInfo:
        return super().info(step, tier=self.tier, **fields)

    def _floor(self) -> int | None:
        return None if self.uploaded is None else self.uploaded()

    @property
    def _mine(self) -> tuple[int, ...]:
        return self.nodes.members[self.node]

    async def commit(self, job: StepJob, loc: str, attempt: str, manifest: bytes) -> None:
        """Rank 0: post the go word, commit its node's part, wait for every other node's."""
        go = {"manifest": manifest.decode(), "attempt": attempt,
              "confirmed": sorted(self.confirmed)[-_CONFIRMED_SENT:]}  # fmt: skip
        stood = await self.coord.post_once(_seq(job), "node-go", go)
        if stood != go:  # only rank 0 posts the word: cannot happen, but never commit on a stale one
            raise NodeCommitError(f"step {job.step}: the go word was already {stood!r}")
        check_deadline(job)
        _keep_manifest(job, manifest)
        await commit_part(self.storage, job.root, loc, job.step, attempt, manifest, self._mine, job.dead)
        try:
            await self._acknowledged(job)
        except BaseException:
            await _remove_aside(self.storage, job.root, job.step, os.path.join(job.root, step_dir_name(job.step)),
                                job.dead)  # fmt: skip
            raise
        self.confirmed.add(job.step)

    async def _acknowledged(self, job: StepJob) -> None:
        until = time.monotonic() + dir_timeout(job)  # a little before the phase's: the error names the silent node
        for k in range(1, len(self.nodes.members)):
            ack = await self.coord.wait_for(_seq(job), f"node-ack/{k}", until)
            leader = self.nodes.leader(k)
            if ack is None:  # a timeout, as a rank that does not answer: SaveTimeoutError on every rank
                raise PhaseTimeout(f"step {job.step}: node {self.nodes.names[k]!r} (leader rank {leader}) did not "
                                   "confirm its commit before the save's deadline")  # fmt: skip
            if not ack.get("ok"):
                raise NodeCommitError(f"step {job.step}: node {self.nodes.names[k]!r} (leader rank {leader}) could "
                                      f"not commit its part: {ack.get('error')}")  # fmt: skip

    async def release(self, job: StepJob) -> None:
        """Rank 0, when it does not commit: tell the other nodes' leaders (a no-op once the go
        word is out)."""
        await self.coord.post_once(_seq(job), "node-go", {"abort": True})

    async def follow(self, job: StepJob, loc: str, attempt: str) -> None:
        """Every other node's leader, after reporting: commit this node's part on the go word
        and acknowledge (bounded by the save's deadline); the others return at once."""
        if self.node == 0 or self.rank != self.nodes.leader(self.node):
            return
        go = await self.coord.wait_for(_seq(job), "node-go", job.deadline)
        if go is None or "manifest" not in go or go.get("attempt") != attempt:
            return  # rank 0 aborted or is silent: the verdict (or its absence) says so
        ack: dict[str, Any] = {"ok": True}
        manifest = go["manifest"].encode()
        _keep_manifest(job, manifest)
        try:
            await commit_part(self.storage, job.root, loc, job.step, attempt, manifest, self._mine, job.dead)
        except Exception as e:  # noqa: BLE001 - reaches every rank through rank 0's verdict
            ack = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        await self.coord.post_once(_seq(job), f"node-ack/{self.node}", ack)
        if ack["ok"] and job.keep_last is not None:
            # in the background, tracked like rank 0's (flush() and close() wait for it): a slow
            # disk under retention must not keep this rank from the verdict past the deadline
            assert isinstance(job, SaveJob)
            retire = retire_parts(self.storage, job.root, job.keep_last, go["confirmed"], job.step, self._mine,
                                  job.dead, job.retention_lock, self._floor())  # fmt: skip
            in_background(job, retire, f"node-local retention under {job.root} failed")

    async def retire(self, job: StepJob) -> None:
        if job.keep_last is None:
            return
        await retire_parts(self.storage, job.root, job.keep_last, sorted(self.confirmed), job.step, self._mine,
                           job.dead, job.retention_lock, self._floor())  # fmt: skip


def refuse_dtensors(has_dtensors: bool, node_local: bool) -> None:
    """``ValueError`` for a state holding DTensors saved on a node-local root: their global
    index and replicated boxes would span nodes, so a node could not load the part it committed."""
    if has_dtensors and node_local:
        raise ValueError("node_local=True does not save DTensors yet: their global index and replicated boxes "
                         "would span nodes, so a node could not load its part; use a shared or an s3:// root "
                         "for a DTensor state")  # fmt: skip


def _late(rank: int, root: str, what: str) -> CheckpointReadError:
    """The error of a node leader whose call to its disk at construction (``what``) did not
    end by the deadline (the others time out on the agreement naming it)."""
    return CheckpointReadError(errno.ETIMEDOUT, f"rank {rank}: {what} on this node's disk did not finish within "
                               "the construction's deadline", root)  # fmt: skip


def start_on_nodes(
    dist: DistContext, key: str, root: str, nodes: Nodes, start: Any, by: Deadline,
    store_steps: Callable[[], list[list[Any]]] | None = None, memory: str | None = None,
    peer: Sequence[int] | None = None,
) -> tuple[BaseException | None, list[list[Any]]]:
    """Construction with ``node_local=True``, on every rank. Each node's leader runs ``start()``
    (make the root on its disk, take it, remove leftovers: ``_rootstart``) and the failures are
    shared; then the ranks agree on the steps complete for every rank (:func:`agree_parts`).
    ``store_steps`` (rank 0, with the persistent tier): lists the store's resumable steps.
    Returns the first node's failure (the same on every rank) and the agreed steps.

    Everything by one deadline, ``by`` (the construction's, counted from its call): the
    leaders' start and each agreement after it get what is left of it, so a leader slow to
    start fails the construction by then, never later: the others with ``AgreeTimeout``
    naming it, the leader itself with ``CheckpointReadError`` (``ETIMEDOUT``) naming it and
    the root (its start and its token, each on a thread of its own, are left to end on their
    own: ``start`` must let go of what it took once the construction gave up; a token placed
    that late stays, a dot file nothing reads)."""
    failure: BaseException | None = None
    token: str | None = None
    if dist.rank in nodes.leaders:
        # each call on a thread of its own: a call the disk never answers has no deadline of its own
        try:
            call_by(start, by, f"asyncckpt-nodestart-r{dist.rank}")
        except CallTimeout:
            raise _late(dist.rank, root, "starting") from None
        except (CheckpointError, OSError, ValueError) as e:
            failure = e
        try:  # which ranks see this disk (check_node_disks); also after a failed start, if it can
            token = call_by(lambda: place_token(root), by, f"asyncckpt-nodetoken-r{dist.rank}")
        except CallTimeout:
            raise _late(dist.rank, root, "placing a token") from None
        except OSError as e:
            failure = failure or e
    mine = {"error": None if failure is None else f"{type(failure).__name__}: {failure}", "token": token}

    def decide(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
        bad = [(r, o["error"]) for r, o in enumerate(outcomes) if o["error"]]
        return {"bad": bad, "tokens": {str(r): o["token"] for r, o in enumerate(outcomes) if o["token"]}}

    try:
        got = agree(dist, f"{key}/node-start", mine, decide, by)
        bad = got["bad"]
        # also after a failed start: two leaders on one disk fail it (the second cannot take the
        # root), and the names that do not match the disks are the cause to name
        node_of = [nodes.node_of(r) for r in range(dist.world_size)]
        tokens = {int(r): str(t) for r, t in got["tokens"].items()}
        mismatch = check_node_disks(dist, key, root, node_of, tokens, by, list(nodes.names))
        if mismatch is not None:
            return mismatch, []
    finally:
        if token is not None:  # bounded too (a disk that stopped answering): a token left behind is a dot file
            with contextlib.suppress(CallTimeout):
                call_by(lambda: remove_token(root, token), Deadline.after(max(by.remaining(), 0.0) + 1.0),
                        f"asyncckpt-nodetoken-r{dist.rank}")  # fmt: skip
    if bad:
        if failure is not None:
            return failure, []
        r, msg = bad[0]
        return CheckpointError(f"asyncckpt: the node-local root {root} could not be started on rank {r}'s node: "
                               f"{msg}"), []  # fmt: skip
    listed = store_steps() if store_steps is not None and dist.rank == 0 else None
    return None, agree_parts(dist, f"{key}/parts", root, by, store_steps=listed, memory=memory, peer=peer)
