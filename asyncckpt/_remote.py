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
ONE LIST of ``step_N/a-<attempt>/`` shows exactly the manifest's names with their sizes.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from . import _ownership
from ._bounds import MAX_MANIFEST_BYTES
from ._checksum import crc32c
from ._discovery import complete_checkpoints, pin_step, read_regular_file
from ._errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ._layout import check_step, parse_step_dir, step_dir_name, tmp_dir_name
from ._manifest import MANIFEST, Manifest, decode
from ._objstore import ObjectIntegrityError, ObjectNotFoundError, ObjectStore, ObjectStoreError, gather_or_cancel
from ._runs import same_run
from ._storage import remove_tree

if TYPE_CHECKING:
    from ._lease import Lease

log = logging.getLogger("asyncckpt")
T = TypeVar("T")

#: Default deadline of one push, pull or load call (seconds).
DEFAULT_DEADLINE_S = 3600.0
_ATTEMPT = re.compile(r"^[0-9a-f]{1,64}$")
#: Files of one step uploaded or downloaded at a time (each with its own parallel parts).
_FILES_IN_FLIGHT = 2


def is_url(root: object) -> bool:
    """Whether ``root`` names an object store (``s3://...``) rather than a local path."""
    return isinstance(root, str) and root.startswith("s3://")


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


def run_sync(fn: Callable[[], Awaitable[T]]) -> T:
    """Run ``await fn()`` on a fresh event loop in its own thread and return its result.

    Its own thread: callable from code that already runs an event loop (a notebook). Every
    object-store call inside has a deadline, so the join ends.
    """
    box: dict[str, Any] = {}

    def main() -> None:
        async def go() -> T:
            return await fn()

        try:
            box["value"] = asyncio.run(go())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread, type kept
            box["error"] = e

    t = threading.Thread(target=main, name="asyncckpt-remote", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    result: T = box["value"]
    return result


def _check_attempt(m: Manifest, where: str) -> str:
    if not _ATTEMPT.match(m.attempt):
        raise CheckpointCorruptError(f"manifest attempt id {m.attempt[:80]!r} is not a hex token", where)
    return m.attempt


def manifest_key(step: int) -> str:
    return f"{step_dir_name(step)}/{MANIFEST}"


def data_prefix(step: int, attempt: str) -> str:
    return f"{step_dir_name(step)}/a-{attempt}/"


# ------------------------------------------------------------------------------ discovery


async def candidate_steps(store: ObjectStore, deadline: float) -> list[int]:
    """Steps with a ``step_N/`` prefix on the store, newest first (numeric order)."""
    names = await store.list_dirs("", deadline)
    return sorted({s for n in names if (s := parse_step_dir(n)) is not None}, reverse=True)


async def read_manifest(store: ObjectStore, step: int, deadline: float) -> tuple[Manifest, bytes] | None:
    """The decoded manifest of ``step`` and its bytes, ``None`` if there is none."""
    key = manifest_key(step)
    url = store.object_url(key)
    try:
        raw = await store.get_bytes(key, deadline, limit=MAX_MANIFEST_BYTES)
    except ObjectNotFoundError:
        return None
    except ObjectIntegrityError:
        raise CheckpointCorruptError(f"manifest larger than {MAX_MANIFEST_BYTES} bytes", url) from None
    m = decode(raw, url)
    if m.step != step:
        raise CheckpointCorruptError(f"manifest is for step {m.step}", url)
    _check_attempt(m, url)
    return m, raw


async def check_objects(store: ObjectStore, m: Manifest, deadline: float) -> None:
    """One LIST of the attempt prefix must show exactly the manifest's names and sizes."""
    prefix = data_prefix(m.step, m.attempt)
    listed = await store.list(prefix, deadline)
    have = {o.key[len(prefix) :]: o.size for o in listed}
    for f in m.files:
        if f.name not in have:
            raise CheckpointCorruptError("object listed in the manifest is missing", store.object_url(prefix + f.name))
        if have[f.name] != f.size:
            raise CheckpointCorruptError(f"size {have[f.name]} != {f.size} recorded in the manifest",
                                         store.object_url(prefix + f.name))
    extra = sorted(set(have) - {f.name for f in m.files})
    if extra:
        raise CheckpointCorruptError(f"unexpected objects {extra[:5]}", store.object_url(prefix))


async def open_step(store: ObjectStore, step: int, deadline: float) -> tuple[Manifest, bytes]:
    """The manifest (and its bytes) of complete ``step``; ``CheckpointNotFoundError`` if it has
    no manifest, ``CheckpointCorruptError`` (naming the URL) if it is not complete."""
    found = await read_manifest(store, step, deadline)
    if found is None:
        raise CheckpointNotFoundError(f"no checkpoint for step {step} under {store.url}")
    await check_objects(store, found[0], deadline)
    return found


async def complete_steps(store: ObjectStore, deadline: float) -> list[tuple[Manifest, bytes]]:
    """Every complete step, newest first; incomplete or corrupt ones are skipped (logged)."""
    out = []
    for step in await candidate_steps(store, deadline):
        try:
            out.append(await open_step(store, step, deadline))
        except CheckpointNotFoundError:
            continue
        except CheckpointCorruptError as e:
            log.info("skipping remote step %d: %s", step, e)
    return out


async def newest_complete(
    store: ObjectStore, deadline: float, skip: frozenset[int] = frozenset()
) -> tuple[Manifest, bytes] | None:
    """The newest complete step not in ``skip`` (corrupt ones are logged and passed over)."""
    for step in await candidate_steps(store, deadline):
        if step in skip:
            continue
        try:
            return await open_step(store, step, deadline)
        except CheckpointNotFoundError:
            continue
        except CheckpointCorruptError as e:
            log.warning("skipping remote step %d: %s", step, e)
    return None


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
    """One ``step_N/`` prefix on the store, complete or not (for ``asyncckpt ls``)."""

    step: int
    complete: bool
    reason: str
    nbytes: int
    files: int
    world_size: int | None
    created: float | None
    attempt: str | None
    run: str | None = None  # the run of a complete step's manifest (None: none recorded)


def scan(url: str, *, storage_options: Mapping[str, str] | None = None, deadline_s: float = 300.0) -> list[RemoteStep]:
    """Every step prefix under ``url``, oldest first, with whether it is complete and why not."""
    store = open_store(url, storage_options)

    async def go() -> list[RemoteStep]:
        deadline = time.monotonic() + deadline_s
        out = []
        for step in sorted(await candidate_steps(store, deadline)):
            try:
                found = await read_manifest(store, step, deadline)
                if found is None:
                    if not await store.list(step_dir_name(step) + "/", deadline):
                        continue  # an empty "directory" some stores keep after a deletion
                    out.append(RemoteStep(step, False, "no manifest (a push in progress or interrupted)", 0, 0,
                                          None, None, None))
                    continue
                m = found[0]
                await check_objects(store, m, deadline)
                out.append(RemoteStep(step, True, "", sum(f.size for f in m.files), len(m.files) + 1, m.world_size,
                                      m.created, m.attempt, m.run))
            except CheckpointCorruptError as e:
                out.append(RemoteStep(step, False, str(e), 0, 0, None, None, None))
        return out

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


class _Mapped:
    """A read-only mapping of an open local file (``b""`` for an empty one)."""

    def __init__(self, fd: int, size: int) -> None:
        self.map = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        self.view = memoryview(self.map) if self.map is not None else memoryview(b"")

    def close(self) -> None:
        self.view.release()
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a cancelled CRC thread still reads it: the GC closes it later
                pass


async def _upload_files(store: ObjectStore, pinned_path: str, opened: dict[str, _Mapped], m: Manifest,
                        names: Iterable[str], deadline: float) -> None:
    prefix = data_prefix(m.step, m.attempt)
    sem = asyncio.Semaphore(_FILES_IN_FLIGHT)

    async def one(name: str) -> None:
        f = m.file(name)
        async with sem:
            info = await store.put_file(prefix + name, opened[name].view, deadline)
        if info.crc32c != f.crc32c:
            # the local file is not what was committed: never commit it remotely
            raise CheckpointCorruptError(
                f"checksum mismatch (CRC-32C {info.crc32c:08x} read, {f.crc32c:08x} in the manifest); not pushed",
                os.path.join(pinned_path, name),
            )

    await gather_or_cancel([one(n) for n in names])


async def _sweep_dead_attempts(store: ObjectStore, m: Manifest, deadline: float) -> None:
    """Delete objects under ``step_N/`` of attempts the committed manifest does not name: they
    can never commit (their create_once loses), so they are dead whoever wrote them."""
    sd = step_dir_name(m.step) + "/"
    keep = data_prefix(m.step, m.attempt)
    dead = [o.key for o in await store.list(sd, deadline) if o.key != manifest_key(m.step) and
            not o.key.startswith(keep)]
    if dead:
        await store.delete(dead, deadline)
        log.info("removed %d object(s) of dead attempts under %s", len(dead), store.object_url(sd))


async def _abort_stale_uploads(store: ObjectStore, m: Manifest, deadline: float) -> None:
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
        _check_attempt(m, mpath)
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
        opened: dict[str, _Mapped] = {}
        try:
            for name in names:
                fd = pinned.open_file(name, m.file(name).size)
                try:
                    opened[name] = _Mapped(fd, m.file(name).size)
                finally:
                    os.close(fd)
            await _upload_files(store, pinned.path, opened, m, names, deadline)
        finally:
            for o in opened.values():
                o.close()
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
        await _sweep_dead_attempts(store, m, deadline)
        await _abort_stale_uploads(store, m, deadline)
    return PushResult(step, status, store.object_url(step_dir_name(step)), sum(f.size for f in m.files),
                      time.monotonic() - t0)


async def retire_remote(
    store: ObjectStore, keep_last: int, deadline: float, lease: Lease | None = None,
    protect: frozenset[int] = frozenset(), run: str | None = None,
) -> list[int]:
    """Keep the newest ``keep_last`` complete remote steps; retire older complete ones:
    the manifest first (the step stops being complete at once), then its objects. With
    ``lease``: nothing is removed once it was taken over (``RootInUseError``). Steps in
    ``protect`` (tier mode: the step just uploaded) are never retired; with ``run``, only
    that run's steps (``_runs.same_run``) count and go: another run's are not this job's."""
    complete = [c for c in await complete_steps(store, deadline) if run is None or same_run(c[0].run, run)]
    removed = []
    for m, _ in complete[keep_last:]:
        if m.step in protect:
            continue
        if lease is not None:
            lease.check()
        await store.delete([manifest_key(m.step)], deadline)
        rest = [o.key for o in await store.list(step_dir_name(m.step) + "/", deadline)]
        if rest:
            await store.delete(rest, deadline)
        removed.append(m.step)
    return sorted(removed)


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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def _download(store: ObjectStore, key: str, path: str, size: int, crc: int, deadline: float) -> None:
    """Ranged GETs of ``key`` straight into a new local file, CRC-32C checked, fsynced."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        os.ftruncate(fd, size)
        got = 0
        if size:
            with mmap.mmap(fd, size) as mm:
                view = memoryview(mm)
                try:
                    await store.get_range_into(key, 0, view, deadline)
                    got = await asyncio.to_thread(crc32c, view)
                    mm.flush()
                finally:
                    view.release()
        else:
            got = crc32c(b"")
        if got != crc:
            raise CheckpointCorruptError(f"checksum mismatch (CRC-32C {got:08x} read, {crc:08x} in the manifest)",
                                         store.object_url(key))
        os.fsync(fd)
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
        run_sync(lambda: _download_step(store, m, tmp, deadline))
        mfd = os.open(os.path.join(tmp, MANIFEST), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(mfd, raw)
            os.fsync(mfd)
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
