"""A root in this process's memory (``memory://name``): the conformance suite's reference and
the base of the node-local and memory tiers to come.

It keeps the commit discipline of every root: an attempt's files live apart from the
committed steps (invisible to every reader) until :meth:`MemoryBackend.commit` publishes the
manifest and the files together under one lock (atomic: a reader sees the step whole or not
at all); a second commit of a committed step is refused (``FileExistsError``), and a
manifest whose files the attempt did not write exactly is refused
(``CheckpointCorruptError``). Ownership is a lock in this process. Roots of the same name
share one :class:`MemoryStore` (two claimants see each other), until :func:`drop`.
"""

from __future__ import annotations

import asyncio
import errno
import pathlib
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._errors import CheckpointCorruptError, CheckpointNotFoundError, RootInUseError
from .._info import CheckpointInfo
from ..format._checksum import crc32c
from ..format._layout import data_prefix, step_dir_name
from ..format._manifest import MANIFEST, FileEntry, Manifest, decode
from ..format._stepstates import Fault, Mark, Seen, save_action, state_of, victims
from ._backend import StepJob
from ._filewrite import Staged, WriteResult, until_staged
from ._root import Attempt, BackendAttempt, Capabilities, Claim, Leftover, Listed, StepReader

SCHEME = "memory://"
#: Bytes one read of :meth:`MemoryBackend.write_from` asks for.
WINDOW = 16 << 20
CAPS = Capabilities(
    "memory", "lock", "swap",
    by_commit_order=False, mmap=False, step_noun="prefix", checks_commit=True,
)


@dataclass
class _Step:
    raw: bytes
    manifest: Manifest
    files: dict[str, bytes]
    modified: float


@dataclass
class _Attempt:
    step: int
    files: dict[str, bytes] = field(default_factory=dict)
    modified: float = field(default_factory=time.time)


@dataclass
class MemoryStore:
    """The steps, attempts, bad marks and owner of one memory root; every field is read and
    changed under ``lock`` only."""

    name: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    steps: dict[int, _Step] = field(default_factory=dict)
    attempts: dict[str, _Attempt] = field(default_factory=dict)
    aside: dict[tuple[int, str], _Step] = field(default_factory=dict)
    marks: dict[tuple[int, str], Mark] = field(default_factory=dict)
    owner: str | None = None


_stores: dict[str, MemoryStore] = {}
_stores_lock = threading.Lock()


def store(name: str) -> MemoryStore:
    """The process's memory store ``name``, made on first use."""
    with _stores_lock:
        return _stores.setdefault(name, MemoryStore(name))


def drop(name: str) -> None:
    """Forget memory store ``name`` and everything in it."""
    with _stores_lock:
        _stores.pop(name, None)


def _fault_of(s: _Step, step: int) -> str | None:
    """Why committed ``s`` is not complete (its files do not match its manifest), or None."""
    if s.manifest.step != step:
        return f"the manifest is for step {s.manifest.step}"
    for f in s.manifest.files:
        data = s.files.get(f.name)
        if data is None:
            return f"{f.name} is missing"
        if len(data) != f.size:
            return f"size mismatch: {f.name} is {len(data)} bytes, the manifest says {f.size}"
    return None


class MemoryBackend:
    """The save protocol's storage half in memory (module docstring); its methods run on a
    loop but never wait (each is a few dict operations under the store's lock)."""

    def __init__(self, mem: MemoryStore) -> None:
        self.mem = mem

    def location(self, step: int, attempt: str) -> str:
        return data_prefix(step, attempt)

    def info(self, step: int, **fields: Any) -> CheckpointInfo:
        name = step_dir_name(step)
        return CheckpointInfo(step=step, path=pathlib.Path(name), url=f"{SCHEME}{self.mem.name}/{name}", **fields)

    async def prepare(self, job: StepJob, attempt: str) -> None:
        with self.mem.lock:
            s = self.mem.steps.get(job.step)
            if s is not None:
                action = save_action(state_of(self.seen(job.step, s)))
                if action == "set-aside":  # known bad: kept for inspection, the step saved again
                    self.mem.aside[(job.step, s.manifest.attempt)] = self.mem.steps.pop(job.step)
                else:
                    raise FileExistsError(errno.EEXIST, f"step {job.step} is already committed", self.url_of(job.step))
            self.mem.attempts[data_prefix(job.step, attempt)] = _Attempt(job.step)

    def url_of(self, step: int) -> str:
        """The URL of ``step`` (in messages and listings)."""
        return f"{SCHEME}{self.mem.name}/{step_dir_name(step)}"

    def seen(self, step: int, s: _Step) -> Seen:
        """What the step rule (``_stepstates``) needs of committed ``s``; under the store's lock."""
        why = _fault_of(s, step)
        fault = None if why is None else Fault("size-mismatch", why, self.url_of(step), proven=True)
        return Seen(step, step_dir_name(step), "committed", s.manifest.attempt, s.manifest.created, fault,
                    self.mem.marks.get((step, s.manifest.attempt)))  # fmt: skip

    def _attempt(self, loc: str) -> _Attempt:
        a = self.mem.attempts.get(loc)
        if a is None:
            raise FileNotFoundError(errno.ENOENT, "no such attempt (removed)", loc)
        return a

    async def join(self, job: StepJob, loc: str) -> None:
        with self.mem.lock:
            self._attempt(loc)

    async def write_shard(
        self, job: StepJob, loc: str, name: str, buf: memoryview, size: int, staged: Staged | None
    ) -> WriteResult:
        await until_staged(staged, size, job.deadline)
        return await self.write_small(job, loc, name, bytes(buf[:size]))

    async def write_small(self, job: StepJob, loc: str, name: str, data: bytes) -> WriteResult:
        t0 = time.perf_counter()
        with self.mem.lock:
            a = self._attempt(loc)
            a.files[name] = bytes(data)
            a.modified = time.time()
        return WriteResult(len(data), crc32c(data), False, time.perf_counter() - t0, 0.0)

    async def write_from(
        self, job: StepJob, loc: str, name: str, size: int, read: Callable[[int, memoryview], None]
    ) -> WriteResult:
        buf = bytearray(size)  # memory holds the file anyway; read a window at a time
        view = memoryview(buf)
        for offset in range(0, size, WINDOW):
            await asyncio.to_thread(read, offset, view[offset:offset + WINDOW])
        return await self.write_small(job, loc, name, bytes(buf))

    async def discard(self, job: StepJob, loc: str, name: str) -> None:
        with self.mem.lock:
            self._attempt(loc).files.pop(name, None)

    async def seal(self, job: StepJob, loc: str) -> None:
        return None  # every write was whole when it returned

    async def commit(self, job: StepJob, loc: str, attempt: str, manifest: bytes) -> None:
        m = decode(manifest, self.url_of(job.step) + "/" + MANIFEST)
        with self.mem.lock:  # the commit point: the manifest and its files published together
            a = self._attempt(loc)
            if m.attempt != attempt or m.step != job.step:
                raise CheckpointCorruptError(f"the manifest names step {m.step} attempt {m.attempt}", loc)
            s = _Step(manifest, m, dict(a.files), time.time())
            why = _fault_of(s, job.step)
            if why is not None:
                raise CheckpointCorruptError(f"not committed: {why}", loc)
            if job.step in self.mem.steps:
                raise FileExistsError(
                    errno.EEXIST, f"step {job.step} was committed by another attempt while this one wrote",
                    self.url_of(job.step))  # fmt: skip
            self.mem.steps[job.step] = s
            del self.mem.attempts[loc]

    async def abandon(self, job: StepJob, loc: str, ranks: Collection[int], leader: bool) -> None:
        if leader:
            with self.mem.lock:
                self.mem.attempts.pop(loc, None)

    async def follow(self, job: StepJob, loc: str, attempt: str) -> None:
        return  # the leader commits alone

    async def release(self, job: StepJob) -> None:
        return

    async def retire(self, job: StepJob) -> None:
        if job.keep_last is not None:
            retire_steps(self.mem, job.keep_last)


def retire_steps(mem: MemoryStore, keep_last: int, dry_run: bool = False) -> list[int]:
    """Keep the newest ``keep_last`` resumable steps of ``mem`` (``_stepstates.victims``)."""
    be = MemoryBackend(mem)
    with mem.lock:
        ok = [(n, s.manifest.created) for n, s in mem.steps.items() if state_of(be.seen(n, s)) == "complete"]
        doomed = victims(ok, keep_last)
        if not dry_run:
            for n in doomed:
                del mem.steps[n]  # one swap: the step stops being listed at once
    return doomed


class _LockClaim:
    def __init__(self, mem: MemoryStore, token: str) -> None:
        self._mem, self._token = mem, token

    def check(self) -> None:
        if self._mem.owner != self._token:
            raise RootInUseError(f"{SCHEME}{self._mem.name} is no longer owned by this claim")

    def release(self) -> None:
        with self._mem.lock:
            if self._mem.owner == self._token:
                self._mem.owner = None


class MemoryStepReader(StepReader):
    """A committed memory step held by its bytes (a commit or retirement replaces the step
    in the store, never these bytes; a tamper of the tests changes them in place)."""

    def __init__(self, backend: MemoryBackend, step: int, s: _Step) -> None:
        self._backend, self._s = backend, s
        self.manifest, self.manifest_raw, self.manifest_size = s.manifest, s.raw, len(s.raw)

    def _fill(self, entry: FileEntry, offset: int, out: memoryview) -> None:
        data = self._s.files.get(entry.name, b"")[offset:offset + len(out)]
        if len(data) != len(out):
            raise CheckpointCorruptError("file ended early", self.locate(entry.name))
        out[:] = data

    def locate(self, name: str | None = None) -> str:
        where = self._backend.url_of(self.manifest.step)
        return where if name is None else f"{where}/{name}"

    def still_there(self) -> bool:
        with self._backend.mem.lock:
            return self._backend.mem.steps.get(self.manifest.step) is self._s

    def close(self) -> None:
        return None


class MemoryRoot:
    """A :class:`~asyncckpt.roots._root.Root` over the memory store ``name`` (module docstring)."""

    caps = CAPS

    def __init__(self, name: str) -> None:
        self.mem = store(name)
        self.url = f"{SCHEME}{name}"
        self._backend = MemoryBackend(self.mem)

    def __repr__(self) -> str:
        return f"MemoryRoot({self.mem.name!r})"

    def list_steps(self) -> list[Listed]:
        rows: list[Listed] = []
        with self.mem.lock:
            for n, s in self.mem.steps.items():
                seen = self._backend.seen(n, s)
                state = state_of(seen)
                mark = seen.mark
                bad = None if mark is None else {"step": n, "attempt": seen.attempt, "path": mark.path,
                                                 "reason": mark.reason, "time": mark.time}  # fmt: skip
                rows.append(Listed(
                    n, step_dir_name(n), self._backend.url_of(n), state, seen.fault is None,
                    None if seen.fault is None else seen.fault.code, None if seen.fault is None else seen.fault.reason,
                    len(s.raw) + sum(map(len, s.files.values())), len(s.files) + 1, s.manifest.world_size,
                    s.manifest.created, s.modified, s.manifest.attempt, bad, s.manifest.run))  # fmt: skip
            for (n, attempt), s in self.mem.aside.items():
                rows.append(Listed(n, f"{step_dir_name(n)}.bad-{attempt}", self._backend.url_of(n), "aside", False,
                                   "set-aside", "bad attempt set aside when the step was saved again",
                                   sum(map(len, s.files.values())), len(s.files), None, None, s.modified, attempt))
            for loc, a in self.mem.attempts.items():
                rows.append(Listed(a.step, loc, f"{self.url}/{loc}", "leftover", False, "save-leftover",
                                   "leftover of a crashed save attempt (or a save still in progress)",
                                   sum(map(len, a.files.values())), len(a.files), None, None, a.modified))
        rows.sort(key=lambda r: (r.step, r.complete, r.modified or 0.0, r.name))
        return rows

    def newest_resumable(
        self, passed: list[tuple[int, CheckpointCorruptError]] | None = None, skip: frozenset[int] = frozenset()
    ) -> int | None:
        rows = (r for r in self.list_steps() if r.state in ("complete", "bad") and r.step not in skip)
        for row in sorted(rows, key=lambda r: -r.step):
            if row.resumable:
                return row.step
            if passed is not None:
                passed.append((row.step, CheckpointCorruptError(f"known bad: {row.reason or row.bad}", row.path)))
        return None

    def resumable(self, newest: bool = False) -> list[Manifest]:
        with self.mem.lock:  # one look: the steps change only under this lock
            found = [s.manifest for n, s in sorted(self.mem.steps.items())
                     if state_of(self._backend.seen(n, s)) == "complete"]  # fmt: skip
        return found[-1:] if newest else found

    def _step(self, step: int, marks: bool = True) -> _Step:
        """Committed ``step`` whose files match its manifest; with ``marks``, not known bad."""
        with self.mem.lock:
            s = self.mem.steps.get(step)
            seen = None if s is None else self._backend.seen(step, s)
        if s is None or seen is None:
            raise CheckpointNotFoundError(f"no committed step {step} under {self.url}")
        if seen.fault is not None:
            raise CheckpointCorruptError(seen.fault.reason, self._backend.url_of(step))
        if marks and seen.mark is not None:
            raise CheckpointCorruptError(f"known bad: verification failed: {seen.mark}", self._backend.url_of(step))
        return s

    def open_step(self, step: int) -> Manifest:
        return self._step(step).manifest

    def open_reader(self, step: int) -> StepReader:
        return MemoryStepReader(self._backend, step, self._step(step, marks=False))

    def read(self, step: int, name: str, offset: int = 0, length: int | None = None) -> bytes:
        with self.open_reader(step) as reader:
            return reader.read(name, offset, length)

    def locate(self, step: int, attempt: str | None = None, name: str | None = None) -> str:
        where = self._backend.url_of(step)
        return where if name is None else f"{where}/{name}"

    def claim(self, role: str) -> Claim:
        token = f"{role}:{id(object())}:{time.monotonic_ns()}"
        with self.mem.lock:
            if self.mem.owner is not None:
                raise RootInUseError(f"{self.url} is owned by {self.mem.owner.split(':')[0]}")
            self.mem.owner = token
        return _LockClaim(self.mem, token)

    def begin(self, step: int, *, attempt: str | None = None, deadline_s: float | None = None) -> Attempt:
        return BackendAttempt(self._backend, self.url, step, deadline_s, attempt)

    def leftovers(self) -> list[Leftover]:
        now = time.time()
        with self.mem.lock:
            return [Leftover(loc, "leftover of a crashed save attempt", sum(map(len, a.files.values())),
                             now - a.modified, loc) for loc, a in sorted(self.mem.attempts.items())]  # fmt: skip

    def remove(self, leftovers: Sequence[Leftover]) -> None:
        with self.mem.lock:
            for x in leftovers:
                self.mem.attempts.pop(x.handle, None)

    def retire(self, keep_last: int, *, by_commit_order: bool = False, dry_run: bool = False) -> list[int]:
        if by_commit_order:
            raise ValueError("a memory root keeps the highest steps (by_commit_order is for local roots)")
        return retire_steps(self.mem, keep_last, dry_run)

    def remove_bad(self, entry: Listed) -> None:
        if entry.state not in ("bad", "aside"):
            raise ValueError(f"{entry.name} is {entry.state}, not known bad: only bad steps are removed")
        with self.mem.lock:
            if entry.state == "aside" and entry.attempt is not None:
                self.mem.aside.pop((entry.step, entry.attempt), None)
            else:
                s = self.mem.steps.get(entry.step)
                if s is not None and s.manifest.attempt == entry.attempt:
                    del self.mem.steps[entry.step]
            if entry.attempt is not None:
                self.mem.marks.pop((entry.step, entry.attempt), None)

    def mark_bad(self, step: int, attempt: str, path: str, reason: str) -> bool:
        with self.mem.lock:
            self.mem.marks[(step, attempt)] = Mark(path, reason, time.time())
        return True

    def clear_bad(self, step: int, attempt: str) -> bool:
        with self.mem.lock:
            return self.mem.marks.pop((step, attempt), None) is not None

    def close(self) -> None:
        return None
