"""A local directory as a :class:`~asyncckpt.roots._root.Root`: the library's POSIX discovery
(``_discovery``), listing (``_listing``), ownership (``_ownership``: a flock), retention and
leftovers (``_retention``), and the save protocol's :class:`~asyncckpt.roots._backend.PosixBackend`
(commit by rename, fsyncs around it) for attempts."""

from __future__ import annotations

import concurrent.futures
import os
import time
import uuid
from collections.abc import Sequence

from ..._errors import CheckpointCorruptError, CheckpointNotFoundError
from ...format._layout import deleting_dir_name, step_dir_name
from ...format._manifest import Manifest
from ...threads._sync import run_sync
from .._backend import PosixBackend
from .._badmarks import clear, record_bad
from .._readfault import read_error
from .._root import Attempt, BackendAttempt, Capabilities, Claim, Leftover, Listed, check_range, listed_file
from . import _ownership
from ._discovery import complete_checkpoints, newest_complete, open_step, pin_step
from ._listing import StepDir, scan, usage
from ._retention import choose_victims, leftovers, retire
from ._storage import DEFAULT_OPS, Storage, remove_tree

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
        if not os.path.isdir(self.path):
            raise CheckpointNotFoundError(f"{self.path} is not a directory")

    def list_steps(self) -> list[Listed]:
        return [listed(d) for d in scan(self.path)]

    def newest_resumable(self, passed: list[tuple[int, CheckpointCorruptError]] | None = None) -> int | None:
        self._need_dir()
        skipped: dict[int, CheckpointCorruptError] = {}
        found = newest_complete(self.path, skipped=skipped)
        if passed is not None:
            passed.extend(sorted(skipped.items(), reverse=True))
        return None if found is None else found.step

    def open_step(self, step: int) -> Manifest:
        self._need_dir()
        return open_step(self.path, step)[1]

    def read(self, step: int, name: str, offset: int = 0, length: int | None = None) -> bytes:
        with pin_step(self.path, step) as pinned:
            assert pinned.manifest is not None
            entry = listed_file(pinned.manifest, name, pinned.path)
            end = check_range(entry.size, offset, length)
            fd = pinned.open_file(name, entry.size)  # a regular file of exactly the listed size
            path = os.path.join(pinned.path, name)
            try:
                out = bytearray()
                while offset + len(out) < end:
                    chunk = os.pread(fd, min(end - offset - len(out), 8 << 20), offset + len(out))
                    if not chunk:
                        raise CheckpointCorruptError("file ended early", path)
                    out += chunk
                return bytes(out)
            except OSError as e:  # EIO, a timeout: the storage, not the data (CheckpointReadError)
                raise read_error(e, "cannot read", path) from None
            finally:
                os.close(fd)

    def locate(self, step: int, attempt: str | None = None, name: str | None = None) -> str:
        where = os.path.join(self.url, step_dir_name(step))
        return where if name is None else os.path.join(where, name)

    def claim(self, role: str) -> Claim:
        self._need_dir()
        return _FlockClaim(_ownership.acquire(self.path, [], role=role))

    def begin(self, step: int) -> Attempt:
        self._need_dir()
        return BackendAttempt(PosixBackend(self._storage(), self.path), self.path, step)

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
            return choose_victims(complete_checkpoints(self.path), keep_last, by_commit_order=by_commit_order)
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

