"""The I/O under a read: exact reads of byte ranges of a *source*, each I/O thread's reused
bounce buffers, and running a read's threads (:func:`parallel`) (``_readinto``, ``_blocks``).

A source is an open file descriptor (``preadv``, short reads continued, up to the system's
``IOV_MAX`` views a call) or a :class:`RangeSource`: bytes read by ranges from elsewhere (a
root's ``StepReader``: a store's ranged GETs, memory; see ``_stepfiles``), which only says how
many reads it wants in flight. A read past the end is ``CheckpointCorruptError``; an
``OSError`` names the file.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from .._errors import CheckpointCorruptError, CheckpointError
from ..threads._iopool import IOPool

#: The smallest bounce buffer (``_readinto.BOUNCE``: one thread's largest staged piece).
BOUNCE = 4 * 1024 * 1024
T = TypeVar("T")
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


class RangeSource(Protocol):
    """Bytes of one object read by ranges (not a local file): an object store's ranged GETs."""

    #: reads of this source worth having in flight at once (the I/O threads of a read)
    threads: int
    #: orders sources among each other (a read visits each source's ranges in offset order)
    order: int

    def read_exact(self, views: list[memoryview], offset: int) -> None:
        """Fill ``views`` (consecutive in the object) from ``offset``, or raise: ``OSError``
        (an ``ObjectStoreError`` keeps its type) or ``CheckpointCorruptError``."""
        ...


#: An open file descriptor or a range source.
Source = int | RangeSource


def source_order(src: Source) -> tuple[int, int]:
    return (0, src) if isinstance(src, int) else (1, src.order)


def pread_exact(fd: Source, views: list[memoryview], offset: int, path: str) -> None:
    """Fill ``views`` (consecutive in the file) from ``offset``; short reads are continued."""
    if not isinstance(fd, int):
        fd.read_exact(views, offset)
        return
    try:
        _preadv_exact(fd, views, offset, path)
    except OSError as e:
        if e.filename is None and not isinstance(e, CheckpointError):
            e.filename = path  # name the file: the caller tells damage from an I/O fault by errno
        raise


def _preadv_exact(fd: int, views: list[memoryview], offset: int, path: str) -> None:
    i = 0
    while i < len(views):
        batch = views[i : i + IOV_MAX]
        want = sum(map(len, batch))
        got = os.preadv(fd, batch, offset)
        if got == want:
            offset += got
            i += len(batch)
            continue
        for v in batch:  # a short read: finish the batch view by view
            if got >= len(v):
                got -= len(v)
                offset += len(v)
                continue
            pos, offset, got = got, offset + got, 0
            while pos < len(v):
                n = os.preadv(fd, [v[pos:]], offset)
                if n <= 0:
                    raise CheckpointCorruptError("file ended early", path)
                pos += n
                offset += n
        i += len(batch)


def pread(src: Source, n: int, offset: int, path: str) -> bytes:
    """Exactly ``n`` bytes of ``src`` from ``offset`` (``CheckpointCorruptError`` if it ends first)."""
    if n <= 0:
        return b""
    buf = bytearray(n)
    pread_exact(src, [memoryview(buf)], offset, path)
    return bytes(buf)


def bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]


class Bounce:
    """One thread's reused buffers: a plain one, and for CUDA targets (when CUDA is there) two
    pinned ones that alternate, so the next piece is read while the last one is still being
    copied to the device on the thread's side stream."""

    def __init__(self) -> None:
        self.cpu: torch.Tensor | None = None
        self.pinned: list[torch.Tensor | None] = [None, None]
        self.copied: list[Any] = [None, None]  # per pinned buffer: the event of its last copy out
        self.streams: dict[torch.device, Any] = {}
        self.turn = 0

    def get(self, nbytes: int) -> torch.Tensor:
        if self.cpu is None or self.cpu.numel() < nbytes:
            self.cpu = torch.empty(max(nbytes, BOUNCE), dtype=torch.uint8)
        return self.cpu

    def next_pinned(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The pinned buffer to fill next, once the device copy out of it has finished."""
        i = self.turn
        self.turn ^= 1
        ev = self.copied[i]
        if ev is not None:
            ev.synchronize()
            self.copied[i] = None
        buf = self.pinned[i]
        if buf is None or buf.numel() < nbytes:
            pin = torch.cuda.is_available()
            buf = self.pinned[i] = torch.empty(max(nbytes, BOUNCE), dtype=torch.uint8, pin_memory=pin)
        return i, buf

    def copy_out(self, i: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``dst.copy_(src)`` for each pair, ``src`` a piece of pinned buffer ``i``: on a CUDA
        device, queued on this thread's side stream (overlapping the next read) and noted as
        the buffer's last copy out; elsewhere at once."""
        device = pairs[0][0].device
        if device.type != "cuda":
            for dst, src in pairs:
                dst.copy_(src)
            return
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(stream)
        self.copied[i] = ev

    def drain(self) -> None:
        """Wait until every device copy out of the pinned buffers has finished (so the targets
        hold their bytes when the read returns, and the buffers may be freed)."""
        for i, ev in enumerate(self.copied):
            if ev is not None:
                ev.synchronize()
                self.copied[i] = None


def advise_sequential(fd: Source) -> None:
    if isinstance(fd, int) and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass


def parallel(name: str, fn: Callable[..., T], calls: list[tuple[Any, ...]]) -> list[T]:
    """``fn(*args)`` for every ``args`` of ``calls``, one thread each; waits for all of them
    (no thread is left writing into the caller's memory) and raises the first failure."""
    if len(calls) <= 1:
        return [fn(*args) for args in calls]
    pool = IOPool(len(calls), name)
    try:
        futures = [pool.submit(fn, *args) for args in calls]
        concurrent.futures.wait(futures)
        for f in futures:
            exc = f.exception()
            if exc is not None:
                raise exc
        return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=True)
