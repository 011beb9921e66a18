"""The safetensors file format on the torch side: dtype mapping and the layout of a shard.

(Parsing and validating a header read back is torch-free, in ``_header``.) A shard is
``[u64 little-endian N][N bytes JSON header][data]``. We pad the header with spaces so the
data section starts on a 4096-byte boundary (readers accept trailing header whitespace),
which lets the whole file be written with O_DIRECT straight from the staging buffer.
Tensors are ordered by descending element size, then name, so every tensor starts aligned
to its element size and can be viewed without a copy on load.
"""

from __future__ import annotations

import array
import json
import json.encoder
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._header import ITEMSIZE, TORCH_NAME, TensorSlot, check_header_length, round_up, shape_bytes

#: The tensor types whose bytes are saved and restored as they are (no subclass: a subclass
#: may hold its data elsewhere or mean something else by it).
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)

DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
ST_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_ST.items()}
assert all(ITEMSIZE[v] == k.itemsize and TORCH_NAME[v] == str(k)[6:] for k, v in DTYPE_TO_ST.items())


@dataclass(frozen=True)
class ShardLayout:
    """The complete byte layout of one shard file."""

    header: bytes  # the 8-byte length prefix and the padded JSON header
    slots: tuple[TensorSlot, ...]
    data_start: int  # file offset of the data section (a multiple of ALIGN)
    data_len: int

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_len


def plan_layout(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> ShardLayout:
    """Lay out tensors ``(name, dtype, shape)`` into one safetensors shard.

    Refuses, with ``ValueError`` naming the tensor (its key path) and the limit, what a reader
    would refuse (``_header``'s rules, shared with it): a shape of more than ``MAX_DIMS``
    dimensions or of 2**63 bytes or more, and a header longer than safetensors readers take
    (``_header.check_header_length``: an export is refused by the same rule).
    """
    return plan_order(specs, metadata)[0]


def plan_order(
    specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]
) -> tuple[ShardLayout, array.array[int]]:
    """:func:`plan_layout`, and the permutation from ``specs`` to the layout's slots (slot
    ``j`` holds ``specs[perm[j]]``).

    Built for states of many tensors (issue 32: ~0.3 KB a tensor kept, none of it a dict or a
    list per tensor): the header's JSON is written entry by entry, in pieces, exactly as
    ``json.dumps`` writes the dict of its entries (compact, ``ensure_ascii=False``); equal
    shapes share one tuple, and a slot's end is the next slot's begin (one int object)."""
    for name, dtype, shape in specs:  # (once per structure: layouts are cached)
        try:
            shape_bytes(shape, dtype.itemsize)
        except ValueError as e:
            raise ValueError(f"tensor {name!r} has {e}") from None
    perm = array.array("q", sorted(range(len(specs)), key=lambda i: (-specs[i][1].itemsize, specs[i][0])))
    if any(s[0] == "__metadata__" for s in specs):  # (never from flatten): the dict's own semantics
        return _plan_by_dict([specs[i] for i in perm], metadata), perm
    slots: list[TensorSlot] = []
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    quote = json.encoder.encode_basestring  # what json.dumps(ensure_ascii=False) quotes a str with
    out = bytearray(8)  # the length prefix, filled in at the end
    out += b'{"__metadata__":' + json.dumps(dict(metadata), separators=(",", ":"), ensure_ascii=False).encode()
    piece: list[str] = []
    offset = 0
    for j, i in enumerate(perm):
        name, dtype, dims = specs[i]
        shape = tuple(dims)
        shape = shapes.setdefault(shape, shape)
        end = offset + math.prod(shape) * dtype.itemsize
        st = DTYPE_TO_ST[dtype]
        slots.append(TensorSlot(name, st, shape, offset, end))
        piece.append(
            f',{quote(name)}:{{"dtype":"{st}","shape":[{",".join(map(str, shape))}],"data_offsets":[{offset},{end}]}}'
        )
        offset = end
        if len(piece) == 4096 or j == len(perm) - 1:  # the header in pieces: no str per tensor at once
            out += "".join(piece).encode("utf-8")
            piece.clear()
    out += b"}"
    data_start = round_up(len(out))
    try:
        check_header_length(data_start - 8)  # the length the shard declares, padding included
    except ValueError as e:
        raise _header_too_long(e, slots) from None
    out += b" " * (data_start - len(out))
    out[:8] = struct.pack("<Q", data_start - 8)
    return ShardLayout(bytes(out), tuple(slots), data_start, offset), perm


def _plan_by_dict(order: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> ShardLayout:
    """The layout of ``order`` (sorted already) with its header written through the dict of
    its entries: for a tensor named ``__metadata__``, which that dict's semantics decide."""
    slots: list[TensorSlot] = []
    offset = 0
    for name, dtype, shape in order:
        nbytes = math.prod(shape) * dtype.itemsize
        slots.append(TensorSlot(name, DTYPE_TO_ST[dtype], tuple(shape), offset, offset + nbytes))
        offset += nbytes
    entries: dict[str, Any] = {"__metadata__": dict(metadata)}
    for s in slots:
        entries[s.name] = {
            "dtype": s.dtype,
            "shape": list(s.shape),
            "data_offsets": [s.begin, s.end],
        }
    body = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    data_start = round_up(8 + len(body))
    try:
        check_header_length(data_start - 8)  # the length the shard declares, padding included
    except ValueError as e:
        raise _header_too_long(e, slots) from None
    padded = body + b" " * (data_start - 8 - len(body))
    return ShardLayout(struct.pack("<Q", len(padded)) + padded, tuple(slots), data_start, offset)


def _header_too_long(e: ValueError, slots: list[TensorSlot]) -> ValueError:
    """The ``ValueError`` of a state whose shard header is over the limit, naming its longest key path."""
    longest = max((s.name for s in slots), key=len)
    shown = longest if len(longest) <= 80 else f"{longest[:60]}...{longest[-12:]}"
    return ValueError(
        f"the shard header of this state ({len(slots):,} tensors, named by their key paths) would take more "
        f"than a reader accepts: {e}; the longest key path is {shown!r} ({len(longest):,} characters): "
        "shorten the key paths (tensor names take their length in the header) or save fewer, larger tensors"
    )


def plan_split_layout(
    first: list[tuple[str, torch.dtype, tuple[int, ...]]],
    rest: list[tuple[str, torch.dtype, tuple[int, ...]]],
    metadata: dict[str, str],
) -> tuple[ShardLayout, ShardLayout]:
    """A staging layout whose prefix is a shard of ``first`` alone: ``(staging, file)``.

    ``file`` is the shard of ``first`` (:func:`plan_layout`). ``staging`` has its header, its
    data start and its slots, followed by the slots of ``rest`` (each aligned to its element
    size), so an arena staged by ``staging`` holds ``file`` as its first ``file.file_size``
    bytes and the ``rest`` tensors after them. ``staging`` itself is not a valid shard (its
    header lists ``first`` only): only the arena is laid out by it.
    """
    file = plan_layout(first, metadata)
    slots = list(file.slots)
    offset = file.data_len
    for name, dtype, shape in sorted(rest, key=lambda s: (-s[1].itemsize, s[0])):
        offset = -(-offset // dtype.itemsize) * dtype.itemsize
        nbytes = math.prod(shape) * dtype.itemsize
        slots.append(TensorSlot(name, DTYPE_TO_ST[dtype], tuple(shape), offset, offset + nbytes))
        offset += nbytes
    return ShardLayout(file.header, tuple(slots), file.data_start, offset), file
