"""Checkpoints on an object store: push committed local steps, find, list and pull remote ones.

Torch-free (the CLI's ``push``, ``pull`` and ``ls s3://...`` use it); loading into tensors is in
``_remote_load``. Names on the store (docs/design/object-stores.md, section 1)::

    P/step_00000300/manifest.json                 the commit object, created once (If-None-Match: *)
    P/step_00000300/a-<attempt>/rank00000.safetensors
    P/step_00000300/a-<attempt>/rank00000.json    <attempt>: the local manifest's attempt id

The manifest bytes are the local manifest's, unchanged: its sizes and CRC-32Cs are copied,
never recomputed. A push uploads every file of a step (CRC-32C computed as the bytes go up,
compared with the manifest before anything is committed; a HEAD checks each stored size),
then ``create_once``s the manifest - the commit point. Data keys are attempt-unique and the
content is the committed local file, so an interrupted push leaves no complete-looking step
and re-running it overwrites the same keys: nothing is left over after a successful push.
Unlike a save, a push needs no tombstone when the manifest create's outcome is unknown: the
data were complete and verified before the create was sent, so a late-landing manifest is a
correct checkpoint.

A remote step is complete iff its manifest decodes (checksum, canonical form, its step) and
ONE LIST of ``step_N/a-<attempt>/`` shows exactly the manifest's names with their sizes; it is
resumable unless it is also known bad. Discovery and retention are ``_steps``'s (the
store's adapter of the one rule in ``_stepstates``); this module re-exports them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ..._errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, ObjectStoreError
from ...format._bounds import MAX_MANIFEST_BYTES
from ...format._layout import aside_key, check_step, step_dir_name, tmp_dir_name
from ...format._layout import data_prefix as data_prefix  # re-exported: the names of the store's keys
from ...format._layout import manifest_key as manifest_key
from ...format._manifest import MANIFEST, Manifest, decode
from ...threads._sync import run_sync
from .._scheme import is_url
from ..posix import _ownership
from ..posix._discovery import complete_checkpoints, pin_step, read_regular_file
from ..posix._fileio import read_exact, reserve, write_all
from ..posix._storage import remove_tree
from ._client import ObjectStore
from ._connection import gather_or_cancel
from ._steps import StepPrefix, aside_keys, check_attempt, dirs_of, newest_resumable, observe, resumable
from ._steps import candidate_steps as candidate_steps
from ._steps import check_objects as check_objects
from ._steps import open_step as open_step
from ._steps import read_manifest as read_manifest
from ._steps import retire as _retire_steps

if TYPE_CHECKING:
    from ._lease import Lease

log = logging.getLogger("asyncckpt")
T = TypeVar("T")

#: Default deadline of one push, pull or load call (seconds).
DEFAULT_DEADLINE_S = 3600.0
#: Files of one step uploaded or downloaded at a time (each with its own parallel parts).
_FILES_IN_FLIGHT = 2
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class RemoteCheckpointInfo:
    """A complete checkpoint on an object store (``url``: its step prefix; ``run``: the id of
    the run it belongs to, ``None`` for a step written before run ids)."""

    step: int
    url: str
    nbytes: int
    world_size: int = 1
    created: float = 0.0
    attempt: str = ""
    run: str | None = field(default=None, compare=False)  # compared as before runs were recorded


@dataclass(frozen=True)
class PushResult:
    """What :func:`push` did to one step: ``"pushed"``, or ``"present"`` (already committed
    remotely with these very manifest bytes; missing objects, if any, were uploaded again)."""

    step: int
    status: Literal["pushed", "present"]
    url: str
    nbytes: int
    seconds: float


def open_store(url: str, storage_options: Mapping[str, str] | None = None, **kwargs: Any) -> ObjectStore:
    """An :class:`ObjectStore` for ``url`` (no I/O)."""
    if not is_url(url):
        raise ValueError(f"not an object-store URL (s3://bucket/prefix): {url!r}")
    return ObjectStore(url, storage_options, **kwargs)


# ------------------------------------------------------------------------------ discovery


async def complete_steps(store: ObjectStore, deadline: float) -> list[tuple[Manifest, bytes]]:
    """Every resumable step, newest first (``_steps.resumable``)."""
    return await resumable(store, deadline)


async def newest_complete(
    store: ObjectStore, deadline: float, skip: frozenset[int] = frozenset()
) -> tuple[Manifest, bytes] | None:
    """The newest resumable step not in ``skip``; corrupt and known-bad ones are logged and
    passed over (``_steps.newest_resumable``)."""
    return await newest_resumable(store, deadline, skip)


def info_of(store: ObjectStore, m: Manifest) -> RemoteCheckpointInfo:
    return RemoteCheckpointInfo(m.step, store.object_url(step_dir_name(m.step)), m.nbytes, m.world_size, m.created,
                                m.attempt, m.run)


def find_latest(url: str, *, storage_options: Mapping[str, str] | None = None,
                deadline_s: float = 300.0) -> RemoteCheckpointInfo | None:
    """The newest complete checkpoint under ``url``, or ``None`` if there is none."""
    store = open_store(url, storage_options)

    async def go() -> RemoteCheckpointInfo | None:
        found = await newest_complete(store, time.monotonic() + deadline_s)
        return None if found is None else info_of(store, found[0])

    return run_sync(go)


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


# ----------------------------------------------------------------------------------- push


def _select_steps(root: str, steps: str | int | Iterable[int] | None) -> list[int]:
    local = sorted(i.step for i in complete_checkpoints(root))
    if steps is None:
        return local
    if steps == "latest":
        if not local:
            raise CheckpointNotFoundError(f"no complete checkpoint under {root}")
        return [local[-1]]
    if isinstance(steps, str):
        raise ValueError(f"steps must be None, 'latest', a step or a list of steps, not {steps!r}")
    wanted = [check_step(steps)] if isinstance(steps, int) else [check_step(s) for s in steps]
    return sorted(set(wanted))


async def upload_files(store: ObjectStore, pinned_path: str, opened: dict[str, int], m: Manifest,
                        names: Iterable[str], deadline: float) -> None:
    """Upload ``names`` (open read-only in ``opened``) read with ``pread`` part by part (never
    mapped: a read error is an ``OSError`` naming the file, not a SIGBUS)."""
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


async def push_step(
    store: ObjectStore, root: str, step: int, deadline: float, lease: Lease | None = None
) -> PushResult:
    """Upload committed local ``step`` and commit it on the store (see the module docstring).

    With ``lease`` (the prefix's, held by the caller): ``RootInUseError`` once it was taken
    over, checked before anything is written or removed; the commit is sent only while the
    lease is ours (as a Checkpointer's on an ``s3://`` root)."""
    t0 = time.monotonic()
    if lease is not None:
        lease.check()
    with pin_step(root, step) as pinned:
        m = pinned.manifest
        assert m is not None
        mpath = os.path.join(pinned.path, MANIFEST)
        try:
            raw = read_regular_file(mpath, MAX_MANIFEST_BYTES, dir_fd=pinned.fd, name=MANIFEST)
        except OSError as e:
            raise CheckpointCorruptError(f"manifest unreadable ({e.strerror})", mpath) from None
        if decode(raw, mpath) != m:
            raise CheckpointCorruptError("manifest changed while being pushed", mpath)
        check_attempt(m, mpath)
        mkey = manifest_key(step)
        remote = await read_manifest(store, step, deadline)
        names: list[str] = [f.name for f in m.files]
        status: Literal["pushed", "present"] = "pushed"
        if remote is not None:
            if remote[1] != raw:
                raise CheckpointError(
                    f"step {step} is already committed at {store.object_url(mkey)} by another attempt "
                    f"({remote[0].attempt}; the local one is {m.attempt}): not overwritten"
                )
            status = "present"
            # committed with our bytes: upload again only what is missing (a repair; same keys)
            prefix = data_prefix(step, m.attempt)
            have = {o.key[len(prefix) :]: o.size for o in await store.list(prefix, deadline)}
            names = [f.name for f in m.files if have.get(f.name) != f.size]
        opened: dict[str, int] = {}  # every file opened first: a retirement starting later cannot take one
        try:
            for name in names:
                opened[name] = pinned.open_file(name, m.file(name).size)
            await upload_files(store, pinned.path, opened, m, names, deadline)
        finally:
            for fd in opened.values():
                os.close(fd)
        if status == "pushed":
            until = deadline
            if lease is not None:  # ours for a third of its TTL at least, or no commit
                until = min(deadline, await lease.confirm(lease.ttl / 3))
            result = await store.create_once(mkey, raw, until)
            if not result.won:
                try:
                    other = decode(result.stored, store.object_url(mkey)).attempt
                except CheckpointCorruptError:
                    other = "unreadable"
                raise CheckpointError(
                    f"step {step} was committed at {store.object_url(mkey)} by another attempt ({other}) "
                    "while this push ran: not overwritten"
                )
        if lease is not None:
            lease.check()  # removals only while the prefix is ours
        await sweep_dead_attempts(store, m, deadline)
        await abort_stale_uploads(store, m, deadline)
    return PushResult(step, status, store.object_url(step_dir_name(step)), sum(f.size for f in m.files),
                      time.monotonic() - t0)


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


def push(
    root: str | os.PathLike[str],
    url: str,
    *,
    steps: str | int | Iterable[int] | None = None,
    storage_options: Mapping[str, str] | None = None,
    keep_last: int | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
    part_size: int | None = None,
) -> list[PushResult]:
    """Upload committed local checkpoints under ``root`` to ``url`` (``s3://bucket/prefix``).

    ``steps``: ``None`` every complete local step, ``"latest"`` the newest, or a step / list of
    steps. Idempotent: a step already committed remotely with the same manifest is skipped
    (``status="present"``). A local file whose CRC-32C differs from its manifest is never
    committed (``CheckpointCorruptError`` naming it). ``keep_last``: afterwards retire complete
    remote steps beyond the newest ``keep_last``. Everything within ``deadline_s``.
    """
    root_s = os.fspath(root)
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise ValueError(f"keep_last must be a positive int or None, not {keep_last!r}")
    chosen = _select_steps(root_s, steps)
    kwargs: dict[str, Any] = {} if part_size is None else {"part_size": part_size}
    store = open_store(url, storage_options, **kwargs)

    async def go() -> list[PushResult]:
        from ._lease import held  # the prefix's lease: no push into a prefix a live job writes

        deadline = time.monotonic() + deadline_s
        await store.probe(deadline)  # a store that ignores If-None-Match is refused, never raced
        async with held(store, "asyncckpt push", deadline) as lease:
            out = [await push_step(store, root_s, s, deadline, lease) for s in chosen]
            if keep_last is not None:
                removed = await retire_remote(store, keep_last, deadline, lease)
                if removed:
                    log.info("retired remote steps %s under %s", removed, store.url)
        return out

    return run_sync(go)


# ----------------------------------------------------------------------------------- pull


def _fsync(fd: int, path: str) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror} (fsync)", path) from None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        _fsync(fd, path)
    finally:
        os.close(fd)


def _reserve_files(m: Manifest, tmp: str) -> None:
    """Create every data file of ``m`` in ``tmp`` at its full size, its space allocated
    (``fallocate``) where the file system can: a disk without room for the step fails here
    with ENOSPC, before the first byte is downloaded."""
    for f in m.files:
        path = os.path.join(tmp, f.name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o644)
        try:
            reserve(fd, f.size, path)
        finally:
            os.close(fd)


async def _download(store: ObjectStore, key: str, path: str, size: int, crc: int, deadline: float) -> None:
    """Ranged GETs of ``key`` written (``pwrite``, never through a mapping: a full disk or an
    I/O error is an ``OSError`` naming the file, not a SIGBUS) into the file
    :func:`_reserve_files` made, CRC-32C checked, fsynced."""
    fd = os.open(path, os.O_WRONLY | _CLOEXEC)
    try:
        got = await store.get_to(key, size, lambda offset, data: write_all(fd, data, offset, path), deadline)
        if got != crc:
            raise CheckpointCorruptError(f"checksum mismatch (CRC-32C {got:08x} read, {crc:08x} in the manifest)",
                                         store.object_url(key))
        await asyncio.to_thread(_fsync, fd, path)
    finally:
        os.close(fd)


async def _remote_step(store: ObjectStore, step: int | None, deadline: float) -> tuple[Manifest, bytes]:
    if step is None:
        found = await newest_complete(store, deadline)
        if found is None:
            raise CheckpointNotFoundError(f"no complete checkpoint under {store.url}")
        return found
    return await open_step(store, step, deadline)


async def _download_step(store: ObjectStore, m: Manifest, tmp: str, deadline: float) -> None:
    """Download every data file of ``m`` into ``tmp`` (reserved by :func:`_reserve_files`)."""
    prefix = data_prefix(m.step, m.attempt)
    sem = asyncio.Semaphore(_FILES_IN_FLIGHT)

    async def one(name: str, size: int, crc: int) -> None:
        async with sem:
            await _download(store, prefix + name, os.path.join(tmp, name), size, crc, deadline)

    await gather_or_cancel([one(f.name, f.size, f.crc32c) for f in m.files])


def pull_step(store: ObjectStore, root: str, step: int | None, deadline: float) -> tuple[int, str]:
    """Download complete remote ``step`` (newest if ``None``) into ``root`` as a committed
    checkpoint: ``step_N.tmp-<attempt>/``, every file fsynced, the manifest last, the
    directory fsynced, renamed to ``step_N``, the root fsynced. Returns (step, status)."""
    m, raw = run_sync(lambda: _remote_step(store, step, deadline))
    final = os.path.join(root, step_dir_name(m.step))
    if os.path.lexists(final):
        with pin_step(root, m.step) as pinned:
            local = read_regular_file(os.path.join(final, MANIFEST), MAX_MANIFEST_BYTES, dir_fd=pinned.fd,
                                      name=MANIFEST)
        if local == raw:
            return m.step, "present"
        raise CheckpointError(f"{final} already holds another commit of step {m.step}: not overwritten")
    tmp = os.path.join(root, tmp_dir_name(m.step, m.attempt))
    if os.path.lexists(tmp):
        remove_tree(tmp)  # our own leftover of an earlier pull (we hold the root's ownership)
    os.mkdir(tmp, 0o755)
    try:
        _reserve_files(m, tmp)
        run_sync(lambda: _download_step(store, m, tmp, deadline))
        mpath = os.path.join(tmp, MANIFEST)
        mfd = os.open(mpath, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o644)
        try:
            write_all(mfd, memoryview(raw), 0, mpath)
            _fsync(mfd, mpath)
        finally:
            os.close(mfd)
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        try:
            remove_tree(tmp)
        except OSError as e:
            log.warning("could not remove %s after a failed pull: %s", tmp, e)
        raise
    return m.step, "pulled"


def pull(
    url: str,
    root: str | os.PathLike[str],
    *,
    step: int | None = None,
    storage_options: Mapping[str, str] | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> tuple[int, str]:
    """Download the newest (or ``step``) complete checkpoint under ``url`` into local ``root``
    as a committed checkpoint a ``Checkpointer`` resumes from. Takes the root's ownership for
    the call (``RootInUseError`` if a Checkpointer owns it). Returns ``(step, "pulled")`` or
    ``(step, "present")`` when ``root`` already holds that very commit."""
    if step is not None:
        check_step(step)
    root_s = os.fspath(root)
    os.makedirs(root_s, exist_ok=True)
    store = open_store(url, storage_options)
    own = _ownership.acquire(root_s, [], role="asyncckpt pull")
    try:
        return pull_step(store, root_s, step, time.monotonic() + deadline_s)
    finally:
        own.release()
