"""A local directory as a :class:`~asyncckpt.roots._root.Root`: the library's POSIX discovery
(``_discovery``), listing (``_listing``), ownership (``_ownership``: a flock), retention and
leftovers (``_retention``), and the save protocol's :class:`~asyncckpt.roots._backend.PosixBackend`
(commit by rename, fsyncs around it) for attempts."""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import os
import threading
import time
import uuid
from collections.abc import Collection, Sequence

from ..._errors import CheckpointCorruptError, CheckpointNotFoundError
from ...format._layout import deleting_dir_name, parse_step_dir, step_dir_name
from ...format._manifest import MANIFEST, FileEntry, Manifest
from ...threads._sync import run_sync
from .._backend import PosixBackend
from .._badmarks import clear, record_bad
from .._readfault import read_error
from .._root import Attempt, BackendAttempt, Capabilities, Claim, Leftover, Listed, StepReader, listed_file
from . import _discovery, _ownership
from ._discovery import PinnedStep, open_step, pin_step
from ._listing import StepDir, scan, usage
from ._osops import DEFAULT_OPS
from ._remove_tree import remove_tree
from ._retention import choose_victims, leftovers, retire
from ._storage import Storage

#: The most files one :class:`PosixStepReader` holds open.
MAX_OPEN = 16

CAPS = Capabilities(
    "posix", "flock", "rename",
    by_commit_order=True, mmap=True, step_noun="directory", checks_commit=True,
)


def listed(d: StepDir) -> Listed:
    """A listing row of ``_listing.scan``'s, in the shape every root lists."""
    return Listed(d.step, d.name, os.path.abspath(d.path), d.state, d.complete, d.problem, d.reason, d.size,
                  d.files, d.ranks, d.created, d.modified, d.attempt, d.bad, d.run, d.note)  # fmt: skip


class _FlockClaim:
    def __init__(self, own: _ownership.Ownership) -> None:
        self._own = own

    def check(self) -> None:
        return None  # a flock is held until released or the process ends: it cannot be lost

    def release(self) -> None:
        self._own.release()


class PosixStepReader(StepReader):
    """A step directory held by its handle (``_discovery.PinnedStep``) and its files by their
    descriptors, opened on first read (a regular file of exactly the listed size, never
    through a link): at most :data:`MAX_OPEN` of them, the least recently used one not being
    read closed first (a step of thousands of ranks opens no more); one that failed on I/O is
    opened afresh by the next read (a retry). Reads are ``preadv`` into the caller's buffer.
    ``names``: hold only those of the manifest's files (a node's part of a step,
    ``roots._nodeparts``); a read of another raises ``CheckpointNotFoundError``."""

    def __init__(self, root: str, step: int, names: Collection[str] | None = None) -> None:
        pinned = pin_step(root, step, names)
        self._names = None if names is None else frozenset(names)
        assert pinned.manifest is not None
        self._pinned: PinnedStep = pinned
        self.manifest = pinned.manifest
        self.notes = tuple(pinned.unlisted)
        # the bytes a copy commits: those the pinned manifest was decoded from (a second read
        # would race retention: a step retired after pinning is gone, never "corrupt")
        raw = pinned.manifest_raw
        self.manifest_raw, self.manifest_size = raw, len(raw)
        self._fds: collections.OrderedDict[str, int] = collections.OrderedDict()  # least recently used first
        self._using: collections.Counter[str] = collections.Counter()  # reads in flight per file
        self._lock = threading.Lock()
        self._held: set[str] = set()  # files whose descriptor fileno() gave out: open until close

    def _take(self, entry: FileEntry) -> int:
        """The descriptor of ``entry``'s file, counted as in use until :meth:`_give`."""
        if self._names is not None and entry.name not in self._names:
            raise CheckpointNotFoundError(f"{entry.name} is not in this part of step {self.manifest.step}",
                                          self.locate(entry.name))  # fmt: skip
        with self._lock:
            if self._pinned.fd < 0:
                raise ValueError("read of a closed step reader")
            fd = self._fds.get(entry.name)
            if fd is None:
                for name in [n for n in self._fds if not self._using[n]][: max(0, len(self._fds) + 1 - MAX_OPEN)]:
                    os.close(self._fds.pop(name))
                fd = self._fds[entry.name] = self._pinned.open_file(entry.name, entry.size)
                if hasattr(os, "posix_fadvise"):
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    except OSError:
                        pass  # only a hint
            self._fds.move_to_end(entry.name)
            self._using[entry.name] += 1
            return fd

    def _give(self, name: str, drop: bool) -> None:
        with self._lock:
            self._using[name] -= 1
            if drop and not self._using[name] and name in self._fds:
                os.close(self._fds.pop(name))

    def _fill(self, entry: FileEntry, offset: int, out: memoryview) -> None:
        fd = self._take(entry)
        path = self.locate(entry.name)
        got, failed = 0, False
        try:
            while got < len(out):
                n = os.preadv(fd, [out[got:]], offset + got)
                if n <= 0:
                    raise CheckpointCorruptError("file ended early", path)
                got += n
        except OSError as e:  # EIO, a timeout: the storage, not the data (CheckpointReadError)
            failed = True  # a retry opens it afresh
            raise read_error(e, "cannot read", path) from None
        finally:
            self._give(entry.name, failed)

    def fileno(self, name: str) -> int:
        entry = listed_file(self.manifest, name, self.locate())
        with self._lock:
            if name in self._held:
                return self._fds[name]
        fd = self._take(entry)  # counted in use for good: never closed to make room
        with self._lock:
            if name in self._held:  # another thread got there first
                self._using[name] -= 1
            self._held.add(name)
        return fd

    def locate(self, name: str | None = None) -> str:
        where = os.path.abspath(self._pinned.path)
        return where if name is None else os.path.join(where, name)

    def still_there(self) -> bool:
        return self._pinned.still_there()

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), collections.OrderedDict()
        for fd in fds:
            os.close(fd)
        self._pinned.close()


class PosixRoot:
    """A root directory on a POSIX file system (module docstring). ``path`` must exist for
    every call but :meth:`list_steps`, which names a missing root ``CheckpointNotFoundError``."""

    caps = CAPS

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.url = os.path.abspath(self.path)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        return f"PosixRoot({self.path!r})"

    def _storage(self) -> Storage:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-root")
        return Storage(self._pool)

    def _need_dir(self) -> None:
        """The root is a directory, and not a step's own (else ``CheckpointNotFoundError``)."""
        if not os.path.isdir(self.path):
            raise CheckpointNotFoundError(f"{self.path} is not a directory")
        hint = step_dir_hint(self.path)
        if hint is not None:
            raise CheckpointNotFoundError(f"no complete checkpoint under {self.path}: {hint}")

    def _may_be_root(self) -> None:
        """A look for steps (``find_latest``, ``latest()``, ``steps()``): a root that does not
        exist yet holds none, but a file or a step's own directory is a wrong path, never "no
        checkpoint" (a run would start from scratch beside its checkpoints)."""
        if os.path.lexists(self.path) and not os.path.isdir(self.path):
            raise NotADirectoryError(errno.ENOTDIR, "the checkpoint root is not a directory", self.path)
        hint = step_dir_hint(self.path)
        if hint is not None:
            raise ValueError(f"{self.path} is not a checkpoint root: {hint}")

    def list_steps(self) -> list[Listed]:
        return [listed(d) for d in scan(self.path)]

    def newest_resumable(
        self, passed: list[tuple[int, CheckpointCorruptError]] | None = None, skip: frozenset[int] = frozenset()
    ) -> int | None:
        self._need_dir()
        skipped: dict[int, CheckpointCorruptError] = {}
        found = _discovery.newest_resumable(self.path, skip, skipped)
        if passed is not None:
            passed.extend(sorted(skipped.items(), reverse=True))
        return None if found is None else found.step

    def resumable(self, newest: bool = False) -> list[Manifest]:
        self._may_be_root()
        if newest:
            found = _discovery.newest_resumable(self.path)
            return [] if found is None else [found]
        return _discovery.resumable(self.path)

    def open_step(self, step: int) -> Manifest:
        self._need_dir()
        return open_step(self.path, step)[1]

    def open_reader(self, step: int) -> StepReader:
        return PosixStepReader(self.path, step)

    def read(self, step: int, name: str, offset: int = 0, length: int | None = None) -> bytes:
        with self.open_reader(step) as reader:
            return reader.read(name, offset, length)

    def locate(self, step: int, attempt: str | None = None, name: str | None = None) -> str:
        where = os.path.join(self.url, step_dir_name(step))
        return where if name is None else os.path.join(where, name)

    def claim(self, role: str) -> Claim:
        self._need_dir()
        return _FlockClaim(_ownership.acquire(self.path, [], role=role))

    def begin(self, step: int, *, attempt: str | None = None, deadline_s: float | None = None) -> Attempt:
        self._need_dir()
        return BackendAttempt(PosixBackend(self._storage(), self.path), self.path, step, deadline_s, attempt)

    def leftovers(self) -> list[Leftover]:
        self._need_dir()
        now = time.time()
        out = []
        for path in leftovers(self.path):
            name = os.path.basename(path)
            try:
                use = usage(path)
            except FileNotFoundError:
                continue
            what = "crashed save attempt" if ".tmp-" in name else "interrupted retirement"
            out.append(Leftover(name, f"leftover of a {what}", use.size, now - use.modified, path))
        return out

    def remove(self, leftovers: Sequence[Leftover]) -> None:
        for x in leftovers:
            try:
                remove_tree(x.handle, DEFAULT_OPS)
            except FileNotFoundError:
                pass  # removed concurrently (by the library's own clean-up): fine

    def retire(self, keep_last: int, *, by_commit_order: bool = False, dry_run: bool = False) -> list[int]:
        self._need_dir()
        if dry_run:
            return choose_victims(_discovery.resumable(self.path), keep_last, by_commit_order=by_commit_order)
        storage = self._storage()
        return run_sync(lambda: retire(storage, self.path, keep_last, by_commit_order=by_commit_order))

    def remove_bad(self, entry: Listed) -> None:
        # renamed to a .deleting- name first (a crash leaves a leftover, never a half-removed
        # step), the root fsynced, then its files removed and its bad mark dropped
        if entry.state not in ("bad", "aside"):
            raise ValueError(f"{entry.name} is {entry.state}, not known bad: only bad steps are removed")
        src = os.path.join(self.path, entry.name)
        dst = os.path.join(self.path, deleting_dir_name(entry.step, uuid.uuid4().hex[:16]))
        try:
            os.rename(src, dst)
        except FileNotFoundError:
            return  # removed meanwhile
        DEFAULT_OPS.fsync_dir(self.path)
        remove_tree(dst, DEFAULT_OPS)
        if entry.attempt is not None:
            clear(self.path, entry.step, entry.attempt)

    def mark_bad(self, step: int, attempt: str, path: str, reason: str) -> bool:
        return record_bad(self.path, step, attempt, path, reason)

    def clear_bad(self, step: int, attempt: str) -> bool:
        return clear(self.path, step, attempt)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def step_dir_hint(path: str) -> str | None:
    """What to pass instead, when ``path`` is a step's own directory (``…/step_N`` holding a
    manifest) given where its root belongs; ``None`` otherwise."""
    step = parse_step_dir(os.path.basename(os.path.normpath(path)))
    if step is None or not os.path.isfile(os.path.join(path, MANIFEST)):
        return None
    parent = os.path.dirname(os.path.abspath(path))
    return f"it is the directory of checkpoint step {step}; pass its root, {parent}, and step={step}"
