"""The safetensors header, torch-free: byte sizes of its dtypes, parsing and validation.

A shard is ``[u64 little-endian N][N bytes JSON header][data]``. Everything here works on the
header's own names (``"F32"``, ``"BF16"``, ...) so that tools reading checkpoints (the CLI's
``ls``/``info``/``verify``) never import torch; ``_format`` maps the names to torch dtypes.
"""

from __future__ import annotations

import itertools
import json
import operator
import re
import sys
from typing import Any, NamedTuple

from ._bounds import check_json_memory, check_memory, json_memory
from ._gcpause import paused_gc

#: Alignment of the data section (and of O_DIRECT I/O).
ALIGN = 4096
#: Readers reject headers longer than this (:func:`declared_length`). 100 MiB: the limit this
#: format always had, so a shard an earlier version wrote up to it still loads.
MAX_HEADER = 100 * 1024 * 1024
#: No file asyncckpt writes (a shard by ``save()``, an ``export``) declares a longer header
#: (:func:`check_header_length`): the safetensors reference reader refuses one over
#: 100,000,000 bytes, and every file written must open with it. Below :data:`MAX_HEADER`, so
#: whatever ``save()`` accepts, ``load()`` restores.
SAFETENSORS_MAX_HEADER = 100_000_000
#: Tensors have at most this many dimensions (``save()`` refuses more, readers too).
MAX_DIMS = 64
#: A tensor's byte size must stay below this (with its 0 dims counted as 1), on both sides.
_TOO_LARGE = 2**63

#: Bytes per element of every safetensors dtype asyncckpt writes.
ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "F16": 2,
    "BF16": 2,
    "F32": 4,
    "F64": 8,
    "C64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}

#: The torch name of each dtype, for display without importing torch.
TORCH_NAME: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
}


def round_up(n: int, align: int = ALIGN) -> int:
    """The smallest multiple of ``align`` that is >= ``n``."""
    return -(-n // align) * align


class TensorSlot(NamedTuple):
    """Where one tensor lives in a shard: offsets are relative to the data section.

    ``dtype`` is the safetensors name (``"F32"``); ``_format.ST_TO_DTYPE`` maps it to torch.
    (A tuple: one is made per tensor of every shard read, ~4x cheaper than a frozen dataclass.)
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def shape_bytes(shape: list[int] | tuple[int, ...], itemsize: int) -> int:
    """The byte size of a tensor of ``shape`` whose elements take ``itemsize`` bytes.

    The one rule of what a shape may be, for the writer (``_format.plan_layout``) and the
    reader (:func:`validate_header`): at most :data:`MAX_DIMS` dimensions, each an ``int`` >= 0
    (``bool`` is not), and a byte size below 2**63 even with every 0 dim counted as 1 (a
    tensor of 0 elements may not declare ``[0, 2**62]``). ``ValueError`` saying which otherwise.
    """
    if len(shape) > MAX_DIMS:
        raise ValueError(f"{len(shape)} dimensions; a checkpoint holds at most {MAX_DIMS}")
    # runs once per tensor of every shard read: a plain loop over the few dims
    numel, nonzero = 1, itemsize  # nonzero: the byte size with every 0 dim counted as 1
    for d in shape:
        if type(d) is not int or d < 0:  # type() is int: bool and int subclasses are not dims
            raise ValueError(f"a dimension {d!r} that is not an int >= 0")
        numel *= d
        if d:
            nonzero *= d
    if nonzero >= _TOO_LARGE:
        raise ValueError(f"a shape {list(shape)} of 2**63 bytes or more (its 0 dims counted as 1): no reader takes it")
    return numel * itemsize


def check_header_length(n: int) -> None:
    """``ValueError`` if a file to be written would declare a header of ``n`` bytes (padding
    included) longer than safetensors readers take (:data:`SAFETENSORS_MAX_HEADER`; never
    over :data:`MAX_HEADER`, what our own readers take)."""
    limit = min(MAX_HEADER, SAFETENSORS_MAX_HEADER)  # looked up at the call: one rule, patched in tests
    if n > limit:
        raise ValueError(f"header of {n:,} bytes exceeds the {limit:,}-byte limit of safetensors readers")


def declared_length(prefix: bytes, file_size: int, where: str = "<shard>") -> int:
    """The header length a shard of ``file_size`` bytes declares in its first 8 bytes.

    ``ValueError`` when the file is too short, when the length exceeds :data:`MAX_HEADER` or
    when it does not fit the file, saying which;
    ``CheckpointError`` naming ``where`` when even the cheapest parse of that many bytes
    would not fit the memory available now (checked before they are read).
    """
    if file_size < 8 or len(prefix) < 8:
        raise ValueError("file too short for a safetensors header")
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER:
        raise ValueError(f"declared header of {n:,} bytes exceeds the {MAX_HEADER:,}-byte ({MAX_HEADER >> 20} MiB) "
                         "limit")  # fmt: skip
    if n > file_size - 8:
        raise ValueError(f"declared header length {n} does not fit the file ({file_size} bytes)")
    check_memory(json_memory(n, 0), "reading the shard header", where)
    return n


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # dict() in C, then a length check: a Python loop here was 8 us per object (80 ms of a
    # 10,000-tensor header); the loop only runs to name the duplicate
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r} in header")
            seen.add(k)
    return out


_ENTRY_KEYS = {"dtype": 0, "shape": 0, "data_offsets": 0}.keys()


def parse_header(prefix: bytes, file_size: int, where: str = "<shard>") -> tuple[int, dict[str, Any]]:
    """Parse the length prefix and header given the first bytes of a shard.

    ``prefix`` must hold at least 8 bytes; returns ``(N, raw header dict)``. Raises
    ``ValueError`` if the declared length exceeds the limit or does not fit in ``file_size``
    (:func:`declared_length`), and ``CheckpointError`` naming ``where`` if parsing it would
    not fit the memory available now (checked on its byte counts, before parsing: a header
    holds as many tensors as its bytes do, at least ~50 bytes each).
    """
    n = declared_length(prefix, file_size, where)
    if len(prefix) < 8 + n:
        raise ValueError("header truncated")
    text = prefix[8 : 8 + n]
    check_json_memory(text, "parsing the shard header", where)
    try:
        with paused_gc():  # one dict, str and two lists per tensor: 3x faster for 600k tensors
            header = json.loads(text.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except MemoryError:
        raise ValueError("header too large to parse in the memory available") from None
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
    keys = _ENTRY_KEYS
    # this loop runs once per tensor of every shard read (10,000 for a state of many small
    # tensors): plain loops over the few dims, no generator or dataclass per entry
    pos, in_order = 0, True
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if type(entry) is not dict or entry.keys() != keys:
            raise ValueError(f"malformed header entry for {name!r}")
        dtype = entry["dtype"]
        size = ITEMSIZE.get(dtype) if type(dtype) is str else None
        if size is None:
            raise ValueError(f"unknown dtype {dtype!r} for {name!r}")
        shape = entry["shape"]
        if type(shape) is not list:
            raise ValueError(f"malformed shape for {name!r}")
        try:
            nbytes = shape_bytes(shape, size)
        except ValueError as e:
            raise ValueError(f"malformed shape for {name!r}: {e}") from None
        offs = entry["data_offsets"]
        if type(offs) is not list or len(offs) != 2:
            raise ValueError(f"malformed data_offsets for {name!r}")
        begin, end = offs
        if type(begin) is not int or type(end) is not int or begin < 0 or end < 0:
            raise ValueError(f"malformed data_offsets for {name!r}")
        if not begin <= end <= data_len:
            raise ValueError(f"offsets of {name!r} fall outside the data section")
        if nbytes != end - begin:
            raise ValueError(f"size of {name!r} does not match its shape and dtype")
        if begin % size:
            raise ValueError(f"{name!r} is not aligned to its element size")
        if begin != pos:
            in_order = False
        pos = end
        slots.append(TensorSlot(name, dtype, tuple(shape), begin, end))
    if not in_order:  # (files asyncckpt writes list their tensors in file order)
        pos = 0
        for s in sorted(slots, key=lambda s: (s.begin, s.end)):
            if s.begin != pos:
                raise ValueError(f"tensor {s.name!r} overlaps or leaves a gap at offset {pos}")
            pos = s.end
    if pos != data_len:
        raise ValueError(f"tensors cover {pos} bytes of a {data_len}-byte data section")
    return slots


# ---------------------------------------------------------------------- the canonical header, fast
# What plan_layout writes: compact JSON, "__metadata__" first, then one entry per tensor in file
# order with its keys in this order, names without escapes, then the space padding.
# Possessive quantifiers (``*+``, Python 3.11+): no character a quantifier takes can start what
# follows it, so no backtracking is lost (the same texts match) and the engine keeps no
# backtracking state: ~25 % faster. (3.10 has none: the plain ones, the same texts.)
_P = "+" if sys.version_info >= (3, 11) else ""
_STR = r'"[^"\\\x00-\x1f]*' + _P + '"'
_INT = r"(?:0|[1-9][0-9]{0,17}" + _P + ")"
_META = re.compile(r'\{"__metadata__":(\{(?:' + _STR + ":" + _STR + "(?:," + _STR + ":" + _STR + r")*)?\})")
_ENTRY = re.compile(
    r',"([^"\\\x00-\x1f]*' + _P + r')":\{"dtype":"([A-Z0-9_]{1,8}' + _P + r')","shape":\[((?:' + _INT + "(?:,"
    + _INT + r")*" + _P + r')?)\],"data_offsets":\[(' + _INT + "),(" + _INT + r")\]\}"
)
_CANON = {k: k for k in ITEMSIZE}


def _canonical(text: str, data_len: int) -> tuple[dict[str, Any], list[TensorSlot]] | None:
    """The ``__metadata__`` entry and the slots of a header in the form ``save()`` writes it
    and that :func:`validate_header` accepts, without building the header's dict (~0.5 KB a
    tensor, the peak of a load of many small tensors); ``None`` for any other text, valid or
    not, which then takes the general parse (and its error messages). Only text that
    ``json.loads`` would read as exactly these entries is taken: no escapes, no duplicate name,
    no whitespace but the trailing padding.

    The entries are found :data:`_CHUNK` characters of text at a time by ``findall`` and checked
    a list at a time at C speed (issue 32: the match loop was ~3 us a tensor): a chunk is taken
    only when its entries' texts, end to end, are the whole chunk (nothing skipped between them),
    each entry's offsets start where the previous one's end, its size is its shape's and it is
    aligned to its element size."""
    m = _META.match(text)
    if m is None:
        return None
    meta = json.loads(m.group(1), object_pairs_hook=_reject_duplicates)
    stop = len(text.rstrip(" \t\n\r")) - 1  # the header object's closing brace
    if stop < m.end() or text[stop] != "}":
        return None
    slots: list[TensorSlot] = []
    names: set[str] = set()
    # one tuple per distinct shape (a state of many tensors has few: ~60 bytes a tensor less)
    shapes: dict[str, tuple[tuple[int, ...], int]] = {}
    pos, at = 0, m.end()
    findall = _ENTRY.findall
    while at < stop:
        cut = text.find(_ENTRY_END, at + _CHUNK, stop) if stop - at > _CHUNK else -1
        cut = stop if cut < 0 else cut + 2  # (after an entry's "]}")
        found = findall(text, at, cut)
        chunk = _chunk_slots(found, cut - at, pos, shapes) if found else None
        if chunk is None and cut != stop:  # (cut inside a name holding "]},": the rest at once)
            cut = stop
            found = findall(text, at, cut)
            chunk = _chunk_slots(found, cut - at, pos, shapes) if found else None
        if chunk is None:
            return None
        names.update(map(_NAME, found))
        if len(names) != len(slots) + len(chunk):
            return None  # a duplicate key: json.loads' hook names it
        slots += chunk
        pos, at = chunk[-1].end, cut
    if pos != data_len or "__metadata__" in names:
        return None
    return ({"__metadata__": meta}, slots)


#: The text around an entry's fields (name, dtype, dims, begin, end): the entry's length less theirs.
_ENTRY_FIXED = len(',"":{"dtype":"","shape":[],"data_offsets":[,]}')
_ENTRY_END = ']},"'
_NAME = operator.itemgetter(0)
_LARGEST_ITEM = max(ITEMSIZE.values())
#: Characters of header text checked at once by :func:`_canonical` (~10,000 entries).
_CHUNK = 1 << 20


def _chunk_slots(
    found: list[tuple[str, str, str, str, str]], length: int, pos: int, shapes: dict[str, tuple[tuple[int, ...], int]]
) -> list[TensorSlot] | None:
    """The slots of ``found`` (``_ENTRY``'s groups of one chunk of ``length`` characters, the first
    entry's offset at ``pos``), or ``None`` unless they tile the chunk and each other as
    :func:`_canonical` says. ``shapes``: each dims text's shape and element count, kept across chunks."""
    names, dtypes, dims, begins, ends = zip(*found, strict=True)
    if sum(map(len, itertools.chain(names, dtypes, dims, begins, ends))) + _ENTRY_FIXED * len(found) != length:
        return None  # some text between two entries, which findall skipped
    canon: list[str] = list(map(_CANON.get, dtypes))  # type: ignore[arg-type]  # (None: checked next)
    if None in canon:  # (an unknown dtype; each known one is one str object: ~50 bytes a tensor less)
        return None
    for d in set(dims).difference(shapes):  # (few: one per distinct shape)
        shape = tuple(map(int, d.split(","))) if d else ()
        try:
            shape_bytes(shape, _LARGEST_ITEM)  # (a shape only a smaller element allows: the general path)
        except ValueError:
            return None
        numel = 1
        for n in shape:
            numel *= n
        shapes[d] = (shape, numel)
    facts = list(map(shapes.__getitem__, dims))
    sizes = list(map(ITEMSIZE.__getitem__, canon))
    b = list(map(int, begins))
    e = list(map(int, ends))
    if b[0] != pos or b[1:] != e[:-1]:
        return None  # (out of file order included: the general check then decides)
    if list(map(operator.sub, e, b)) != list(map(operator.mul, map(operator.itemgetter(1), facts), sizes)):
        return None
    if any(map(operator.mod, b, sizes)):
        return None
    b[1:] = e[:-1]  # (each begin the previous end's int: one int object less a tensor)
    return list(map(tuple.__new__, itertools.repeat(TensorSlot),
                    zip(names, canon, map(operator.itemgetter(0), facts), b, e, strict=True)))  # fmt: skip


def _decoded(head: bytes, n: int) -> str:
    """The header text of ``head`` as a str, without a copy of its bytes first."""
    with memoryview(head) as view:
        return str(view[8 : 8 + n], "utf-8")


def parse_slots(head: bytes, file_size: int, where: str = "<shard>") -> tuple[int, dict[str, Any], list[TensorSlot]]:
    """:func:`parse_header` and :func:`validate_header` in one: ``(N, {"__metadata__": ...}
    or {}, slots)`` of a shard whose first bytes are ``head`` (at least ``8 + N``). The same
    results and errors as the two, a header in ``save()``'s own form taking a fast path."""
    n = declared_length(head, file_size, where)
    if len(head) < 8 + n:
        raise ValueError("header truncated")
    data_len = file_size - 8 - n
    # (no copy of the text's bytes lives on: ~100 bytes a tensor less at the peak of the parse)
    check_json_memory(head[8 : 8 + n], "parsing the shard header", where)
    try:
        fast = _canonical(_decoded(head, n), data_len)
    except (UnicodeDecodeError, ValueError, RecursionError, MemoryError):
        fast = None  # the general parse raises what it raises (memory included, as a ValueError)
    if fast is not None:
        return (n, *fast)
    _, header = parse_header(head, file_size, where)
    slots = validate_header(header, data_len)
    return n, {k: header[k] for k in ("__metadata__",) if k in header}, slots
