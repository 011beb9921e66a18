"""Parallel, bounded reads of one shard file into the memory the caller names.

A read is a list of destinations sorted by file offset: byte views of contiguous CPU
tensors (read straight into, with ``preadv``; a run of them that tiles a file range is one
:class:`Tiles`, two pointers a tensor) and ``Staged`` targets (non-contiguous or CUDA tensors
of the saved dtype and shape), which go through one reused bounce buffer per thread, a
leading-dimension slice at a time, and a ``copy_``. The destinations are split into
contiguous file ranges, one per I/O thread; every thread checksums what it read while the
bytes are still in cache, and the ranges' CRC-32Cs are combined in file order, so a
whole-file checksum costs one cache-hot pass on the threads that read. ``verify_file``
checksums a file through the same bounce buffers without keeping anything (the verification
before a read into the caller's tensors). Extra memory: ``threads x BOUNCE`` bytes, whatever
the state size.

The sources (a file descriptor or a range source), exact reads and bounce buffers are
``_pread``'s; ``_blocks.read_blocks`` is the same reader for many files and checked blocks
(the resharded load), on the sources and threads of this module.
"""

from __future__ import annotations

import ctypes
from array import array
from typing import Any, NamedTuple

import numpy as np
import torch

from .._errors import CheckpointCorruptError
from ..format._checksum import crc32c, crc32c_chain, crc32c_combine
from ._pread import IOV_MAX, Bounce, Source, advise_sequential, bytes_of, parallel, pread_exact

#: I/O threads of one read (GIL-free ``preadv`` and CRC); more do not help a 2-core machine.
THREADS = 4
#: One thread's bounce buffer (verification, staged targets) and its largest ``preadv``.
BOUNCE = 4 * 1024 * 1024


def threads_for(sources: Any) -> int:
    return max((s.threads for s in sources if not isinstance(s, int)), default=THREADS)


# The destinations are tuples: one is made per tensor of every load (a frozen dataclass's
# init cost ~1 us more, 10 ms of a 10,000-tensor load)
class Direct(NamedTuple):
    """File bytes ``[offset, offset + len(view))`` land in ``view``."""

    offset: int
    view: memoryview

    @property
    def nbytes(self) -> int:
        return len(self.view)


class Tiles(NamedTuple):
    """File bytes ``[offset, offset + nbytes)`` land in ``tensors`` back to back: contiguous
    CPU tensors, the i-th of exactly ``sizes[i]`` bytes (the common destination of a load of
    many tensors: a pointer and 8 bytes a tensor; the views are made by the thread that reads)."""

    offset: int
    nbytes: int
    tensors: list[torch.Tensor]
    sizes: array[int]


#: dtypes whose tensors ``Tensor.numpy()`` converts
_NUMPY_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
    torch.float64, torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64,
})  # fmt: skip


def _memory_view_maker() -> Any:
    """CPython's ``PyMemoryView_FromMemory`` (a writable byte view of an address, owning
    nothing), or ``None`` where ``ctypes.pythonapi`` lacks it."""
    try:
        make = ctypes.pythonapi.PyMemoryView_FromMemory
    except (AttributeError, OSError):
        return None
    make.restype = ctypes.py_object
    make.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
    return make


_FROM_MEMORY = _memory_view_maker()
_PYBUF_WRITE = 0x200


def raw_view(t: torch.Tensor, nbytes: int) -> memoryview:
    """A writable byte view of the ``nbytes`` bytes of a contiguous CPU tensor (any dtype, with
    grad or not) at ~half :func:`byte_view`'s cost: made from its address, it does not keep
    ``t`` alive (the caller holds ``t`` while the view is used: a read's run of tensors)."""
    if _FROM_MEMORY is None:
        return byte_view(t)
    view: memoryview = _FROM_MEMORY(t.data_ptr(), nbytes, _PYBUF_WRITE)
    return view


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


Dest = Direct | Tiles | Device | Staged | Skip


class Destinations:
    """A read's destination list, built in file order: consecutive contiguous CPU tensors
    join one :class:`Tiles`, adjacent skips one :class:`Skip`."""

    def __init__(self) -> None:
        self.dests: list[Dest] = []
        self._run: list[torch.Tensor] = []
        self._sizes = array("q")
        self._start = self._end = 0

    def tensor(self, offset: int, nbytes: int, t: torch.Tensor) -> None:
        """File bytes ``[offset, offset + nbytes)`` land in ``t``, a contiguous CPU tensor of
        exactly ``nbytes`` bytes."""
        if offset != self._end or not self._run:
            self._close()
            self._start = offset
        self._run.append(t)
        self._sizes.append(nbytes)
        self._end = offset + nbytes

    def other(self, d: Dest) -> None:
        """Any other destination, after those added so far."""
        self._close()
        last = self.dests[-1] if self.dests else None
        if isinstance(d, Skip) and isinstance(last, Skip) and last.offset + last.nbytes == d.offset:
            self.dests[-1] = Skip(last.offset, last.nbytes + d.nbytes)
        else:
            self.dests.append(d)

    def _close(self) -> None:
        if self._run:
            self.dests.append(Tiles(self._start, self._end - self._start, self._run, self._sizes))
            self._run, self._sizes = [], array("q")

    def done(self) -> list[Dest]:
        """The destinations (the builder is spent)."""
        self._close()
        return self.dests


# ---------------------------------------------------------------------- reads
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
            if crc is not None:  # just landed: still in cache
                crc = crc32c_chain(run, crc)
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

    def add(offset: int, view: memoryview) -> None:
        """The bytes of ``view`` from the file at ``offset``, in pieces of at most a bounce buffer."""
        nonlocal run_start, run_bytes
        n = len(view)
        for i in range(0, n, BOUNCE):
            if run and run_start + run_bytes != offset + i:
                flush()  # not adjacent to the run: a new preadv
            if not run:
                run_start = offset + i
            v = view if n <= BOUNCE else view[i : i + BOUNCE]  # (a small tensor: the view itself)
            run.append(v)
            run_bytes += len(v)
            # (a preadv takes IOV_MAX views at most: a run of more small tensors would only
            # hold their views longer)
            if run_bytes >= BOUNCE or len(run) >= IOV_MAX:
                flush()

    local = isinstance(fd, int)  # (a range source gets byte_view's views, which own their tensor)
    for d in dests:
        if isinstance(d, Tiles):  # a run of contiguous CPU tensors (the common case): each visited once
            flush_dev()
            if isinstance(fd, int) and _FROM_MEMORY is not None and _small_tiles(d):
                flush()
                crc = _read_tiles(fd, d, path, crc)
                continue
            pos = d.offset
            for t, n in zip(d.tensors, d.sizes, strict=True):
                if not 0 < n <= BOUNCE or run_start + run_bytes != pos:  # (empty: nothing; large: cut)
                    if n:
                        add(pos, byte_view(t))
                    pos += n
                    continue
                # add()'s common case inline: the run goes on (run_start + run_bytes == pos); the
                # view made from the tensor's address (d.tensors holds the tensor through the read)
                run.append(raw_view(t, n) if local else byte_view(t))
                run_bytes += n
                pos += n
                if run_bytes >= BOUNCE or len(run) >= IOV_MAX:
                    flush()
            continue
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
        add(d.offset, d.view)
    flush()
    flush_dev()
    return crc or 0


def _small_tiles(d: Tiles) -> bool:
    """Whether every tensor of ``d`` has at most :data:`BOUNCE` bytes, some more than none (what
    :func:`_read_tiles` reads)."""
    sizes = np.frombuffer(d.sizes, dtype=np.int64)
    return bool(len(sizes) and 0 < sizes.max() <= BOUNCE)


def _read_tiles(fd: int, d: Tiles, path: str, crc: int | None) -> int | None:
    """Read a run of small tensors (:func:`_small_tiles`; empty ones too) from a local file: one ``preadv`` per
    :data:`IOV_MAX` of them or :data:`BOUNCE` bytes, each checksummed as it lands (``crc``
    continued, in file order). The per-tensor work is done at C speed: the addresses read in one
    ``map``, the byte views sliced from one view of the address range the run's tensors lie in
    (``d.tensors`` holds them through the read; the view owns nothing and is only sliced where a
    tensor is), ~0.5 us a tensor less than a :func:`raw_view` each, on the I/O threads that
    share the GIL while the caller waits (issue 32)."""
    count = len(d.tensors)
    sizes = np.frombuffer(d.sizes, dtype=np.int64)
    addrs = np.fromiter(map(torch.Tensor.data_ptr, d.tensors), dtype=np.int64, count=count)
    some = sizes > 0
    base = int(addrs[some].min())
    addrs[~some] = base  # (an empty tensor's address may be anything: its view is empty at the base)
    ends = addrs + sizes
    span: memoryview = _FROM_MEMORY(base, int(ends.max()) - base, _PYBUF_WRITE)
    addrs -= base
    ends -= base
    cum = np.cumsum(sizes)
    # chunk k ends after the first tensor that brings it to BOUNCE bytes, or at IOV_MAX tensors
    i, pos = 0, d.offset
    while i < count:
        before = int(cum[i - 1]) if i else 0
        j = min(count, i + IOV_MAX, int(np.searchsorted(cum, before + BOUNCE, side="left")) + 1)
        views = list(map(span.__getitem__, map(slice, addrs[i:j].tolist(), ends[i:j].tolist())))
        pread_exact(fd, views, pos, path)
        if crc is not None:  # just landed: still in cache
            crc = crc32c_chain(views, crc)
        pos = d.offset + int(cum[j - 1])
        i = j
    return crc


def _cut_tiles(d: Tiles, step: int) -> list[Dest]:
    """A run of tensors cut at tensor boundaries into pieces of at most ``step`` bytes (a
    tensor larger than that alone, and cut as a ``Direct``)."""
    ends = np.cumsum(np.frombuffer(d.sizes, dtype=np.int64)) if len(d.sizes) else np.zeros(0, np.int64)
    out: list[Dest] = []
    i, start = 0, 0
    while i < len(d.tensors):
        j = int(np.searchsorted(ends, start + step, side="right"))
        if j <= i:  # tensor i alone exceeds step
            view = byte_view(d.tensors[i])
            out.extend(Direct(d.offset + start + k, view[k : k + step]) for k in range(0, len(view), step))
            j = i + 1
        else:
            out.append(Tiles(d.offset + start, int(ends[j - 1]) - start, d.tensors[i:j], d.sizes[i:j]))
        start = int(ends[j - 1])
        i = j
    return out


def _split(dests: list[Dest], parts: int) -> list[list[Dest]]:
    """``dests`` (sorted, contiguous) cut into ``parts`` runs of about equal bytes."""
    total = sum(d.nbytes for d in dests)
    # a part under a sixteenth of a bounce buffer (256 KiB) costs less to read than a thread's start
    parts = min(parts, -(-total // max(1, BOUNCE // 16)))
    if parts <= 1 or total == 0:
        return [dests] if dests else []
    # cut large direct views and skips so a single big tensor is still read by every thread
    pieces: list[Dest] = []
    step = max(BOUNCE, -(-total // (parts * 4)))
    for d in dests:
        if isinstance(d, Tiles):  # many tensors: cut finer, so small files use every thread too
            fine = max(1, -(-total // (parts * 4)))
            pieces.extend(_cut_tiles(d, fine) if d.nbytes > fine else [d])
            continue
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
