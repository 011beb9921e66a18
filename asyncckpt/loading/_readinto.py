"""Parallel, bounded reads of one shard file into the memory the caller names.

A read is a list of destinations sorted by file offset: byte views of contiguous CPU
tensors (read straight into, with ``preadv``) and ``Staged`` targets (non-contiguous or
CUDA tensors of the saved dtype and shape), which go through one reused bounce buffer per
thread, a leading-dimension slice at a time, and a ``copy_``. The destinations are split
into contiguous file ranges, one per I/O thread; every thread checksums what it read while
the bytes are still in cache, and the ranges' CRC-32Cs are combined in file order, so a
whole-file checksum costs one cache-hot pass on the threads that read. ``verify_file``
checksums a file through the same bounce buffers without keeping anything (the verification
before a read into the caller's tensors). Short reads are continued; a read past the end is
``CheckpointCorruptError``. Extra memory: ``threads x BOUNCE`` bytes, whatever the state size.

``_blocks.read_blocks`` is the same reader for many files and checked blocks (the resharded
load), on the sources and threads of this module.

A *source* is an open file descriptor (``preadv``) or a :class:`RangeSource`: bytes read by
ranges from elsewhere (a root's ``StepReader``: a store's ranged GETs, memory; see
``_stepfiles``). Everything above holds for both; a range source only says how many reads it
wants in flight.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from .._errors import CheckpointCorruptError, CheckpointError
from ..format._checksum import crc32c, crc32c_combine
from ..threads._iopool import IOPool

#: I/O threads of one read (GIL-free ``preadv`` and CRC); more do not help a 2-core machine.
THREADS = 4
#: One thread's bounce buffer (verification, staged targets) and its largest ``preadv``.
BOUNCE = 4 * 1024 * 1024
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
T = TypeVar("T")


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


def threads_for(sources: Any) -> int:
    return max((s.threads for s in sources if not isinstance(s, int)), default=THREADS)


def source_order(src: Source) -> tuple[int, int]:
    return (0, src) if isinstance(src, int) else (1, src.order)


# The destinations are tuples: one is made per tensor of every load (a frozen dataclass's
# init cost ~1 us more, 10 ms of a 10,000-tensor load)
class Direct(NamedTuple):
    """File bytes ``[offset, offset + len(view))`` land in ``view``."""

    offset: int
    view: memoryview

    @property
    def nbytes(self) -> int:
        return len(self.view)


class Whole(NamedTuple):
    """File bytes ``[offset, offset + nbytes)`` land in ``tensor``, a contiguous CPU tensor of
    exactly ``nbytes`` bytes. Its byte view is made by the thread that reads it, when it gets
    there (:func:`byte_view`): a load of many tensors holds a tuple per tensor, not a view."""

    offset: int
    nbytes: int
    tensor: torch.Tensor


#: dtypes whose tensors ``Tensor.numpy()`` converts
_NUMPY_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
    torch.float64, torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64,
})  # fmt: skip


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype, bf16 included)."""
    if t.numel() == 0:
        return memoryview(bytearray())
    if not t.requires_grad and t.dtype in _NUMPY_DTYPES:
        # numpy's own view: half the cost of the generic path (~2 us of a 10,000-tensor load's
        # per-tensor work); bf16 and the float8s have no numpy dtype
        return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


class Staged(NamedTuple):
    """File bytes ``[offset, offset + nbytes)`` are ``target``'s elements in row-major order."""

    offset: int
    nbytes: int
    target: torch.Tensor


class Device(NamedTuple):
    """File bytes ``[offset, offset + dst.numel())`` land in ``dst``, the flat byte view of a
    contiguous tensor on a CUDA device. Adjacent ones share one read into a pinned bounce
    buffer and one checksum pass, then each gets its own host-to-device copy out of it."""

    offset: int
    dst: torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.dst.numel())


class Skip(NamedTuple):
    """File bytes ``[offset, offset + nbytes)`` are only checksummed (through the bounce buffer)."""

    offset: int
    nbytes: int


Dest = Direct | Whole | Device | Staged | Skip


# ---------------------------------------------------------------------- reads
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
        batch = views[i : i + _IOV_MAX]
        want = sum(len(v) for v in batch)
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


def _read_skipped(fd: Source, d: Skip, bounce: Bounce, path: str, crc: int | None) -> int | None:
    for pos in range(d.offset, d.offset + d.nbytes, BOUNCE):
        n = min(BOUNCE, d.offset + d.nbytes - pos)
        view = bytes_of(bounce.get(n)[:n])
        pread_exact(fd, [view], pos, path)
        if crc is not None:
            crc = crc32c(view, crc)
    return crc


def _read_staged(fd: Source, d: Staged, bounce: Bounce, path: str, crc: int | None) -> int | None:
    if d.nbytes == 0:
        return crc
    t = d.target
    rows = t.shape[0] if t.dim() else 1
    row_bytes = d.nbytes // rows if rows else 0
    per = max(1, BOUNCE // row_bytes) if row_bytes else rows
    cuda = t.is_cuda and torch.cuda.is_available()
    pos = d.offset
    with torch.no_grad():
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            n = (r1 - r0) * row_bytes
            i, buf = bounce.next_pinned(n) if cuda else (0, bounce.get(n))
            pread_exact(fd, [bytes_of(buf[:n])], pos, path)
            if crc is not None:
                crc = crc32c(bytes_of(buf[:n]), crc)
            src = buf[:n].view(t.dtype)
            dst = t[r0:r1] if t.dim() else t
            src = src.view(dst.shape)
            if cuda:
                bounce.copy_out(i, [(dst, src)])
            else:
                dst.copy_(src)
            pos += n
    return crc


def _read_range(fd: Source, dests: list[Dest], path: str, checksum: bool) -> int:
    """Read one thread's destinations (sorted by offset); the CRC-32C of the bytes read, in
    order (0 if not asked: with ``checksum`` the destinations must be consecutive)."""
    bounce = Bounce()
    try:
        return _read_range_with(fd, dests, path, checksum, bounce)
    finally:
        bounce.drain()


def _read_range_with(fd: Source, dests: list[Dest], path: str, checksum: bool, bounce: Bounce) -> int:
    crc: int | None = 0 if checksum else None
    run: list[memoryview] = []
    run_start = run_bytes = 0

    dev: list[Device] = []
    dev_start = dev_bytes = 0

    def flush() -> None:
        nonlocal crc, run, run_bytes
        if run:
            pread_exact(fd, run, run_start, path)
            if crc is not None:
                for v in run:  # just landed: still in cache
                    crc = crc32c(v, crc)
        run, run_bytes = [], 0

    def flush_dev() -> None:
        nonlocal crc, dev, dev_bytes
        if dev:
            i, buf = bounce.next_pinned(dev_bytes)
            pread_exact(fd, [bytes_of(buf[:dev_bytes])], dev_start, path)
            if crc is not None:
                crc = crc32c(bytes_of(buf[:dev_bytes]), crc)
            pairs, at = [], 0
            for p in dev:
                pairs.append((p.dst, buf[at : at + p.nbytes]))
                at += p.nbytes
            bounce.copy_out(i, pairs)
        dev, dev_bytes = [], 0

    for d in dests:
        if isinstance(d, Whole):
            d = Direct(d.offset, byte_view(d.tensor))
        if isinstance(d, Device):
            flush()
            for i in range(0, d.nbytes, BOUNCE):
                piece = Device(d.offset + i, d.dst[i : i + BOUNCE])
                if dev and (
                    dev_start + dev_bytes != piece.offset
                    or dev[0].dst.device != piece.dst.device
                    or dev_bytes + piece.nbytes > BOUNCE
                ):
                    flush_dev()
                if not dev:
                    dev_start = piece.offset
                dev.append(piece)
                dev_bytes += piece.nbytes
            continue
        flush_dev()
        if isinstance(d, Staged):
            flush()
            crc = _read_staged(fd, d, bounce, path, crc)
            continue
        if isinstance(d, Skip):
            flush()
            crc = _read_skipped(fd, d, bounce, path, crc)
            continue
        n = d.nbytes
        if 0 < n <= BOUNCE:  # one piece: the view itself, not a slice of it (a small tensor)
            if run and run_start + run_bytes != d.offset:
                flush()
            if not run:
                run_start = d.offset
            run.append(d.view)
            run_bytes += n
            if run_bytes >= BOUNCE or len(run) >= _IOV_MAX:
                flush()
            continue
        for i in range(0, n, BOUNCE):
            if run and run_start + run_bytes != d.offset + i:
                flush()  # not adjacent to the run: a new preadv
            if not run:
                run_start = d.offset + i
            v = d.view[i : i + BOUNCE]
            run.append(v)
            run_bytes += len(v)
            # (a preadv takes _IOV_MAX views at most: a run of more small tensors would only
            # hold their views longer)
            if run_bytes >= BOUNCE or len(run) >= _IOV_MAX:
                flush()
    flush()
    flush_dev()
    return crc or 0


def _split(dests: list[Dest], parts: int) -> list[list[Dest]]:
    """``dests`` (sorted, contiguous) cut into ``parts`` runs of about equal bytes."""
    total = sum(d.nbytes for d in dests)
    if parts <= 1 or total == 0:
        return [dests] if dests else []
    # cut large direct views and skips so a single big tensor is still read by every thread
    pieces: list[Dest] = []
    step = max(BOUNCE, -(-total // (parts * 4)))
    for d in dests:
        if isinstance(d, Whole) and d.nbytes > step:
            d = Direct(d.offset, byte_view(d.tensor))  # (one of a few large tensors)
        if isinstance(d, Direct) and d.nbytes > step:
            pieces.extend(Direct(d.offset + i, d.view[i : i + step]) for i in range(0, d.nbytes, step))
        elif isinstance(d, Device) and d.nbytes > step:
            pieces.extend(Device(d.offset + i, d.dst[i : i + step]) for i in range(0, d.nbytes, step))
        elif isinstance(d, Staged) and d.nbytes > step and d.target.dim() and d.target.shape[0] > 1:
            pieces.extend(_cut_rows(d, step))
        elif isinstance(d, Skip) and d.nbytes > step:
            pieces.extend(Skip(d.offset + i, min(step, d.nbytes - i)) for i in range(0, d.nbytes, step))
        else:
            pieces.append(d)
    groups: list[list[Dest]] = [[]]
    acc, share = 0, total / parts
    for d in pieces:
        if acc >= share * len(groups) and len(groups) < parts and groups[-1]:
            groups.append([])
        groups[-1].append(d)
        acc += d.nbytes
    return groups


def _cut_rows(d: Staged, step: int) -> list[Staged]:
    """A staged target cut along its leading dimension into pieces of about ``step`` bytes
    (whole rows), so a large CUDA or non-contiguous tensor is read by every thread too."""
    rows = d.target.shape[0]
    row_bytes = d.nbytes // rows
    per = max(1, step // row_bytes) if row_bytes else rows
    return [
        Staged(d.offset + r0 * row_bytes, (min(rows, r0 + per) - r0) * row_bytes, d.target[r0 : r0 + per])
        for r0 in range(0, rows, per)
    ]


def _settle_cuda_targets(dests: list[Dest]) -> None:
    """Let the work already queued on the devices of CUDA targets finish before the reads
    overwrite them from the I/O threads' own streams (a kernel of the caller's stream may
    still read a target)."""
    devices = {d.target.device for d in dests if isinstance(d, Staged) and d.target.is_cuda}
    devices |= {d.dst.device for d in dests if isinstance(d, Device) and d.dst.is_cuda}
    if devices and torch.cuda.is_available():
        for dev in devices:
            torch.cuda.synchronize(dev)


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


def advise_sequential(fd: Source) -> None:
    if isinstance(fd, int) and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass


def read_into(fd: Source, path: str, dests: list[Dest], *, checksum: bool, threads: int | None = None) -> int:
    """Read ``dests`` (sorted by offset) in parallel, ``threads`` (default :data:`THREADS`, or
    what a range source asks for) at once.

    With ``checksum`` the destinations must tile one contiguous file range; returns its
    CRC-32C then (else 0).
    """
    advise_sequential(fd)
    _settle_cuda_targets(dests)
    groups = _split(dests, threads or threads_for([fd]))
    crcs = parallel("asyncckpt-read", _read_range, [(fd, g, path, checksum) for g in groups])
    if not checksum:
        return 0
    crc = 0
    for g, c in zip(groups, crcs, strict=True):
        crc = crc32c_combine(crc, c, sum(d.nbytes for d in g))
    return crc


def verify_file(fd: Source, path: str, size: int, expected_crc: int, *, threads: int | None = None) -> None:
    """Checksum the whole file through the threads' bounce buffers; ``CheckpointCorruptError``
    unless it is ``expected_crc``. Nothing read is kept (the page cache may keep it)."""
    advise_sequential(fd)
    parts = max(1, min(threads or threads_for([fd]), -(-size // BOUNCE)))
    cut = -(-size // parts)
    bounds = [(i * cut, min(size, (i + 1) * cut)) for i in range(parts)]

    def one(begin: int, end: int) -> int:
        buf = torch.empty(min(BOUNCE, end - begin), dtype=torch.uint8)
        view = bytes_of(buf) if buf.numel() else memoryview(bytearray())
        crc = 0
        for pos in range(begin, end, BOUNCE):
            n = min(BOUNCE, end - pos)
            pread_exact(fd, [view[:n]], pos, path)
            crc = crc32c(view[:n], crc)
        return crc

    crcs = parallel("asyncckpt-verify", one, bounds)
    crc = 0
    for (b, e), c in zip(bounds, crcs, strict=True):
        crc = crc32c_combine(crc, c, e - b)
    if crc != expected_crc:
        raise CheckpointCorruptError("checksum mismatch", path)
