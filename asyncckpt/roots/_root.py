"""One interface to where checkpoints live: :class:`Root`, implemented by a POSIX directory
(``posix._root.PosixRoot``), an S3-compatible prefix (``objstore._root.ObjectRoot``) and
memory (``_memory.MemoryRoot``); :func:`asyncckpt.roots.open_root` picks one.

Theory of operation. A root holds *steps*. A step is written as an *attempt* (invisible to
every reader) and becomes *committed* at one atomic point: a rename of the attempt directory
(POSIX), the conditional create of its manifest (a store), a swap under a lock (memory). A
second commit of a committed step is refused (``FileExistsError``), whoever tries. What a
reader may take is decided by one rule (``format._stepstates``): a step is *resumable* when
committed, its files match its manifest, and it is not known bad (a *bad mark*, left by a
verification or a load that found it damaged). *Retire* removes old resumable steps under
the same rule, never the newest resumable one. *Leftovers* are what dead attempts and
interrupted retirements left behind; *ownership* (a flock, the store's lease, a lock in
memory) gives one writer at a time the right to write and remove.

The save pipeline uses a root's :class:`~asyncckpt.roots._backend.Backend` (the storage half of
``saving._commit``'s protocol, written once); :meth:`Root.begin` drives that same backend for
one rank, so a root's attempts commit exactly as a Checkpointer's saves do.

Every method is a plain call from the caller's thread (an object store's run on the shared
loop, ``threads._sync``) with the root's deadline; none may be called from that loop. Shapes,
not code, follow zarr v3's ``Store`` (a small protocol, capability flags, one conformance
suite: ``tests/test_root_conformance.py``) and DCP's ``StorageWriter``/``StorageReader``.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Protocol

from .._errors import CheckpointCorruptError, CheckpointNotFoundError
from ..format._manifest import FileEntry, Manifest
from ..format._stepstates import State
from ..threads._sync import run_sync
from ._backend import Backend

Kind = Literal["posix", "objstore", "memory"]


@dataclass(frozen=True)
class Capabilities:
    """Where roots differ, said once (callers test these, never a URL's scheme).

    ``kind``: which implementation. ``ownership``: how one writer at a time is kept
    (``flock``: a lock the kernel drops with the process; ``lease``: an object renewed by its
    holder, taken over after its TTL; ``lock``: a lock in this process). ``commit``: the
    commit point (``rename``, ``conditional-create``, ``swap``). ``by_commit_order``: retention
    may order steps by commit time rather than step. ``mmap``: a step's files may be
    memory-mapped. ``step_noun``: what one step is called in listings (``directory`` or
    ``prefix``). ``checks_commit``: the commit itself checks the attempt's files against the
    manifest and refuses (or takes back) a mismatch; where not (a store: the save protocol's
    verdicts already say every rank wrote, and a LIST per commit is saved), a mismatched
    commit is never resumable (readers check every step they take)."""

    kind: Kind
    ownership: Literal["flock", "lease", "lock"]
    commit: Literal["rename", "conditional-create", "swap"]
    by_commit_order: bool
    mmap: bool
    step_noun: Literal["directory", "prefix"]
    checks_commit: bool


@dataclass(frozen=True)
class Listed:
    """One entry of a root's one listing (:meth:`Root.list_steps`): a committed step, complete
    or not, an attempt set aside, or a leftover; ``state`` is the library's one rule
    (``_stepstates``). The fields are ``asyncckpt ls --json``'s, the same for every root:
    ``path`` is a local path or a URL, ``size`` the bytes of everything the entry holds (its
    manifest included), ``files`` how many files the listing counts, ``created`` the manifest's
    time, ``modified`` the newest modification (the medium's clock)."""

    step: int
    name: str
    path: str
    state: State
    complete: bool
    problem: str | None
    reason: str | None
    size: int
    files: int
    ranks: int | None
    created: float | None
    modified: float | None
    attempt: str | None = None
    bad: dict[str, Any] | None = None
    run: str | None = None
    note: str | None = None

    @property
    def status(self) -> str:
        """``complete``, ``bad``, ``aside`` or ``incomplete`` (leftovers and retirements)."""
        return self.state if self.state in ("complete", "bad", "aside") else "incomplete"

    @property
    def resumable(self) -> bool:
        """Whether ``latest()`` / ``load(step=None)`` may take this step."""
        return self.state == "complete"

    def as_json(self, now: float) -> dict[str, Any]:
        """The row as ``ls --json`` prints it (``age_s`` measured from ``now``)."""
        since = self.created if self.created is not None else self.modified
        return {
            "step": self.step, "name": self.name, "path": self.path, "status": self.status, "state": self.state,
            "resumable": self.resumable, "complete": self.complete, "problem": self.problem, "reason": self.reason,
            "note": self.note, "bad": self.bad, "size": self.size, "files": self.files, "ranks": self.ranks,
            "attempt": self.attempt, "run": self.run, "created": self.created, "modified": self.modified,
            "age_s": None if since is None else round(now - since, 3),
        }  # fmt: skip


@dataclass(frozen=True)
class Leftover:
    """Something a dead attempt or an interrupted retirement left (:meth:`Root.leftovers`):
    ``name`` as ``gc`` reports it, ``what`` in words, ``size`` its bytes, ``age_s`` since it
    was last modified (by the medium's clock; ``inf`` when unknown). ``handle`` is the
    root's own record of it, for :meth:`Root.remove`."""

    name: str
    what: str
    size: int
    age_s: float
    handle: Any = field(default=None, compare=False, repr=False)


class Claim(Protocol):
    """Ownership of a root, held until :meth:`release`."""

    def check(self) -> None:
        """Raise ``RootInUseError`` if the ownership was lost (a lease taken over)."""
        ...

    def release(self) -> None:
        """Give the ownership back (idempotent; never raises for a lost one)."""
        ...


class Attempt(Protocol):
    """One attempt at one step (:meth:`Root.begin`): invisible to readers until :meth:`commit`."""

    @property
    def location(self) -> str:
        """Where its files go (a directory, a key prefix)."""
        ...

    @property
    def attempt(self) -> str:
        """The attempt's id: the manifest passed to :meth:`commit` names it."""
        ...

    def write(self, name: str, data: bytes) -> None:
        """Store ``data`` as the attempt's file ``name``, durable when this returns."""
        ...

    def write_from(self, name: str, size: int, read: Callable[[int, memoryview], None]) -> int:
        """Store the ``size`` bytes that ``read(offset, buffer)`` fills (called from another
        thread, for consecutive or concurrent ranges) as the attempt's file ``name``, in parts
        of bounded size (a file of any size, never whole in memory), durable when this
        returns. Returns the CRC-32C of the bytes stored. An exception of ``read`` is raised
        as it is."""
        ...

    def commit(self, manifest: bytes) -> None:
        """Publish ``manifest`` (its files written): the step is committed when this returns.
        ``FileExistsError`` if the step was committed meanwhile (by another attempt); then
        this attempt is not committed."""
        ...

    def abort(self) -> None:
        """Remove what the attempt wrote (nothing of it was committed)."""
        ...


class Readable(Protocol):
    """What a load reads a step through (``loading._resume``): every :class:`Root`, and a
    node's part of a step (``roots._nodeparts.NodePart``: it holds no step of its own whole)."""

    url: str
    caps: Capabilities

    def open_reader(self, step: int) -> StepReader:
        """``step`` held open for reading (as :meth:`Root.open_reader`)."""
        ...

    def mark_bad(self, step: int, attempt: str, path: str, reason: str) -> bool:
        """Remember that ``attempt`` of ``step`` is damaged (as :meth:`Root.mark_bad`)."""
        ...

    def clear_bad(self, step: int, attempt: str) -> bool:
        """Forget a bad mark (as :meth:`Root.clear_bad`)."""
        ...


class Root(Readable, Protocol):
    """Where checkpoints live (module docstring); one per root and process."""

    url: str
    caps: Capabilities

    def list_steps(self) -> list[Listed]:
        """The one listing: every step entry, committed or not, oldest step first. One entry
        that cannot be read is listed as such, never raised."""
        ...

    def newest_resumable(
        self, passed: list[tuple[int, CheckpointCorruptError]] | None = None, skip: frozenset[int] = frozenset()
    ) -> int | None:
        """The newest resumable step not in ``skip``, or ``None`` (what ``load(step=None)``
        takes; ``skip``: the steps a load already found damaged). Steps passed over (known
        bad, damaged) are appended to ``passed``, newest first."""
        ...

    def resumable(self, newest: bool = False) -> list[Manifest]:
        """The manifests of the resumable steps, oldest first, each as the look that found it
        resumable read it (no second read): every one, or with ``newest`` only the newest,
        found as :meth:`newest_resumable` finds it (``[]``: none). An empty answer comes
        from a stable listing (a writer retiring steps meanwhile never makes a root that
        held a resumable step throughout look empty); a root that does not exist holds
        none; a root or a step that cannot be read raises its error (never "none")."""
        ...

    def open_step(self, step: int) -> Manifest:
        """The manifest of committed ``step`` whose files match it. ``CheckpointNotFoundError``
        (not committed), ``CheckpointCorruptError`` (damaged, known bad)."""
        ...

    def open_reader(self, step: int) -> StepReader:
        """Committed ``step`` held open for reading (:class:`StepReader`; close it): its files
        checked against its manifest as :meth:`open_step` checks them, a bad mark not
        consulted (a verification judges the step again). ``CheckpointNotFoundError`` (not
        committed), ``CheckpointCorruptError`` (files not the manifest's),
        ``CheckpointReadError`` (the medium could not serve it)."""
        ...

    def read(self, step: int, name: str, offset: int = 0, length: int | None = None) -> bytes:
        """``length`` bytes (``None``: to the end) of file ``name`` of committed ``step`` from
        ``offset``, bounded by the size its manifest lists (a range past it: ``ValueError``);
        a file whose size on the medium is not the listed one (truncated, grown) raises
        ``CheckpointCorruptError`` before anything is read; a name the manifest does not
        list, ``CheckpointNotFoundError``."""
        ...

    def locate(self, step: int, attempt: str | None = None, name: str | None = None) -> str:
        """Where committed ``step`` is (``name`` given: its file ``name`` of ``attempt``), as
        messages and ``--json`` name it: an absolute path or a URL (no I/O)."""
        ...

    def claim(self, role: str) -> Claim:
        """Take ownership for ``role`` (``RootInUseError`` naming the holder if another has it)."""
        ...

    def begin(self, step: int, *, attempt: str | None = None, deadline_s: float | None = None) -> Attempt:
        """Open an attempt at ``step`` (``FileExistsError`` if it is committed): its id
        ``attempt`` (a hex token; a copy keeps its source's, so the manifest's bytes stay
        the same) or a fresh one, all its calls within ``deadline_s`` (default
        :data:`ATTEMPT_DEADLINE_S`)."""
        ...

    def leftovers(self) -> list[Leftover]:
        """What dead attempts and interrupted retirements left, oldest step first."""
        ...

    def remove(self, leftovers: Sequence[Leftover]) -> None:
        """Remove ``leftovers`` (gone already: fine). Hold the root's :meth:`claim`."""
        ...

    def retire(self, keep_last: int, *, by_commit_order: bool = False, dry_run: bool = False) -> list[int]:
        """Retire resumable steps beyond the newest ``keep_last`` (at least 1: ``ValueError``);
        return them. Known-bad steps neither count nor go; the newest resumable step never
        goes. ``dry_run``: only say which. Hold the root's :meth:`claim`."""
        ...

    def remove_bad(self, entry: Listed) -> None:
        """Remove a known-bad step or an attempt set aside (``entry`` from :meth:`list_steps`)
        and drop its bad mark; never a resumable step (``ValueError``)."""
        ...

    def mark_bad(self, step: int, attempt: str, path: str, reason: str) -> bool:
        """Remember that ``attempt`` of ``step`` is damaged (readers pass over it); False if
        the mark could not be written."""
        ...

    def clear_bad(self, step: int, attempt: str) -> bool:
        """Forget a bad mark (a later verification passed); False if there was none."""
        ...

    def close(self) -> None:
        """Release what the root holds open (a claim it made, an executor)."""
        ...


class StepReader:
    """One committed step held open (:meth:`Root.open_reader`), in the spirit of DCP's
    ``StorageReader``: what it opened stays what it reads (a POSIX directory handle and its
    files' descriptors, a store's attempt prefix, a memory step's bytes), whatever commits or
    retires meanwhile. Reads are bounded ranges of the files ``manifest`` lists.

    A subclass sets ``manifest``, ``manifest_raw`` and ``manifest_size`` (the manifest's own
    bytes and their count), ``notes`` (names
    the step holds beyond its manifest: ignored, said), ``window`` (bytes per read the medium
    serves well), ``parallel`` (how many files are worth reading at once) and ``in_flight``
    (how many reads of one file are worth having in flight at once), and implements
    :meth:`_fill`, :meth:`locate`, :meth:`still_there` and :meth:`close`; it may override
    :meth:`readv` (a medium that fills many buffers with one request) and :meth:`fileno` (a
    medium with file descriptors). Thread-safe: several threads may read at once."""

    manifest: Manifest
    manifest_size: int = 0
    #: the manifest's own bytes as the step holds them (a copy commits these, unchanged)
    manifest_raw: bytes = b""
    notes: Sequence[str] = ()
    window: int = 8 << 20
    parallel: int = 1
    in_flight: int = 4

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of file ``name`` from ``offset``. A range past the size
        the manifest lists: ``ValueError`` (nothing is asked of the medium beyond it); a name
        it does not list: ``CheckpointNotFoundError``; a file that ends early:
        ``CheckpointCorruptError``; the medium failing: ``CheckpointReadError``."""
        entry = listed_file(self.manifest, name, self.locate())
        check_range(entry.size, offset, len(out))
        if len(out):
            self._fill(entry, offset, out)

    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        """``length`` bytes (``None``: to the end) of file ``name`` from ``offset``, bounded as
        :meth:`read_into` is (the buffer is only made once the range is checked)."""
        entry = listed_file(self.manifest, name, self.locate())
        end = check_range(entry.size, offset, length)
        out = bytearray(end - offset)
        self.read_into(name, offset, memoryview(out))
        return bytes(out)

    def readv(self, name: str, offset: int, views: Sequence[memoryview]) -> None:
        """Fill ``views``, consecutive in file ``name``, from ``offset``: :meth:`read_into` of
        their bytes together (the whole range is checked before anything is read)."""
        entry = listed_file(self.manifest, name, self.locate())
        check_range(entry.size, offset, sum(len(v) for v in views))
        for v in views:
            if len(v):
                self._fill(entry, offset, v)
            offset += len(v)

    def fileno(self, name: str) -> int | None:
        """A file descriptor of file ``name`` (a regular file of the listed size) that the
        caller may read and map until :meth:`close`, or ``None`` where the medium has none.
        Errors as :meth:`read_into`'s."""
        listed_file(self.manifest, name, self.locate())
        return None

    def _fill(self, entry: FileEntry, offset: int, out: memoryview) -> None:
        raise NotImplementedError

    def locate(self, name: str | None = None) -> str:
        """Where the step (``name`` given: its file) is, as messages name it (no I/O)."""
        raise NotImplementedError

    def still_there(self) -> bool:
        """Whether the root still holds this very commit at the step (not retired or replaced):
        a read that failed on a step no longer there found no damage."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the reader holds (idempotent)."""
        raise NotImplementedError

    def __enter__(self) -> StepReader:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def listed_file(manifest: Manifest, name: str, where: str) -> FileEntry:
    """The manifest's entry of ``name``; ``CheckpointNotFoundError`` if it lists none."""
    for f in manifest.files:
        if f.name == name:
            return f
    raise CheckpointNotFoundError(f"{name} is not a file of step {manifest.step}", f"{where.rstrip('/')}/{name}")


def check_range(size: int, offset: int, length: int | None) -> int:
    """The end of the range ``offset, length`` of a file of ``size`` bytes (``ValueError``
    outside it): a read never asks for more than the manifest lists."""
    end = size if length is None else offset + length
    if offset < 0 or (length is not None and length < 0) or end > size:
        raise ValueError(f"range {offset}+{length} is outside the file's {size} bytes")
    return end


# ------------------------------------------------------------------ one attempt over a Backend

#: How long one attempt of :meth:`Root.begin` may take, all its calls together.
ATTEMPT_DEADLINE_S = 300.0
_HEX = re.compile(r"[0-9a-f]{1,64}")


@dataclass
class OneRankJob:
    """A :class:`~asyncckpt.roots._backend.StepJob` for one rank writing alone (no keep_last:
    retention is :meth:`Root.retire`'s)."""

    step: int
    root: str
    deadline: float
    timeout: float = ATTEMPT_DEADLINE_S
    keep_last: int | None = None
    by_commit_order: bool = False
    failed_commits: set[str] = field(default_factory=set)
    dead: set[str] = field(default_factory=set)
    retention_lock: asyncio.Lock | None = None
    removals: set[asyncio.Task[None]] | None = None


class BackendAttempt:
    """An :class:`Attempt` driven through a root's :class:`Backend`, exactly as the save
    protocol drives it for rank 0 of one: ``prepare``, writes, ``seal``, ``commit``; on a
    failure ``abandon``. Every call runs on the shared loop (``threads._sync``)."""

    def __init__(self, backend: Backend, root: str, step: int, deadline_s: float | None = None,
                 attempt: str | None = None) -> None:  # fmt: skip
        if attempt is not None and not _HEX.fullmatch(attempt):
            raise ValueError(f"an attempt id is a hex token of 1 to 64 digits, not {attempt[:80]!r}")
        deadline_s = ATTEMPT_DEADLINE_S if deadline_s is None else deadline_s
        self._backend = backend
        self._job = OneRankJob(step, root, time.monotonic() + deadline_s, deadline_s)
        self._attempt = uuid.uuid4().hex[:16] if attempt is None else attempt
        self._loc = backend.location(step, self._attempt)
        self._written: set[str] = set()
        self._done = False
        run_sync(lambda: backend.prepare(self._job, self._attempt))

    @property
    def location(self) -> str:
        return self._loc

    @property
    def attempt(self) -> str:
        """The attempt's id (the manifest must name it)."""
        return self._attempt

    def _open(self) -> None:
        if self._done:
            raise RuntimeError("this attempt was committed or aborted")

    def write(self, name: str, data: bytes) -> None:
        self._open()
        self._written.add(name)
        run_sync(lambda: self._backend.write_small(self._job, self._loc, name, bytes(data)))

    def write_from(self, name: str, size: int, read: Callable[[int, memoryview], None]) -> int:
        self._open()
        self._written.add(name)
        return run_sync(lambda: self._backend.write_from(self._job, self._loc, name, size, read)).crc32c

    def commit(self, manifest: bytes) -> None:
        self._open()

        async def go() -> None:
            await self._backend.seal(self._job, self._loc)
            await self._backend.commit(self._job, self._loc, self._attempt, manifest)

        try:
            run_sync(go)
        except BaseException:
            self.abort()
            raise
        self._done = True

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        run_sync(lambda: self._backend.abandon(self._job, self._loc, [0], True))
