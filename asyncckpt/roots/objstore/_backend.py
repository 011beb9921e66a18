"""The object-store backend of the save protocol: commit by conditional create.

Names (docs/design/object-stores.md, section 1)::

    P/step_00000300/manifest.json                  the commit object, created once (If-None-Match: *)
    P/step_00000300/a-<attempt>/rank00000.safetensors
    P/step_00000300/a-<attempt>/rank00000.json     attempt-unique keys: plain overwrites

The protocol beside POSIX's (``_backend.PosixBackend``):

1. L: the step's manifest exists and names another attempt → refused (``FileExistsError``),
   unless it is an attempt of ours whose commit was reported failed (its create's outcome
   was unknown and it landed late): then that manifest and its objects are deleted first;
   or unless that commit is known bad (``_stepstates``): then it is set aside
   (``_steps.set_aside``: kept for inspection) and the step saved again.
   Nothing to create: prefixes are implicit.
2. every rank: the shard and the tree uploaded from the staging arena (no copy: multipart,
   parts in parallel, CRC-32C computed alongside, the stored size checked by a HEAD); a
   200 on the upload is the durability point. Nothing to seal.
3. L: the index, then ``create_once`` of the manifest: the commit point. Lost → another
   attempt committed the step (``FileExistsError`` naming it): this one is not complete.
   Outcome unknown at the deadline → ``ObjectStoreTimeoutError``; the attempt is recorded
   as a failed commit (if the manifest lands late it names complete, verified objects: a
   correct checkpoint, replaced by a retry of the step, see 1).
4. L, failure: the attempt's objects deleted and its multipart uploads aborted (keys are
   attempt-unique, so no live writer can own them). Success: one look at the root
   (``_view``: what lies above the writer's floor, in a number of requests that does
   not grow with the run), and from it ``keep_last`` applied (the manifest first, so a step
   stops being complete at once, then its objects and emptied "directories") and, the root's
   lease being ours, the leftovers that are not our saves in flight removed
   (``_leftovers``: objects of dead attempts, step prefixes without a manifest,
   incomplete uploads). A write the store refuses for good is asked why
   (``_storefull``: out of space is named ``ObjectStoreFullError``).

The root's lease (``_lease``, rank 0's): a save of a job whose lease was taken over fails
in 1 (``RootInUseError``, before anything is written) or, if that became known only later,
right before the commit point in 3, which first makes sure the lease is ours for a while yet
and bounds the create by it: such a job commits nothing.

A step is complete iff its manifest decodes and one LIST of its attempt prefix shows exactly
the manifest's names and sizes (``_steps.open_step``), which is how readers find it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import pathlib
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

from ..._errors import CheckpointCorruptError, ObjectStoreError, ObjectStoreTimeoutError, ObjectStoreUnavailableError
from ..._info import CheckpointInfo
from ...format._layout import step_dir_name
from ...format._manifest import decode
from ...format._stepstates import save_action, state_of
from .._backend import StepJob, check_deadline
from .._filewrite import Staged, WriteResult, until_staged
from ._client import ObjectStore
from ._lease import Lease
from ._leftovers import remove_dead
from ._puts import PutInfo
from ._remote import abort_stale_uploads, data_prefix, manifest_key, read_manifest, retire_remote, sweep_dead_attempts
from ._steps import dirs_of, observe_step, set_aside
from ._storefull import explain
from ._view import StoreView

log = logging.getLogger("asyncckpt")

#: Time kept back from the save's deadline for the clean-up after a failed create.
_CLEANUP_S = 20.0


class ObjectBackend:
    """An ``s3://bucket/prefix`` root (module docstring). One per rank and Checkpointer."""

    def __init__(
        self, store: ObjectStore, lease: Lease | None = None, known_steps: Iterable[int] | None = None
    ) -> None:
        self.store = store
        self.lease = lease  # rank 0's (the others never commit nor remove)
        # our saves between their prepare and their end: step -> attempt (never leftovers)
        self._in_flight: dict[int, str] = {}
        # what the leader knows of the root (floor, manifests, marks): its look after each
        # commit lists only what lies above the oldest step it may still hold; seeded with
        # the step prefixes that held objects when the root was taken (the construction's
        # look at everything), else its first look lists everything
        self.view = StoreView(store)
        if known_steps is not None:
            self.view.seed(known_steps)
        self._looking: asyncio.Lock | None = None

    def _fly(self, step: int, attempt: str) -> None:
        if step not in self._in_flight:
            self.view.pin(step)
        self._in_flight[step] = attempt

    def _land(self, step: int) -> None:
        if self._in_flight.pop(step, None) is not None:
            self.view.unpin(step)

    def location(self, step: int, attempt: str) -> str:
        return data_prefix(step, attempt)

    def info(self, step: int, **fields: Any) -> CheckpointInfo:
        # path: the step's name relative to the prefix; url: where it is
        return CheckpointInfo(
            step=step, path=pathlib.Path(step_dir_name(step)), url=self.store.object_url(step_dir_name(step)), **fields
        )

    async def prepare(self, job: StepJob, attempt: str) -> None:
        if self.lease is not None:
            self.lease.check()  # taken over: this job writes nothing more
        self._fly(job.step, attempt)  # before the first key of the step: the view's floor stays below it
        try:
            found = await read_manifest(self.store, job.step, job.deadline)
        except CheckpointCorruptError:
            found = None
        else:
            if found is None:  # the common case: one GET, nothing there
                return
        if found is not None and found[0].attempt in job.failed_commits:
            # our own commit reported failed that landed late: replace it (manifest first)
            await self.store.delete([manifest_key(job.step)], job.deadline)
            await self._remove_prefix(data_prefix(job.step, found[0].attempt), job.deadline)
            job.failed_commits.discard(found[0].attempt)
            return
        # a commit is there: the step rule says whether it stands in the way (_stepstates)
        p = await observe_step(self.store, job.step, job.deadline)
        action = "proceed" if p.committed is None else save_action(state_of(p.committed))
        if action == "set-aside":
            if self.lease is not None:
                self.lease.check()
            await set_aside(self.store, p, job.deadline)
        elif action != "proceed":
            raise FileExistsError(
                errno.EEXIST, f"step {job.step} is already committed", self.store.object_url(manifest_key(job.step))
            )

    async def join(self, job: StepJob, loc: str) -> None:
        return None  # prefixes are implicit

    def _until(self, job: StepJob) -> float:
        """The store's own deadline for a write: a little before the save's, so a store that
        keeps failing surfaces as its typed error (503 through every retry:
        ``ObjectStoreUnavailableError``, or what ``_storefull.explain`` makes of it in the
        time kept back) rather than as the phase guard's timeout."""
        return job.deadline - min(4.0, 0.2 * job.timeout)

    async def write_shard(
        self, job: StepJob, loc: str, name: str, buf: memoryview, size: int, staged: Staged | None
    ) -> WriteResult:
        t0 = time.perf_counter()
        try:
            # the whole shard staged first: a multipart upload wants its parts at once
            await until_staged(staged, size, job.deadline)
            put = await self._put(job, loc + name, buf[:size])
        except BaseException:
            if staged is not None:
                staged.abandon()
            raise
        return WriteResult(put.size, put.crc32c, False, time.perf_counter() - t0, 0.0)

    async def write_small(self, job: StepJob, loc: str, name: str, data: bytes) -> WriteResult:
        t0 = time.perf_counter()
        put = await self._put(job, loc + name, memoryview(data))
        return WriteResult(put.size, put.crc32c, False, time.perf_counter() - t0, 0.0)

    async def write_from(
        self, job: StepJob, loc: str, name: str, size: int, read: Callable[[int, memoryview], None]
    ) -> WriteResult:
        t0 = time.perf_counter()
        try:  # a part at a time as the upload takes them (``ObjectStore.put_from``)
            put = await self.store.put_from(loc + name, size, read, self._until(job))
        except ObjectStoreUnavailableError as e:
            failure = await explain(self.store, e, job.deadline)
            raise failure from None
        return WriteResult(put.size, put.crc32c, False, time.perf_counter() - t0, 0.0)

    async def _put(self, job: StepJob, key: str, data: memoryview) -> PutInfo:
        """One object of the attempt; a store that refuses it for good is asked why
        (``_storefull.explain``: out of space is named as such)."""
        try:
            return await self.store.put_file(key, data, self._until(job))
        except ObjectStoreUnavailableError as e:
            failure = await explain(self.store, e, job.deadline)
        raise failure

    async def discard(self, job: StepJob, loc: str, name: str) -> None:
        await self.store.delete([loc + name], self._until(job))

    async def seal(self, job: StepJob, loc: str) -> None:
        return None  # each upload was durable when it returned

    async def commit(self, job: StepJob, loc: str, attempt: str, manifest: bytes) -> None:
        check_deadline(job)
        key = manifest_key(job.step)
        # keep time back: after an unknown outcome the caller still removes the attempt
        until = max(time.monotonic() + 0.5, job.deadline - min(_CLEANUP_S, 0.2 * job.timeout))
        if self.lease is not None:
            # the lease ours for a third of its TTL at least (renewed now if need be), and the
            # create never sent after it could have been taken over
            until = min(until, await self.lease.confirm(self.lease.ttl / 3))
        try:
            result = await self.store.create_once(key, manifest, until)
        except ObjectStoreTimeoutError as e:
            if getattr(e, "outcome_unknown", False):
                job.failed_commits.add(attempt)  # a late landing is replaced by a retry of the step
            raise
        if result.won:
            self.view.learn(job.step, result.info.e_tag if result.info is not None else None, manifest)
        else:
            try:
                other = decode(result.stored, self.store.object_url(key)).attempt
            except CheckpointCorruptError:
                other = "unreadable"
            raise FileExistsError(
                errno.EEXIST,
                f"step {job.step} was committed by another attempt ({other}) while this one wrote",
                self.store.object_url(key),
            )

    async def abandon(self, job: StepJob, loc: str, ranks: Collection[int], leader: bool) -> None:
        if not leader:
            return  # the leader removes all the attempt's objects: a store has no file a write can hold
        try:
            # a bounded clean-up of keys no live writer can own; it may outlive the save's
            # deadline (run_save no longer waits for it then: it goes on in the background)
            await self._remove_prefix(loc, time.monotonic() + _CLEANUP_S)
        finally:
            self._land(job.step)  # what is not removed now, a later look finds

    async def _remove_prefix(self, prefix: str, deadline: float) -> None:
        keys = [o.key for o in await self.store.list(prefix, deadline)]
        if keys:
            await self.store.delete(keys, deadline)
            await self.store.remove_dirs(dirs_of(keys, prefix), deadline)
        if self.store.can_list_uploads:
            await self.store.abort_uploads(prefix, deadline=deadline)

    async def follow(self, job: StepJob, loc: str, attempt: str) -> None:
        return  # the leader commits alone (the conditional create)

    async def release(self, job: StepJob) -> None:
        return

    async def retire(self, job: StepJob) -> None:
        """After ``job`` committed (the leader): one look at the root (``_view``: a
        LIST of the marks and a flat LIST of what lies above the floor; no GET of the manifest
        just created), then from it the objects of other attempts of this step, ``keep_last``
        and, the lease being ours, the leftovers (and one LIST of incomplete uploads): a
        number of requests that depends on the steps kept, not on the steps ever written."""
        self._land(job.step)
        if self.lease is not None and not self.lease.held:
            log.warning("no clean-up or retention after step %d: the lease of %s is not ours", job.step,
                        self.store.url)
            return
        # run_save waits for this until the save's deadline, then leaves it to the background
        deadline = max(job.deadline, time.monotonic() + _CLEANUP_S)
        if self._looking is None:  # made on the writer loop, where every retire runs
            self._looking = asyncio.Lock()
        # one look at a time (the view is the writer's), and never beside the Checkpointer's retention
        async with self._looking, job.retention_lock if job.retention_lock is not None else contextlib.nullcontext():
            look = await self.view.look(deadline)
            retired: list[int] = []
            if job.keep_last is not None:
                retired = await retire_remote(self.store, job.keep_last, deadline, self.lease, found=look.steps,
                                              removed=self.view.removed)
                if retired:
                    log.info("retired steps %s under %s", retired, self.store.url)
            rest = [p for p in look.steps if p.step not in retired]
            if self.lease is None:
                mine = look.step(job.step)
                try:
                    if mine is not None and mine.manifest is not None:
                        await sweep_dead_attempts(self.store, mine.manifest, deadline)
                        await abort_stale_uploads(self.store, mine.manifest, deadline)
                except ObjectStoreError as e:
                    log.warning("could not remove dead attempts of step %d: %s", job.step, e)
            elif self.lease.held:
                # the lease is ours: what is not one of our saves in flight is dead
                flying = dict(self._in_flight)
                busy = look.busy | set(flying)
                found = await remove_dead(self.store, deadline, skip_steps=busy, looked=rest,
                                          keep_prefixes=[data_prefix(s, a) for s, a in flying.items()])
                gone = {k for x in found.leftovers for k in x.keys} if found.removed else set()
                for p in rest:
                    if p.listed and all(o.key in gone for o in p.listed):
                        self.view.removed(p.step)
