"""Discovery: which steps under a root are complete, and which is the newest.

A step is complete when its directory has the committed name, its manifest parses and
passes its own checksum, and the directory holds every file the manifest names, each a
regular file of the recorded size. A name the manifest does not list (a user's notes, an
editor's backup) changes nothing: every read goes by the manifest, so it is ignored and
named as a note (:attr:`PinnedStep.unlisted`, ``Seen.note``: ``ls``, ``verify``), never
taken for damage. Checksums of the data are verified by the
loader (and by ``verify``), not here, so listing stays cheap. This module is the local
listing adapter of ``_stepstates``: it describes what it finds (:func:`observe_committed`) and that
module's rule decides; what it calls complete (:func:`resumable`, :func:`newest_resumable`:
what ``PosixRoot`` answers) is *resumable*: complete and not known bad (a bad mark on its
attempt passes it over, as a corrupt one is).

Readers race the writer's retention (rename to ``.deleting-``, then removal) and need no
lock for it:

* a step directory is *pinned*: opened once as a directory handle, and the manifest, the
  listing and every file are read relative to that handle, so one read sees one directory
  even if it is renamed away meanwhile (and a retry of the step can never be mixed in);
* a file or directory that went missing is told apart from damage by looking again: if
  ``ROOT/step_N`` is no longer the directory that was pinned, the checkpoint was retired
  (:class:`Vanished`, a ``CheckpointNotFoundError``), never "corrupt"; if it still is, the
  file is looked up once more through a fresh handle on it (:meth:`PinnedStep.look_again`)
  before it is called missing: one ENOENT the next look contradicts (a stale negative dentry
  of NFS, virtiofs or Lustre, a FUSE server's glitch) says nothing about the checkpoint;
* a listing is trusted to say "nothing" only when it is stable: a candidate that vanished
  between ``listdir`` and its opening makes the scan list again (the newer checkpoint that
  replaced it was committed before the old one was retired), and "no checkpoint" is only
  answered after two identical listings.

An ``OSError`` of a read is classified by ``_readfault.read_error``: EIO and the like are
``CheckpointReadError`` (the storage, not the checkpoint), never "corrupt", so a scan never
passes over a step it could not read as if it were damaged.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
import time
from collections.abc import Callable, Collection
from types import TracebackType
from typing import TypeVar

from ..._errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, CheckpointReadError
from ...format._bounds import MAX_MANIFEST_BYTES
from ...format._layout import parse_leftover, parse_step_dir, step_dir_name, token_of
from ...format._manifest import MANIFEST, Manifest, decode
from ...format._stepstates import Fault, Mark, Seen, state_of
from .._badmarks import marks
from .._readfault import read_error, regular_file

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
#: A scan that keeps seeing candidates vanish gives up after this long (and this many rounds).
_SETTLE_S = 10.0
_MIN_ROUNDS = 3
#: A listed file a lookup said was missing is looked up again after this pause (module docstring).
_RELOOK_S = 0.05

T = TypeVar("T")


class Vanished(CheckpointNotFoundError):
    """A checkpoint went away while it was being read (retired or replaced): not corrupt."""


class KnownBad(CheckpointCorruptError):
    """A complete-looking step passed over because it is known bad (a bad mark on its attempt)."""


def _read_fd(fd: int, path: str, limit: int) -> bytes:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointCorruptError("not a regular file", path)
    if st.st_size > limit:
        raise CheckpointCorruptError(f"file larger than {limit} bytes", path)
    chunks = []
    remaining = st.st_size
    while remaining > 0:
        b = os.read(fd, remaining)
        if not b:
            break
        chunks.append(b)
        remaining -= len(b)
    return b"".join(chunks)


def read_regular_file(path: str, limit: int, *, dir_fd: int | None = None, name: str | None = None) -> bytes:
    """Read a regular file (never through a symlink) of at most ``limit`` bytes.

    With ``dir_fd``, the file opened is ``name`` inside that directory (``path`` names it in
    errors). ``OSError`` from opening propagates (the caller knows what a missing file
    means); a FIFO, a device or a file over ``limit`` raises ``CheckpointCorruptError``.
    """
    # O_NONBLOCK: a FIFO planted under the name must not block us (fstat rejects it below)
    target = path if dir_fd is None or name is None else name
    fd = os.open(target, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=dir_fd)
    try:
        return _read_fd(fd, path, limit)
    finally:
        os.close(fd)


def read_manifest(step_dir: str) -> Manifest:
    """The manifest of ``step_dir``.

    Raises ``CheckpointNotFoundError`` if there is no marker (not committed),
    ``CheckpointCorruptError`` if it is inconsistent (or a symlink) and ``CheckpointReadError``
    if the storage could not serve it.
    """
    path = os.path.join(step_dir, MANIFEST)
    try:
        raw = read_regular_file(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{step_dir} has no completion marker") from None
    except OSError as e:
        # ELOOP: the marker is a symlink (damage); EIO and the like: the storage (not damage)
        raise read_error(e, "manifest unreadable", path) from None
    return decode(raw, path)


def pause_before_looking_again() -> None:
    """The pause before a listed file a lookup said was missing is looked up again (module
    docstring): every reader that opens listed files (loads, ``verify``, ``export``) takes it."""
    time.sleep(_RELOOK_S)


class PinnedStep:
    """An open handle on one step directory, with its checked manifest.

    Everything is read relative to the handle; :meth:`gone` tells a retired checkpoint
    from a damaged one. Close it (or use it as a context manager).
    """

    def __init__(self, root: str, step: int, path: str, fd: int) -> None:
        self.root, self.step, self.path, self.fd = root, step, path, fd
        st = os.fstat(fd)
        self.ident = (st.st_dev, st.st_ino)
        self.manifest: Manifest | None = None
        #: the bytes ``manifest`` was decoded from (what a copy commits: never read twice)
        self.manifest_raw = b""
        #: names in the directory the manifest does not list (ignored; see the module docstring)
        self.unlisted: list[str] = []

    def still_there(self) -> bool:
        """Whether ``ROOT/step_N`` is still the very directory this handle holds."""
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.ident

    def gone(self, what: str) -> Vanished:
        return Vanished(f"step {self.step} under {self.root} was retired or replaced while {what}")

    def missing(self, name: str, what: str) -> CheckpointError:
        """The error for ``name`` not being there: retired (Vanished) or damaged (corrupt)."""
        if not self.still_there():
            return self.gone(what)
        return CheckpointCorruptError("file listed in the manifest is missing", os.path.join(self.path, name))

    def look_again(self, name: str, call: Callable[[int], T], what: str) -> T:
        """``call(dir_fd)`` once more, after a lookup of listed file ``name`` answered ENOENT:
        after a short pause, through a freshly opened handle on this very directory. Raises
        :meth:`missing`'s error when the file is still not there (or the directory is no
        longer this one: :class:`Vanished`), ``read_error`` of any other ``OSError``."""
        pause_before_looking_again()
        try:
            fd = os.open(self.path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
        except OSError:
            raise self.missing(name, what) from None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self.ident:
                raise self.gone(what)
            try:
                return call(fd)
            except FileNotFoundError:
                raise self.missing(name, what) from None
            except OSError as e:
                raise read_error(e, "cannot look up", os.path.join(self.path, name)) from None
        finally:
            os.close(fd)

    def open_file(self, name: str, size: int) -> int:
        """Open ``name`` in the directory: a regular file of exactly ``size`` bytes, not a link."""
        path = os.path.join(self.path, name)
        flags = os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=self.fd)
        except FileNotFoundError:
            fd = self.look_again(name, lambda d: os.open(name, flags, dir_fd=d), f"it was being read ({name} is gone)")
        except OSError as e:
            raise read_error(e, "cannot open", path) from None
        return regular_file(fd, size, path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PinnedStep:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _load_manifest(self) -> Manifest:
        path = os.path.join(self.path, MANIFEST)
        try:
            raw = read_regular_file(path, MAX_MANIFEST_BYTES, dir_fd=self.fd, name=MANIFEST)
        except FileNotFoundError:
            if not self.still_there():
                raise self.gone("its manifest was being read") from None
            raise CheckpointNotFoundError(f"{self.path} has no completion marker") from None
        except OSError as e:
            raise read_error(e, "manifest unreadable", path) from None
        manifest = decode(raw, path)
        if manifest.step != self.step:
            raise CheckpointCorruptError(f"manifest is for step {manifest.step}", self.path)
        self.manifest_raw = raw
        return manifest

    def _check_files(self, manifest: Manifest, names: Collection[str] | None = None) -> None:
        """The manifest's files (``names`` given: only those of them) are here with their sizes."""
        try:
            present = set(os.listdir(self.fd))
        except OSError as e:
            raise read_error(e, "cannot list checkpoint", self.path) from None
        expected = {f.name for f in manifest.files} | {MANIFEST}
        checked = [f for f in manifest.files if names is None or f.name in names]
        lacking = ({f.name for f in checked} | {MANIFEST}) - present
        if lacking and not self.still_there():
            raise self.gone("its files were being checked")
        self.unlisted = sorted(present - expected)
        for f in checked:
            path = os.path.join(self.path, f.name)
            try:
                st = os.stat(f.name, dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                st = self.look_again(f.name, functools.partial(_lstat_at, f.name), "its files were being checked")
            except OSError as e:
                raise read_error(e, "cannot stat", path) from None
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointCorruptError("not a regular file", path)
            if st.st_size != f.size:
                raise CheckpointCorruptError(f"size {st.st_size} != {f.size} recorded in the manifest", path)


def _lstat_at(name: str, dir_fd: int) -> os.stat_result:
    return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


def pin_step(root: str | os.PathLike[str], step: int, names: Collection[str] | None = None) -> PinnedStep:
    """Open ``step``'s directory and check it is complete (``names`` given: that it holds those
    of its manifest's files, a node's part of a step: ``roots._nodeparts``); the caller closes
    the result.

    Raises ``CheckpointNotFoundError`` (no such directory, a symlink, no marker),
    :class:`Vanished` (retired while being checked), ``CheckpointCorruptError`` or
    ``CheckpointReadError`` (an I/O fault while checking it).
    """
    root_s = os.fspath(root)
    path = os.path.join(root_s, step_dir_name(step))
    try:
        fd = os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no checkpoint for step {step} under {root_s}") from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # a symlinked or non-directory step is not ours
            raise CheckpointNotFoundError(f"no checkpoint for step {step} under {root_s}") from None
        raise read_error(e, "cannot open checkpoint directory", path) from None
    pinned = PinnedStep(root_s, step, path, fd)
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            raise CheckpointNotFoundError(f"no checkpoint for step {step} under {root_s}")
        manifest = pinned._load_manifest()
        pinned._check_files(manifest, names)
        pinned.manifest = manifest
    except BaseException:
        pinned.close()
        raise
    return pinned


def unlisted_note(names: list[str]) -> str | None:
    """The note that names files a step directory holds beyond its manifest (``None``: none)."""
    if not names:
        return None
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return f"file(s) not in the manifest, ignored: {', '.join(names[:5])}{more}"


def check_files(step_dir: str, manifest: Manifest) -> None:
    """Check the directory holds the manifest's files with the recorded sizes."""
    try:
        fd = os.open(step_dir, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
    except OSError as e:
        raise read_error(e, "cannot list checkpoint", step_dir) from None
    pinned = PinnedStep(os.path.dirname(step_dir), manifest.step, step_dir, fd)
    with pinned:
        pinned._check_files(manifest)


def open_step(root: str | os.PathLike[str], step: int) -> tuple[str, Manifest]:
    """Locate a step and check it is complete; return its directory and manifest."""
    with pin_step(root, step) as pinned:
        assert pinned.manifest is not None
        return pinned.path, pinned.manifest


def _list_root(root: str) -> list[str]:
    try:
        return os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        raise read_error(e, "cannot list checkpoint root", root) from None


def _committed_steps(names: list[str]) -> list[int]:
    steps = []
    for name in names:
        step = parse_step_dir(name)
        if step is not None and name == step_dir_name(step):
            steps.append(step)
    return sorted(steps)


def candidate_steps(root: str | os.PathLike[str]) -> list[int]:
    """Steps whose directory has the committed name, ascending (not yet checked)."""
    return _committed_steps(_list_root(os.fspath(root)))


def _message(e: CheckpointError) -> str:
    """The message of ``e`` without the trailing ``: path`` of a ``CheckpointCorruptError``."""
    msg, path = str(e), getattr(e, "path", None)
    return msg[: -len(path) - 2] if path and msg.endswith(f": {path}") else msg


def observe_committed(
    root: str, step: int, known: dict[tuple[int, str], Mark]
) -> tuple[Seen, Manifest | None, CheckpointError | None]:
    """What ``step_N`` is (``_stepstates.Seen``), its manifest when it is complete (its files
    match it), and the error that says why it is not resumable (``None`` when it is). Raises
    :class:`Vanished` when it was retired or replaced while being looked at."""
    name = step_dir_name(step)
    try:
        with pin_step(root, step) as pinned:
            manifest = pinned.manifest
            assert manifest is not None
            note = unlisted_note(pinned.unlisted)
    except Vanished:
        raise
    except CheckpointNotFoundError as e:
        return Seen(step, name, "committed", fault=Fault("no-marker", str(e))), None, e
    except CheckpointReadError as e:  # an I/O error is no verdict on the content
        fault = Fault("unreadable", _message(e), e.path, False)
        return Seen(step, name, "committed", fault=fault), None, e
    except CheckpointCorruptError as e:
        return Seen(step, name, "committed", fault=Fault("corrupt", _message(e), e.path, True)), None, e
    mark = known.get((step, token_of(manifest.attempt)))
    seen = Seen(step, name, "committed", manifest.attempt, manifest.created, None, mark, note)
    if mark is None:
        return seen, manifest, None
    return seen, manifest, KnownBad(f"known bad: verification failed: {mark.reason}", mark.path or None)


def observe_step(root: str | os.PathLike[str], step: int) -> Seen | None:
    """What ``step_N`` under ``root`` is (``None``: nothing has that name)."""
    root_s = os.fspath(root)
    if not os.path.lexists(os.path.join(root_s, step_dir_name(step))):
        return None
    try:
        return observe_committed(root_s, step, marks(root_s))[0]
    except Vanished:
        return None


def _scan(
    root: str,
    newest_only: bool,
    exclude: frozenset[int] = frozenset(),
    skipped: dict[int, CheckpointCorruptError] | None = None,
) -> list[Manifest]:
    """The manifests of the resumable steps, newest first (only the newest with ``newest_only``).

    Lists again whenever a candidate vanished while it was checked, and answers "none" only
    from two identical listings, so a checkpoint that existed throughout is never missed
    because retention replaced another one under the scan. Corrupt and known-bad step
    directories passed over on the way are put in ``skipped``; a step that cannot be read
    (``CheckpointReadError``) is not passed over: the error propagates.
    """
    previous: frozenset[str] | None = None
    deadline = time.monotonic() + _SETTLE_S
    rounds = 0
    while True:
        rounds += 1
        names = _list_root(root)
        known = marks(root)
        listing = frozenset(n for n in names if parse_step_dir(n) is not None or parse_leftover(n) is not None)
        found: list[Manifest] = []
        vanished = False
        for step in reversed(_committed_steps(names)):
            if step in exclude:
                continue
            try:
                seen, manifest, err = observe_committed(root, step, known)
            except Vanished:
                vanished = True
                break  # the listing is stale: whatever replaced it is newer
            if isinstance(err, CheckpointReadError):
                raise err  # never passed over: the step may be fine (_readfault)
            if state_of(seen) == "complete" and manifest is not None:
                found.append(manifest)
                if newest_only:
                    return found
            elif skipped is not None and isinstance(err, CheckpointCorruptError):
                skipped[step] = err
        settled = not vanished and (bool(found) or listing == previous)
        if settled or (rounds >= _MIN_ROUNDS and time.monotonic() > deadline):
            return found
        previous = listing


def resumable(root: str | os.PathLike[str]) -> list[Manifest]:
    """The manifest of every resumable step under ``root`` (complete, not known bad), oldest
    first; none under a root that does not exist."""
    return list(reversed(_scan(os.fspath(root), newest_only=False)))


def newest_resumable(
    root: str | os.PathLike[str],
    exclude: frozenset[int] = frozenset(),
    skipped: dict[int, CheckpointCorruptError] | None = None,
) -> Manifest | None:
    """The manifest of the newest resumable step not in ``exclude``, or ``None`` (none under a
    root that does not exist). Corrupt and known-bad step directories newer than the answer
    are put in ``skipped`` (a :class:`KnownBad` for a step passed over for its bad mark)."""
    found = _scan(os.fspath(root), newest_only=True, exclude=exclude, skipped=skipped)
    return found[0] if found else None
