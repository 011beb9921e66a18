"""One shard file read: its header (checked, bounded: ``_bounds``), its tensors into fresh
memory or into the caller's targets (``read_shard_fd``, the reads ``_readinto``'s), or mapped
(``map_shard``). Every defect is ``CheckpointCorruptError`` naming the file, an I/O fault
``CheckpointReadError`` (``_readfault``), a shard too large for this machine's memory a
``CheckpointError`` saying how much it needs. ``_load`` is the load around it.

Memory: the header's bytes are not kept (their CRC is), the slots die at their last use
(:meth:`ShardHeader.take_slots`), and the destinations of many tensors are runs
(``_readinto.Tiles``): a tensor costs a load its own objects and a few pointers.
"""

from __future__ import annotations

import ctypes
import functools
import mmap as _mmap
import operator
import os
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, TypeVar

import torch

from .._errors import CheckpointCorruptError, CheckpointError
from ..format._bounds import check_memory, human
from ..format._checksum import crc32c, crc32c_combine
from ..format._gcpause import paused_gc
from ..format._header import TensorSlot, declared_length, parse_slots
from ..format._safetensors import ST_TO_DTYPE
from ..roots._readfault import read_error
from . import _pread, _readinto

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def read_header(fd: _pread.Source, path: str, size: int) -> tuple[bytes, int, list[TensorSlot], dict[str, Any]]:
    """Read and validate a shard's header: its raw bytes, the data offset, its slots, and the
    header's ``__metadata__`` entry alone as a dict (``{}`` without one): the parsed entries,
    ~0.5 KB a tensor, die here instead of living through the load."""
    try:
        if size < 8:
            raise ValueError(f"a file of {size} bytes has no header length")
        prefix = _pread.pread(fd, 8, 0, path)
        n = declared_length(prefix, size, path)
        head = prefix + _pread.pread(fd, n, 8, path)
        data_start = 8 + n
        if data_start % 8:
            raise ValueError("data section is not 8-byte aligned")
        _, header, slots = parse_slots(head, size, path)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointCorruptError(f"bad safetensors header ({e})", path) from None
    return head, data_start, slots, header


def _allocate(slots: list[TensorSlot], need: int, path: str) -> dict[str, torch.Tensor]:
    check_memory(need, f"loading {len(slots)} tensors", path)
    try:
        return {s.name: torch.empty(s.shape, dtype=ST_TO_DTYPE[s.dtype]) for s in slots}
    except (RuntimeError, MemoryError) as e:  # the allocator refused after all
        raise CheckpointError(f"loading the shard needs {human(need)} of memory ({type(e).__name__}): {path}") from None


@dataclass
class ShardHeader:
    """A shard's parsed header, as a read needs it: the CRC-32C of its bytes (the length
    prefix included; the bytes themselves are not kept), where the data starts, its slots
    (until a read takes them: :meth:`take_slots`) and its ``__metadata__``."""

    head_crc: int
    data_start: int
    slots: list[TensorSlot] | None
    meta: dict[str, Any]

    def take_slots(self) -> list[TensorSlot]:
        """The slots, which this header then no longer holds (~0.3 KB a tensor: they die
        with the read's last use of them)."""
        slots, self.slots = self.slots, None
        if slots is None:
            raise RuntimeError("the shard's slots were taken already")
        return slots


def shard_header(fd: _pread.Source, path: str, size: int) -> ShardHeader:
    """:func:`read_header` as a :class:`ShardHeader` (the same checks and errors)."""
    head, data_start, slots, header = read_header(fd, path, size)
    return ShardHeader(crc32c(head), data_start, slots, header.get("__metadata__", {}))


_BEGIN = attrgetter("begin")
_END = attrgetter("end")
_NAME = attrgetter("name")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None  # (glibc only)
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, ValueError, AttributeError):
        return None
    return trim


def release_free_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim``; elsewhere
    nothing): what a load's parse freed (the header's text, the tree) otherwise stays in the
    process's memory while the reads then touch every page of the fresh tensors, adding to
    the peak (~100 bytes a tensor of 10,000 of 26 KB). A few ms for 300,000 tensors."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def read_shard_fd(
    fd: _pread.Source,
    path: str,
    size: int,
    expected_crc: int | None,
    targets: dict[str, torch.Tensor] | None = None,
    parsed: ShardHeader | None = None,
    verify_first: bool = False,
    take: Callable[[dict[str, torch.Tensor]], None] | None = None,
    plain: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A safetensors shard of ``size`` bytes read from an open file (the caller closes it).

    ``targets`` (from :func:`plan_targets`; the dict is taken: it may become the result's)
    names tensors to read straight into instead of fresh ones; they come back in the
    result, checksummed as their bytes land (partly
    written if the file then fails). With ``verify_first`` and a checksum to verify, no
    target is written before the whole file verified: the first pass reads the fresh tensors
    and only checksums the targets' bytes, the second reads those bytes into the targets.
    ``parsed``: :func:`shard_header`'s result for this file, if the caller has it (its slots
    are taken). ``take``, if given, is handed every tensor of the result (the fresh ones and
    the targets, by name) once they exist and before any byte is read into them; the result
    then holds none (``{}``: the caller keeps what it needs of them, nothing else does).
    ``plain``: every target is a contiguous CPU tensor (``Plan.plain``), taken as it is.
    """
    try:
        shard = parsed or shard_header(fd, path, size)
        slots = shard.take_slots()
        slots.sort(key=_BEGIN)
        with paused_gc():  # a tensor and a few pointers per saved tensor
            fresh = [s for s in slots if s.name not in targets] if targets else slots
            tensors = _allocate(fresh, sum(s.end - s.begin for s in fresh), path)
            del fresh
            guard = expected_crc is not None and verify_first
            first, into = _destinations(slots, shard.data_start, tensors, targets or {}, guard, plain)
            del slots  # (their names live on as the tensors' keys)
            if targets:  # one dict of both: the larger takes the other in
                bigger, smaller = (targets, tensors) if len(targets) > len(tensors) else (tensors, targets)
                bigger.update(smaller)
                tensors = bigger
                del targets, bigger, smaller
            if take is not None:
                take(tensors)
                tensors = {}
        release_free_heap()  # before the reads touch the tensors' pages: the parse's are free now
        crc = _readinto.read_into(fd, path, first, checksum=expected_crc is not None)
        del first
        if expected_crc is not None:
            if crc32c_combine(shard.head_crc, crc, size - shard.data_start) != expected_crc:
                raise CheckpointCorruptError("checksum mismatch", path)
            if into:  # verified: now the targets, from the page cache the first pass filled
                try:
                    _readinto.read_into(fd, path, into, checksum=False)
                except OSError as e:
                    raise noted(unreadable(e, "shard", path), AFTER_VERIFY_NOTE) from None
        return tensors, shard.meta
    except OSError as e:
        raise unreadable(e, "shard", path) from None
    except MemoryError:
        raise CheckpointError(f"not enough memory to read the shard: {path}") from None


def _destinations(
    ordered: list[TensorSlot],
    data_start: int,
    tensors: Mapping[str, torch.Tensor],
    targets: Mapping[str, torch.Tensor],
    guard: bool,
    plain: bool = False,
) -> tuple[list[_readinto.Dest], list[_readinto.Dest]]:
    """Where each slot's bytes go: ``first`` covers the file (fresh tensors, the targets, or
    with ``guard`` only a checksum of the targets' bytes), ``into`` the targets' second pass.
    ``plain``: every target is a contiguous CPU tensor (not looked at again)."""
    if ordered and not guard and (not targets or (plain and len(targets) == len(ordered))):
        # every slot's destination a contiguous CPU tensor (all fresh, or all plain targets), the
        # slots tiling the data section: one run of them, built at C speed (~0.5 us a tensor less)
        src = targets or tensors
        run = list(map(src.__getitem__, map(_NAME, ordered)))
        sizes = array("q", map(operator.sub, map(_END, ordered), map(_BEGIN, ordered)))
        begin = ordered[0].begin
        return [_readinto.Tiles(data_start + begin, ordered[-1].end - begin, run, sizes)], []
    first = _readinto.Destinations()  # everything; with guard, the targets' bytes only checksummed
    into = _readinto.Destinations()  # the targets' bytes, once the whole file verified
    add_first = first.tensor
    for s in ordered:
        offset, nbytes = data_start + s.begin, s.end - s.begin
        t = targets.get(s.name)
        if t is None:
            add_first(offset, nbytes, tensors[s.name])
            continue
        to = into if guard else first
        if plain or (t.is_cpu and t.is_contiguous()):
            to.tensor(offset, nbytes, t)
        elif t.is_cuda and t.is_contiguous():
            to.other(_readinto.Device(offset, t.detach().reshape(-1).view(torch.uint8)))
        else:
            to.other(_readinto.Staged(offset, nbytes, t))
        if guard:
            first.other(_readinto.Skip(offset, nbytes))
    return first.done(), into.done()


def unreadable(e: OSError, what: str, path: str) -> CheckpointError:
    """The error a failed read of ``what`` raises (``_readfault.read_error``): an object
    store's own error as it is (gone, timed out, unavailable: not damage), an I/O fault as
    ``CheckpointReadError``, never ``CheckpointCorruptError`` unless the errno describes the file."""
    return read_error(e, f"cannot read {what}", path)


_E = TypeVar("_E", bound=BaseException)

AFTER_VERIFY_NOTE = (
    " (verify_first: the shard verified, then reading it into the targets failed:"
    " they may be partly overwritten)"
)


def noted(exc: _E, note: str) -> _E:
    """``exc`` with ``note`` appended to its message (when it is a single string, or an
    ``OSError``'s ``strerror``; once)."""
    if isinstance(exc, OSError) and isinstance(exc.strerror, str):
        if note not in exc.strerror:
            exc.strerror = f"{exc.strerror}{note}"
    elif len(exc.args) == 1 and isinstance(exc.args[0], str) and note not in exc.args[0]:
        exc.args = (f"{exc.args[0]}{note}",)
    return exc


def map_shard(fd: int, path: str, size: int, expected_crc: int | None) -> dict[str, torch.Tensor]:
    """The tensors of an open shard as views of one private mapping of the file (no copy).

    With ``expected_crc`` the whole file is checksummed first, through bounded buffers, and a
    mismatch raises ``CheckpointCorruptError`` before anything is mapped. The mapping lives
    as long as any tensor of it (each holds a reference), and holds the inode after an
    unlink. Writes to the tensors are private to this process (copy-on-write).
    """
    if expected_crc is not None:
        try:
            _readinto.verify_file(fd, path, size, expected_crc)
        except OSError as e:
            raise unreadable(e, "shard", path) from None
    try:
        _, data_start, slots, _ = read_header(fd, path, size)
        mapped = _mmap.mmap(fd, size, flags=_mmap.MAP_PRIVATE, prot=_mmap.PROT_READ | _mmap.PROT_WRITE)
    except OSError as e:
        raise read_error(e, "cannot map shard", path) from None
    out: dict[str, torch.Tensor] = {}
    for s in slots:
        dtype = ST_TO_DTYPE[s.dtype]
        count = (s.end - s.begin) // dtype.itemsize
        if count == 0:  # frombuffer refuses empty views
            out[s.name] = torch.empty(s.shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=data_start + s.begin)
        out[s.name] = flat.view(s.shape)
    return out
