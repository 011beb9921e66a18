"""The replicas a rank holds for others: one directory, the commit discipline of every root.

Layout under the caller's directory (the memory tier passes a tmpfs path)::

    peer-rank00003/                      the replicas of rank 3's parts
        step_00000012/                   committed: visible to held() and fetch
            .replica.json                the record: source, step, attempt, files (name, size, crc)
            rank00003.distcp ...         the files, byte for byte as rank 3 had them
        .incoming-step_00000013-<uuid>/  being received: invisible, removed on the next start

A replica is received straight into its files (:meth:`HeldReplicas.receive`: each file's space
reserved, then mapped, so the bytes land in the tmpfs pages with no copy and a full tmpfs fails
as ``ENOSPC``, never as a signal) in a hidden attempt directory; its files and record fsynced, then
renamed to ``step_N`` (an older replica of the same step is moved aside first, never
overwritten in place), and the directory fsynced: a reader sees a step whole or not at all. A
step is *held* for an attempt when its record names that source, step and attempt and every
file has the size it lists; reading it back (:meth:`HeldReplicas.map`, the files mapped, no
copy) checks every file's CRC-32C. The newest ``keep`` steps of each source are kept; with
``keep`` >= 2 a new replica is received into the files of the oldest (``_recycle``: its memory
reused, not freed and allocated again; the ``keep - 1`` newer steps stay visible meanwhile).
Torch-free: the bytes move in and out through memoryviews.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from ...format._checksum import crc32c
from ...format._layout import step_dir_name
from ..posix._fileio import reserve, write_all
from ..posix._osops import DEFAULT_OPS, O_CLOEXEC, O_NOFOLLOW

RECORD = ".replica.json"
_INCOMING = ".incoming-"
_DELETING = ".deleting-"
#: with ``keep`` 1, the retired step's directory kept (hidden) to receive the next replica into
_SPARE = ".spare-"
_FORMAT = 1


@dataclass(frozen=True)
class Entry:
    """One file of a replica: its name, size in bytes and CRC-32C."""

    name: str
    size: int
    crc: int


@dataclass(frozen=True)
class Record:
    """What a committed replica holds (its ``.replica.json``)."""

    source: int
    step: int
    attempt: str
    files: tuple[Entry, ...]

    @property
    def total(self) -> int:
        return sum(e.size for e in self.files)

    def as_json(self) -> dict[str, object]:
        return {"format": _FORMAT, "source": self.source, "step": self.step, "attempt": self.attempt,
                "files": [[e.name, e.size, e.crc] for e in self.files]}  # fmt: skip

    @staticmethod
    def from_json(d: dict[str, object]) -> Record:
        files = d["files"]
        assert isinstance(files, list)
        return Record(int(d["source"]), int(d["step"]), str(d["attempt"]),  # type: ignore[call-overload]
                      tuple(Entry(str(n), int(s), int(c)) for n, s, c in files))  # fmt: skip


class NotHeld(Exception):
    """No usable replica: ``kind`` is ``missing`` or ``corrupt``, the message says why."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def check_name(name: str) -> None:
    """``ValueError`` for a file name a replica cannot hold (a path, hidden, empty)."""
    if not name or name.startswith(".") or "/" in name or "\0" in name or len(name) > 255:
        raise ValueError(f"a replica's file needs a plain, visible name, not {name!r}")


class HeldReplicas:
    """The replicas under ``directory``; ``keep``: the newest steps kept per source."""

    def __init__(self, directory: str, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep!r}")
        self.directory = directory
        self.keep = keep
        #: the writable mappings of the committed replicas' files (step directory -> name ->
        #: (inode, mapping)), kept so that a recycled step is received into pages mapped already
        #: (mapping and faulting in a file's pages again costs ~17 ms per 64 MiB); closed when
        #: their step is retired or replaced (the pages are the files': nothing but page tables)
        self._mapped: dict[str, dict[str, tuple[int, mmap.mmap]]] = {}
        os.makedirs(directory, exist_ok=True)

    def source_dir(self, source: int) -> str:
        return source_dir(self.directory, source)

    def clean(self, sources: Sequence[int]) -> None:
        """Remove what a crash left under the ``sources``' directories (half-received replicas,
        replicas being deleted): they were never visible."""
        for s in sources:
            d = self.source_dir(s)
            for name in _listdir(d):
                if name.startswith((_INCOMING, _DELETING, _SPARE)):
                    shutil.rmtree(os.path.join(d, name), ignore_errors=True)

    def steps(self, source: int) -> list[int]:
        """The committed steps of ``source``, ascending."""
        return held_steps(self.directory, source)

    def commit(self, record: Record, payload: memoryview) -> None:
        """Commit ``payload`` (the files' bytes back to back, in ``record.files`` order) as
        ``record``'s replica (:meth:`receive`, filled by a copy)."""
        incoming = self.receive(record)
        try:
            off = 0
            for e, view in zip(record.files, incoming.views, strict=True):
                view[:] = payload[off : off + e.size]
                off += e.size
            incoming.commit()
        finally:
            incoming.abort()

    def receive(self, record: Record) -> Incoming:
        """A hidden attempt directory holding ``record``'s files at their sizes, each open as a
        writable view (``Incoming.views``) to receive into; :meth:`Incoming.commit` checks and
        publishes it, :meth:`Incoming.abort` removes it. ``OSError`` (ENOSPC) when it does not fit."""
        for e in record.files:
            check_name(e.name)
        d = self.source_dir(record.source)
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f"{_INCOMING}{step_dir_name(record.step)}-{uuid.uuid4().hex[:12]}")
        self._forget_gone()
        recycled = self._recycle(record.source, tmp)
        if not recycled:
            os.mkdir(tmp)
        incoming = Incoming(self, record, tmp, self._mapped.pop(recycled, {}) if recycled else {})
        try:
            for e in record.files:
                incoming.open(e)
            if recycled:  # the old step's files this one does not have
                keep = {e.name for e in record.files}
                for name in os.listdir(tmp):
                    if name not in keep:
                        os.unlink(os.path.join(tmp, name))
        except BaseException:
            incoming.abort()
            raise
        return incoming

    def _recycle(self, source: int, tmp: str) -> str:
        """With ``keep`` (at least 2) steps of ``source`` held, its oldest becomes the attempt
        directory ``tmp``: its files, where names and sizes match, are received into again (their
        memory is there already: no allocation, no zeroing, nothing freed after the commit).
        The commit would retire that step anyway; the ``keep - 1`` newer ones stay visible
        throughout. With ``keep`` 1 the one step held stays until the new one is committed, and
        the retired step's files are kept hidden (a *spare*, :meth:`retire`) to receive the next
        one into: the memory a push needs at its peak anyway, held between pushes.
        Returns the recycled step's directory (its mappings' key), or ``""``."""
        steps = self.steps(source)
        spares = [n for n in _listdir(self.source_dir(source)) if n.startswith(_SPARE)]
        if self.keep < 2 or len(steps) < self.keep:
            if not spares:
                return ""
            old = os.path.join(self.source_dir(source), spares[0])
        else:
            old = os.path.join(self.source_dir(source), step_dir_name(steps[0]))
        try:
            os.rename(old, tmp)
        except FileNotFoundError:
            return ""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(tmp, RECORD))
        return old

    def _forget(self, step_dir: str) -> None:
        """Close the mappings kept of ``step_dir``'s files (it is being removed or replaced)."""
        for _, m in self._mapped.pop(step_dir, {}).values():
            with contextlib.suppress(BufferError):  # a view still held elsewhere: freed with it
                m.close()

    def _forget_gone(self) -> None:
        """Close the mappings of steps removed behind this object's back (their memory is freed)."""
        for step_dir in [k for k in self._mapped if not os.path.isdir(k)]:
            self._forget(step_dir)

    def close(self) -> None:
        """Close every mapping kept (the replicas stay; idempotent)."""
        for step_dir in list(self._mapped):
            self._forget(step_dir)

    def find(self, source: int, step: int, attempt: str) -> Record:
        """:func:`find_held` here."""
        return find_held(self.directory, source, step, attempt)

    def attempts(self, source: int) -> dict[int, str]:
        """Every step of ``source`` held here with the attempt that made it (its record read, every
        file there with its size; no CRC check: that is the read's)."""
        return held_attempts(self.directory, source)

    def held(self, source: int, step: int, attempt: str) -> bool:
        """Whether :meth:`find` finds it (no CRC check: that is the read's)."""
        return _held(self.directory, source, step, attempt)

    def map(self, rec: Record, check: bool = True) -> list[memoryview]:
        """``rec``'s files, each mapped copy-on-write (no copy; writable for the transport, never
        written back), every CRC checked unless not ``check`` (``NotHeld("corrupt")`` naming the
        file; the fetch leaves the check to the needer, who makes it as the bytes land)."""
        path = os.path.join(self.source_dir(rec.source), step_dir_name(rec.step))
        views = []
        for e in rec.files:
            if not e.size:
                views.append(memoryview(bytearray()))
                continue
            try:
                with open(os.path.join(path, e.name), "rb") as f:
                    if os.fstat(f.fileno()).st_size != e.size:
                        raise NotHeld("corrupt", f"{e.name} of rank {rec.source}'s step {rec.step} changed size")
                    m = mmap.mmap(f.fileno(), e.size, access=mmap.ACCESS_COPY)
                    populate(m, write=False)
                    views.append(memoryview(m))
            except FileNotFoundError:
                raise NotHeld("missing", f"{e.name} of rank {rec.source}'s step {rec.step} is gone") from None
        if check:
            verify_views(rec, views)
        return views

    def retire(self, source: int) -> None:
        """Remove all but the newest ``keep`` steps of ``source`` and replaced replicas; with
        ``keep`` 1 the retired step becomes the source's spare (hidden, its record removed, its
        mappings kept: :meth:`_recycle` receives the next replica into it) unless it has one."""
        d = self.source_dir(source)
        for step in self.steps(source)[: -self.keep]:
            path = os.path.join(d, step_dir_name(step))
            if self.keep == 1 and not any(n.startswith(_SPARE) for n in _listdir(d)):
                spare = os.path.join(d, f"{_SPARE}{uuid.uuid4().hex[:12]}")
                with contextlib.suppress(FileNotFoundError):
                    os.rename(path, spare)
                    self._mapped[spare] = self._mapped.pop(path, {})
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(spare, RECORD))
                    continue
            aside = os.path.join(d, f"{_DELETING}{uuid.uuid4().hex[:12]}")
            self._forget(path)
            with contextlib.suppress(FileNotFoundError):
                os.rename(path, aside)
            shutil.rmtree(aside, ignore_errors=True)
        for name in _listdir(d):  # replaced replicas of a step
            if name.startswith(_DELETING):
                shutil.rmtree(os.path.join(d, name), ignore_errors=True)


def source_dir(directory: str, source: int) -> str:
    """Where the replicas of rank ``source`` held under ``directory`` are."""
    return os.path.join(directory, f"peer-rank{source:05d}")


def held_steps(directory: str, source: int) -> list[int]:
    """The committed steps of ``source`` under ``directory``, ascending."""
    out = []
    for name in _listdir(source_dir(directory, source)):
        if name.startswith("step_") and name[5:].isdigit():
            out.append(int(name[5:]))
    return sorted(out)


def find_held(directory: str, source: int, step: int, attempt: str) -> Record:
    """The record of ``source``'s committed replica of ``step`` made by ``attempt``, every file
    there with its size; ``NotHeld("missing")`` otherwise (none, another attempt's, a file
    gone or cut short; ``"corrupt"`` for an unreadable record)."""
    path = os.path.join(source_dir(directory, source), step_dir_name(step))
    try:
        with open(os.path.join(path, RECORD), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise NotHeld("missing", f"no replica of rank {source}'s step {step} in {directory}") from None
    try:
        rec = Record.from_json(json.loads(raw))
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise NotHeld("corrupt", f"the record of rank {source}'s step {step} is unreadable ({e})") from None
    if (rec.source, rec.step) != (source, step):
        raise NotHeld("corrupt", f"{path} holds rank {rec.source}'s step {rec.step}")
    if rec.attempt != attempt:
        raise NotHeld("missing", f"the replica of rank {source}'s step {step} is of attempt "
                                 f"{rec.attempt!r}, not {attempt!r}")  # fmt: skip
    for ent in rec.files:
        try:
            size = os.stat(os.path.join(path, ent.name)).st_size
        except FileNotFoundError:
            raise NotHeld("missing", f"{ent.name} of rank {source}'s step {step} is gone") from None
        if size != ent.size:
            raise NotHeld("corrupt", f"{ent.name} of rank {source}'s step {step} has {size} bytes, "
                                     f"not {ent.size}")  # fmt: skip
    return rec


def _held(directory: str, source: int, step: int, attempt: str) -> bool:
    try:
        find_held(directory, source, step, attempt)
    except NotHeld:
        return False
    return True


def held_attempts(directory: str, source: int) -> dict[int, str]:
    """:meth:`HeldReplicas.attempts` without the object (nothing made or removed: a look)."""
    out = {}
    for step in held_steps(directory, source):
        try:
            with open(os.path.join(source_dir(directory, source), step_dir_name(step), RECORD), "rb") as f:
                attempt = str(json.loads(f.read())["attempt"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _held(directory, source, step, attempt):
            out[step] = attempt
    return out


def verify_views(rec: Record, views: Sequence[memoryview]) -> None:
    """``NotHeld("corrupt")`` unless ``views`` are ``rec``'s files, sizes and CRC-32C alike."""
    for e, view in zip(rec.files, views, strict=True):
        if len(view) != e.size or crc32c(view) != e.crc:
            raise NotHeld("corrupt", f"{e.name} of rank {rec.source}'s step {rec.step} fails its CRC-32C")


def verify(rec: Record, payload: memoryview) -> None:
    """``NotHeld("corrupt")`` unless ``payload`` is ``rec``'s files, sizes and CRC-32C alike."""
    if len(payload) != rec.total:
        raise NotHeld("corrupt", f"rank {rec.source}'s step {rec.step}: {len(payload)} bytes, not {rec.total}")
    off = 0
    for e in rec.files:
        if crc32c(payload[off : off + e.size]) != e.crc:
            raise NotHeld("corrupt", f"{e.name} of rank {rec.source}'s step {rec.step} fails its CRC-32C")
        off += e.size


#: ``madvise`` advice (Linux 5.14+): fault a mapping's pages in with one call, not one trap a
#: page (a third of the time on a VM; for a private mapping, without copying a page).
_POPULATE_READ, _POPULATE_WRITE = 22, 23


def populate(m: mmap.mmap, write: bool, start: int = 0, length: int | None = None) -> None:
    """Map ``m``'s pages in now (those of ``length`` bytes from ``start``, a multiple of the page
    size; default: all), for reading or writing (nothing where the kernel cannot)."""
    with contextlib.suppress(OSError, ValueError):
        m.madvise(_POPULATE_WRITE if write else _POPULATE_READ, start, len(m) - start if length is None else length)


class Incoming:
    """One replica being received (:meth:`HeldReplicas.receive`): ``views[i]`` is the writable
    memory of ``record.files[i]`` (the file itself, mapped, where its space could be reserved)."""

    def __init__(self, held: HeldReplicas, record: Record, path: str,
                 mapped: dict[str, tuple[int, mmap.mmap]] | None = None) -> None:  # fmt: skip
        self.held, self.record, self.path = held, record, path
        self.views: list[memoryview] = []
        self._fds: list[int] = []
        self._maps: list[mmap.mmap | None] = []
        self._inos: list[int] = []
        #: the recycled step's kept mappings (name -> (inode, mapping)); those not reused are closed
        self._mapped = dict(mapped or {})
        self._done = False

    def open(self, e: Entry) -> None:
        path = os.path.join(self.path, e.name)
        try:  # a recycled step's file of this size: received into in place
            fd = os.open(path, os.O_RDWR | O_CLOEXEC | O_NOFOLLOW)
        except FileNotFoundError:
            fd = -1
        st = os.fstat(fd) if fd >= 0 else None
        if st is not None and st.st_size != e.size:
            os.close(fd)
            os.unlink(path)
            fd, st = -1, None
        fresh = fd < 0
        if fresh:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_CLOEXEC, 0o644)
        self._fds.append(fd)
        ino = os.fstat(fd).st_ino if st is None else st.st_ino
        self._inos.append(ino)
        kept = self._mapped.pop(e.name, None)
        if kept is not None and (kept[0] != ino or len(kept[1]) != e.size):
            with contextlib.suppress(BufferError):
                kept[1].close()
            kept = None
        if kept is not None:  # this very file, mapped and faulted in already: no call at all
            self._maps.append(kept[1])
            self.views.append(memoryview(kept[1]))
        elif e.size and (not fresh or reserve(fd, e.size, path)):
            m = mmap.mmap(fd, e.size, access=mmap.ACCESS_WRITE)
            populate(m, write=True)
            self._maps.append(m)
            self.views.append(memoryview(m))
        else:  # nothing to map, or a file system that cannot reserve: through memory, written at commit
            self._maps.append(None)
            self.views.append(memoryview(bytearray(e.size)))

    def commit(self, crcs: Sequence[int] | None = None) -> None:
        """Check every file's CRC (``NotHeld("corrupt")``; ``crcs``: those of the bytes as they
        landed, computed already), make the files and the record durable, publish the replica as
        ``step_N`` (one rename), retire the oldest."""
        rec = self.record
        if crcs is None:
            verify_views(rec, self.views)
        elif list(crcs) != [e.crc for e in rec.files]:
            bad = [e.name for e, c in zip(rec.files, crcs, strict=True) if c != e.crc]
            raise NotHeld("corrupt", f"{', '.join(bad)} of rank {rec.source}'s step {rec.step} fails its CRC-32C")
        for e, fd, m, view in zip(rec.files, self._fds, self._maps, self.views, strict=True):
            if m is None and e.size:
                write_all(fd, view, 0, os.path.join(self.path, e.name))
            os.fsync(fd)
        _write(os.path.join(self.path, RECORD), json.dumps(rec.as_json()).encode())
        kept = {e.name: (ino, m) for e, ino, m in zip(rec.files, self._inos, self._maps, strict=True) if m is not None}
        self._maps = []  # handed over below, or closed by _close on a failure before
        try:
            self._close()
            DEFAULT_OPS.fsync_dir(self.path)
            d = self.held.source_dir(rec.source)
            final = os.path.join(d, step_dir_name(rec.step))
            if os.path.lexists(final):  # a replica of the same step (another attempt): aside first
                self.held._forget(final)
                os.rename(final, os.path.join(d, f"{_DELETING}{uuid.uuid4().hex[:12]}"))
            os.rename(self.path, final)
        except BaseException:
            self._maps = [m for _, m in kept.values()]
            raise
        self._done = True
        self.held._mapped[final] = kept
        DEFAULT_OPS.fsync_dir(d)
        self.held.retire(rec.source)

    def abort(self) -> None:
        """Remove the attempt directory unless it was committed (idempotent)."""
        self._close()
        if not self._done:
            self._done = True
            shutil.rmtree(self.path, ignore_errors=True)
            # a source's first replica that failed leaves no (empty) source directory behind
            with contextlib.suppress(OSError):  # (ENOTEMPTY: other steps of it are held)
                os.rmdir(os.path.dirname(self.path))

    def _close(self) -> None:
        self.views = []
        for m in [*self._maps, *(m for _, m in self._mapped.values())]:
            if m is not None:
                with contextlib.suppress(BufferError):  # a view still held elsewhere: freed with it
                    m.close()
        self._maps = []
        self._mapped = {}
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _write(path: str, data: memoryview | bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC, 0o644)
    try:
        write_all(fd, memoryview(data), 0, path)
        os.fsync(fd)
    finally:
        os.close(fd)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []
