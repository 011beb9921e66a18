"""An S3-compatible prefix (``s3://bucket/prefix``) as a :class:`~asyncckpt.roots._root.Root`:
the store's discovery (``_steps``: one flat LIST, a GET per manifest), ownership (``_lease``),
leftovers (``_leftovers``), retention (``_remote.retire_remote``), bad marks on the store,
and the save protocol's ``ObjectBackend`` (commit by conditional create) for attempts. Every
call runs on the shared loop (``threads._sync``) with a deadline of ``deadline_s`` from the
call."""

from __future__ import annotations

import datetime as _dt
import logging
import math
import time
from collections.abc import Mapping, Sequence

from ..._errors import (
    CheckpointCorruptError,
    CheckpointReadError,
    ObjectIntegrityError,
    ObjectNotFoundError,
    ObjectStoreError,
)
from ...format._layout import data_prefix, step_dir_name
from ...format._manifest import FileEntry, Manifest, decode
from ...format._stepstates import victims
from ...threads._sync import run_sync
from .._badmarks import clear_on_store, record_on_store
from .._root import (
    Attempt,
    BackendAttempt,
    Capabilities,
    Claim,
    Leftover,
    Listed,
    StepReader,
    check_range,
    listed_file,
)
from ._backend import ObjectBackend
from ._client import ObjectStore
from ._lease import Lease
from ._leftovers import remove, survey
from ._remote import RemoteStep, abort_stale_uploads, open_store, retire_remote, rows_of, sweep_dead_attempts
from ._steps import newest_resumable, observe, observe_step, open_step, read_manifest, remove_bad, resumable

log = logging.getLogger("asyncckpt")
CAPS = Capabilities(
    "objstore", "lease", "conditional-create",
    by_commit_order=False, mmap=False, step_noun="prefix", checks_commit=False,
)
#: Ranged GETs of one object a load keeps in flight (the I/O threads of its reads).
GETS_IN_FLIGHT = 16
#: How long one call may take by default (a listing of a large root included).
DEFAULT_DEADLINE_S = 3600.0

_WHAT = {
    "uncommitted": "leftover of a save or push that never committed",
    "dead-attempt": "objects of an attempt that lost its step's commit",
    "upload": "incomplete multipart upload",
}


def listed(s: RemoteStep, url: str) -> Listed:
    """An ``ls`` row of the store's, in the shape every root lists (a local row's, key for
    key: what differs is where, a URL, and when, the store's clock)."""
    name = s.name.rstrip("/") or f"step_{s.step:08d}"
    modified = s.modified if s.modified is not None else s.created
    return Listed(
        s.step, name, f"{url.rstrip('/')}/{name}", s.status, s.complete, s.problem,  # type: ignore[arg-type]
        # a step known bad by its mark says why in ``bad``, as a local row does
        None if s.bad is not None else (s.reason or None), s.size, s.files, s.world_size, s.created, modified,
        s.attempt, s.bad, s.run)  # fmt: skip


class _LeaseClaim:
    def __init__(self, lease: Lease, owner: ObjectRoot) -> None:
        self._lease, self._owner = lease, owner

    def check(self) -> None:
        self._lease.check()

    def release(self) -> None:
        if self._owner.lease is self._lease:
            self._owner.lease = None
        self._lease.release()


class ObjectStepReader(StepReader):
    """A committed step of a store held by its attempt's prefix: the manifest read and its
    objects checked by one LIST at opening (``_steps.open_step``), every read a ranged GET of
    ``a-<attempt>/NAME`` (a later commit of the step cannot be mixed in: it has another
    attempt). A read fills its buffer with parallel ranged GETs (``get_range_into``), at most
    ``max_concurrency`` in flight. Every call is bounded by the
    deadline set at opening."""

    def __init__(self, store: ObjectStore, step: int, deadline: float) -> None:
        self._store, self._deadline = store, deadline
        self.manifest, raw = run_sync(lambda: open_step(store, step, deadline))
        self.manifest_raw, self.manifest_size = raw, len(raw)
        self._prefix = data_prefix(step, self.manifest.attempt)
        # two windows of a part each (one checksummed, the next being fetched): the scratch of
        # the store's own streamed reads; a file at a time, its ranges in parallel
        self.window = store.part_size
        self.parallel = 1
        self.in_flight = GETS_IN_FLIGHT

    def readv(self, name: str, offset: int, views: Sequence[memoryview]) -> None:
        # one ranged GET scattered over the views (a load's many small tensors: one request)
        entry = listed_file(self.manifest, name, self.locate())
        check_range(entry.size, offset, sum(len(v) for v in views))
        url = self.locate(name)
        try:
            run_sync(lambda: self._store.get_range_scatter(self._prefix + name, offset, list(views), self._deadline))
        except ObjectNotFoundError:  # gone: retired (still_there says) or damage
            raise CheckpointCorruptError("object listed in the manifest is missing", url) from None
        except ObjectIntegrityError as e:
            raise CheckpointCorruptError(f"object ended early ({e.strerror})", url) from None
        except ObjectStoreError as e:  # 503s, no answer in time: the store, not the data
            raise CheckpointReadError(e.errno, f"cannot read ({e.strerror})", url) from None

    def _fill(self, entry: FileEntry, offset: int, out: memoryview) -> None:
        url = self.locate(entry.name)
        piece = max(1 << 20, len(out) // self._store.max_concurrency)
        try:
            run_sync(lambda: self._store.get_range_into(self._prefix + entry.name, offset, out, self._deadline,
                                                        range_size=piece))  # fmt: skip
        except ObjectNotFoundError:  # gone: retired (still_there says) or damage
            raise CheckpointCorruptError("object listed in the manifest is missing", url) from None
        except ObjectIntegrityError:
            raise CheckpointCorruptError("object ended early", url) from None
        except ObjectStoreError as e:  # 503s, no answer in time: the store, not the data
            raise CheckpointReadError(e.errno, f"cannot read ({e.strerror})", url) from None

    def locate(self, name: str | None = None) -> str:
        if name is None:
            return self._store.object_url(step_dir_name(self.manifest.step))
        return self._store.object_url(self._prefix + name)

    def still_there(self) -> bool:
        try:
            found = run_sync(lambda: read_manifest(self._store, self.manifest.step, self._deadline))
        except CheckpointCorruptError:
            return False  # another manifest, one that does not decode: not this commit
        except ObjectStoreError:
            return True  # the store cannot tell now: the verdict on the bytes read stands
        return found is not None and found[0].attempt == self.manifest.attempt

    def close(self) -> None:
        return None  # nothing held open


class _ObjectAttempt(BackendAttempt):
    """An attempt of :meth:`ObjectRoot.begin`: once committed, the objects of other attempts
    of the step (they can never commit now) and its stale multipart uploads are removed, as a
    push always did."""

    def commit(self, manifest: bytes) -> None:
        super().commit(manifest)
        backend = self._backend
        assert isinstance(backend, ObjectBackend)
        store, lease, deadline = backend.store, backend.lease, self._job.deadline
        m = decode(manifest, store.object_url(step_dir_name(self._job.step)))

        async def sweep() -> None:
            if lease is not None:
                lease.check()  # removals only while the prefix is ours
            await sweep_dead_attempts(store, m, deadline)
            await abort_stale_uploads(store, m, deadline)

        try:
            run_sync(sweep)
        except Exception as e:  # noqa: BLE001 - the step is committed; what is left, gc removes
            log.warning("could not remove other attempts' objects of step %d under %s: %s", self._job.step,
                        store.url, e)


class ObjectRoot:
    """An object-store root (module docstring); makes no request until a method is called."""

    caps = CAPS

    def __init__(self, url: str, storage_options: Mapping[str, str] | None = None,
                 deadline_s: float = DEFAULT_DEADLINE_S, *, store: ObjectStore | None = None,
                 lease: Lease | None = None, probed: bool = False) -> None:  # fmt: skip
        self.store = store if store is not None else open_store(url, storage_options)
        self.url = self.store.url  # normalised: s3://bucket/prefix
        self.deadline_s = deadline_s
        #: the lease while :meth:`claim` holds it, or the caller's (removals check it first)
        self.lease: Lease | None = lease
        self._given = lease
        self._probed = probed  # whether the store was seen to enforce conditional creates

    @classmethod
    def over(cls, store: ObjectStore, lease: Lease | None = None, deadline_s: float = DEFAULT_DEADLINE_S,
             probed: bool = False) -> ObjectRoot:  # fmt: skip
        """The root of an open ``store`` (its client, part size and executor kept), with
        ``lease`` already held by the caller (tier mode's upload: the mirror's lease);
        ``probed``: the caller checked that the store enforces conditional creates."""
        return cls(store.url, None, deadline_s, store=store, lease=lease, probed=probed)

    def __repr__(self) -> str:
        return f"ObjectRoot({self.url!r})"

    def _deadline(self) -> float:
        return time.monotonic() + self.deadline_s

    def list_steps(self) -> list[Listed]:
        async def go() -> list[RemoteStep]:
            return [row for p in await observe(self.store, self._deadline()) for row in rows_of(p)]

        return [listed(s, self.url) for s in run_sync(go)]

    def newest_resumable(
        self, passed: list[tuple[int, CheckpointCorruptError]] | None = None, skip: frozenset[int] = frozenset()
    ) -> int | None:
        found = run_sync(lambda: newest_resumable(self.store, self._deadline(), skip, passed=passed))
        return None if found is None else found[0].step

    def resumable(self, newest: bool = False) -> list[Manifest]:
        if newest:
            found = run_sync(lambda: newest_resumable(self.store, self._deadline()))
            return [] if found is None else [found[0]]
        # one flat LIST of the root and a GET per manifest, whatever was ever written
        return [m for m, _ in reversed(run_sync(lambda: resumable(self.store, self._deadline())))]

    def open_step(self, step: int) -> Manifest:
        return run_sync(lambda: open_step(self.store, step, self._deadline()))[0]

    def open_reader(self, step: int) -> StepReader:
        return ObjectStepReader(self.store, step, self._deadline())

    def read(self, step: int, name: str, offset: int = 0, length: int | None = None) -> bytes:
        with self.open_reader(step) as reader:  # one GET of the manifest, one LIST: every size as listed
            return reader.read(name, offset, length)

    def locate(self, step: int, attempt: str | None = None, name: str | None = None) -> str:
        if name is None:
            return self.store.object_url(step_dir_name(step))
        return self.store.object_url(data_prefix(step, attempt) + name if attempt else f"{step_dir_name(step)}/{name}")

    def claim(self, role: str) -> Claim:
        lease = Lease(self.store, [], role)
        try:
            run_sync(lambda: lease.take(self._deadline()))
        except BaseException:
            lease.release()
            raise
        self.lease = lease
        return _LeaseClaim(lease, self)

    def begin(self, step: int, *, attempt: str | None = None, deadline_s: float | None = None) -> Attempt:
        if not self._probed:  # a store that ignores If-None-Match is refused, never raced
            run_sync(lambda: self.store.probe(self._deadline()))
            self._probed = True
        return _ObjectAttempt(ObjectBackend(self.store, lease=self.lease), self.url, step, deadline_s, attempt)

    def leftovers(self) -> list[Leftover]:
        deadline = self._deadline()

        async def go() -> list[Leftover]:
            found = await survey(self.store, deadline)
            # ages by the store's clock; without the lease nothing is written (the clock is
            # read by writing a scratch object), so this machine's
            if self.lease is not None and found.leftovers:
                now = await self.store.server_time(deadline)
            else:
                now = _dt.datetime.now(_dt.timezone.utc)
            return [Leftover(x.name, _WHAT[x.kind], x.size,
                             (now - x.modified).total_seconds() if x.modified is not None else math.inf, x)
                    for x in found.leftovers]  # fmt: skip

        return run_sync(go)

    def remove(self, leftovers: Sequence[Leftover]) -> None:
        if not leftovers:
            return
        if self.lease is not None:
            self.lease.check()
        run_sync(lambda: remove(self.store, [x.handle for x in leftovers], self._deadline()))

    def retire(self, keep_last: int, *, by_commit_order: bool = False, dry_run: bool = False) -> list[int]:
        if by_commit_order:
            raise ValueError("an object-store root keeps the highest steps (by_commit_order is for local roots)")
        deadline = self._deadline()
        if dry_run:
            found = run_sync(lambda: survey(self.store, deadline, uploads=False))
            return victims([(s, 0.0) for s in found.complete], keep_last)
        if self.lease is not None:
            self.lease.check()
        return sorted(run_sync(lambda: retire_remote(self.store, keep_last, deadline, self.lease)))

    def remove_bad(self, entry: Listed) -> None:
        if entry.state not in ("bad", "aside"):
            raise ValueError(f"{entry.name} is {entry.state}, not known bad: only bad steps are removed")
        deadline = self._deadline()

        async def go() -> None:
            p = await observe_step(self.store, entry.step, deadline)
            await remove_bad(self.store, p, deadline, self.lease)

        run_sync(go)

    def mark_bad(self, step: int, attempt: str, path: str, reason: str) -> bool:
        return bool(run_sync(lambda: record_on_store(self.store, step, attempt, path, reason, self._deadline())))

    def clear_bad(self, step: int, attempt: str) -> bool:
        return run_sync(lambda: clear_on_store(self.store, step, attempt, self._deadline()))

    def close(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None and lease is not self._given:  # a caller's lease is the caller's to release
            lease.release()

