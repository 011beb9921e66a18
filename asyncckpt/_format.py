"""The safetensors file format: lay out a shard, build its header, validate one read back.

A shard is ``[u64 little-endian N][N bytes JSON header][data]``. We pad the header with
spaces so the data section starts on a 4096-byte boundary (readers accept trailing header
whitespace), which lets the whole file be written with O_DIRECT straight from the staging
buffer. Tensors are ordered by descending element size, then name, so every tensor starts
aligned to its element size and can be viewed without a copy on load.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import torch

#: Alignment of the data section (and of O_DIRECT I/O).
ALIGN = 4096
#: Readers reject headers larger than this (the safetensors reference limit).
MAX_HEADER = 100 * 1024 * 1024

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


def round_up(n: int, align: int = ALIGN) -> int:
    """The smallest multiple of ``align`` that is >= ``n``."""
    return -(-n // align) * align


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in a shard: offsets are relative to the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


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
    """Lay out tensors ``(name, dtype, shape)`` into one safetensors shard."""
    order = sorted(specs, key=lambda s: (-s[1].itemsize, s[0]))
    slots: list[TensorSlot] = []
    offset = 0
    for name, dtype, shape in order:
        nbytes = math.prod(shape) * dtype.itemsize
        slots.append(TensorSlot(name, dtype, tuple(shape), offset, offset + nbytes))
        offset += nbytes
    entries: dict[str, Any] = {"__metadata__": dict(metadata)}
    for s in slots:
        entries[s.name] = {
            "dtype": DTYPE_TO_ST[s.dtype],
            "shape": list(s.shape),
            "data_offsets": [s.begin, s.end],
        }
    body = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    data_start = round_up(8 + len(body))
    padded = body + b" " * (data_start - 8 - len(body))
    return ShardLayout(struct.pack("<Q", len(padded)) + padded, tuple(slots), data_start, offset)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r} in header")
        out[k] = v
    return out


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def parse_header(prefix: bytes, file_size: int) -> tuple[int, dict[str, Any]]:
    """Parse the length prefix and header given the first bytes of a shard.

    ``prefix`` must hold at least 8 bytes; returns ``(N, raw header dict)``. Raises
    ``ValueError`` if the declared length does not fit in ``file_size``.
    """
    if file_size < 8 or len(prefix) < 8:
        raise ValueError("file too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER or n > file_size - 8:
        raise ValueError(f"declared header length {n} exceeds the file ({file_size} bytes)")
    if len(prefix) < 8 + n:
        raise ValueError("header truncated")
    header = json.loads(prefix[8 : 8 + n].decode("utf-8"), object_pairs_hook=_reject_duplicates)
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return n, header


def validate_header(header: dict[str, Any], data_len: int) -> list[TensorSlot]:
    """Check a parsed header against the data section length; return its slots.

    Every tensor must have a known dtype, a shape whose byte size matches its offsets, and
    the tensors must tile the data section exactly (no gaps, no overlap). Raises
    ``ValueError`` otherwise.
    """
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("__metadata__ must map str to str")
    slots: list[TensorSlot] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"malformed header entry for {name!r}")
        dtype = ST_TO_DTYPE.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        shape, offs = entry["shape"], entry["data_offsets"]
        if dtype is None:
            raise ValueError(f"unknown dtype {entry['dtype']!r} for {name!r}")
        if not (isinstance(shape, list) and all(_int(d) for d in shape) and len(shape) <= 64):
            raise ValueError(f"malformed shape for {name!r}")
        if math.prod(max(d, 1) for d in shape) * dtype.itemsize >= 2**63:
            raise ValueError(f"shape of {name!r} is too large")  # even when one dim is 0
        if not (isinstance(offs, list) and len(offs) == 2 and all(_int(o) for o in offs)):
            raise ValueError(f"malformed data_offsets for {name!r}")
        begin, end = offs
        if not begin <= end <= data_len:
            raise ValueError(f"offsets of {name!r} fall outside the data section")
        if math.prod(shape) * dtype.itemsize != end - begin:
            raise ValueError(f"size of {name!r} does not match its shape and dtype")
        if begin % dtype.itemsize:
            raise ValueError(f"{name!r} is not aligned to its element size")
        slots.append(TensorSlot(name, dtype, tuple(shape), begin, end))
    pos = 0
    for s in sorted(slots, key=lambda s: (s.begin, s.end)):
        if s.begin != pos:
            raise ValueError(f"tensor {s.name!r} overlaps or leaves a gap at offset {pos}")
        pos = s.end
    if pos != data_len:
        raise ValueError(f"tensors cover {pos} bytes of a {data_len}-byte data section")
    return slots
