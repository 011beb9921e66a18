"""The shard header's fast path (``_header.parse_slots``, issue 32): a header in the form
``save()`` writes is read without building its dict, and every header, canonical or not,
valid or not, gives exactly what the general parse (``parse_header`` + ``validate_header``)
gives: the same slots and metadata, or a ``ValueError`` with the same message."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncckpt.format import _header
from asyncckpt.format._header import parse_header, parse_slots, validate_header
from asyncckpt.format._safetensors import plan_layout


def _general(head: bytes, file_size: int) -> tuple[Any, ...]:
    try:
        n, header = parse_header(head, file_size)
        slots = validate_header(header, file_size - 8 - n)
    except ValueError as e:
        return ("error", str(e))
    return (n, {k: header[k] for k in ("__metadata__",) if k in header}, slots)


def _fast(head: bytes, file_size: int) -> tuple[Any, ...]:
    try:
        return parse_slots(head, file_size)
    except ValueError as e:
        return ("error", str(e))


def _shard_head(body: bytes, data_len: int) -> tuple[bytes, int]:
    """A header of ``body`` padded as plan_layout pads it, and the file size with ``data_len``."""
    n = -(-(8 + len(body)) // 8) * 8 - 8
    padded = body + b" " * (n - len(body))
    return struct.pack("<Q", len(padded)) + padded, 8 + len(padded) + data_len


def _taken_fast(head: bytes, file_size: int, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether parse_slots answers without the general parse."""
    calls: list[int] = []
    real = _header.parse_header

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(_header, "parse_header", counted)
    parse_slots(head, file_size)
    monkeypatch.undo()
    return not calls


def test_a_header_save_writes_takes_the_fast_path_and_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    specs = [("a.w", torch.float32, (3, 4)), ("a.b", torch.bfloat16, (7,)), ("ü.é", torch.int64, ()),
             ("zero", torch.float16, (0, 5)), ("s p a c e", torch.uint8, (1, 1, 1))]  # fmt: skip
    layout = plan_layout(specs, {"format": "pt", "writer": "asyncckpt"})
    head, size = layout.header, layout.file_size
    assert _taken_fast(head, size, monkeypatch)
    assert _fast(head, size) == _general(head, size)
    _, meta, slots = parse_slots(head, size)
    assert meta == {"__metadata__": {"format": "pt", "writer": "asyncckpt"}}
    assert [s.name for s in slots] == [s.name for s in layout.slots]


def _entry(name: str, dtype: str = "F32", shape: str = "[2]", offs: str = "[0,8]") -> str:
    return f'{json.dumps(name)}:{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offs}}}'


META = '"__metadata__":{"format":"pt"}'

# (body, data_len): headers the fast path must hand to the general parse, or agree with
CASES = [
    ("{" + META + "," + _entry("a") + "}", 8),  # canonical
    ("{" + META + "," + _entry("a") + "," + _entry("a", offs="[8,16]") + "}", 16),  # duplicate name
    ("{" + META + "," + _entry("__metadata__") + "}", 8),  # an entry named like the metadata
    ("{" + META + "," + _entry('q"uote') + "}", 8),  # an escaped quote
    ("{" + META + "," + _entry("back\\slash") + "}", 8),  # an escaped backslash
    ("{" + META + "," + '"a\\u0041":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}' + "}", 8),  # \u escape
    ("{" + META + "," + _entry("a", shape="[02]") + "}", 8),  # a leading zero: not JSON
    ("{" + META + "," + _entry("a", shape="[-2]") + "}", 8),  # a negative dim
    ("{" + META + "," + _entry("a", offs="[0,9]") + "}", 9),  # size disagrees with the shape
    ("{" + META + "," + _entry("a", offs="[0,8]") + "}", 16),  # leaves a gap at the end
    ("{" + META + "," + _entry("a", offs="[8,16]") + "," + _entry("b", offs="[0,8]") + "}", 16),  # out of order
    ("{" + META + "," + _entry("a", offs="[0,8]") + "," + _entry("b", offs="[4,12]") + "}", 12),  # overlap
    ("{" + META + "," + _entry("a", dtype="F33") + "}", 8),  # unknown dtype
    ("{" + META + "," + _entry("a", dtype="I64", shape="[1]", offs="[4,12]") + "}", 12),  # misaligned
    ("{" + META + ", " + _entry("a") + "}", 8),  # whitespace inside
    (" {" + META + "," + _entry("a") + "}", 8),  # leading whitespace
    ("{" + _entry("a") + "}", 8),  # no metadata
    ("{" + _entry("a") + "," + META + "}", 8),  # metadata last
    ('{"__metadata__":{"k":"v","k":"w"},' + _entry("a") + "}", 8),  # a duplicate metadata key
    ('{"__metadata__":{"k":1},' + _entry("a") + "}", 8),  # a non-str metadata value
    ("{" + META + "," + _entry("a") + "}x", 8),  # trailing garbage
    ("{" + META + "," + _entry("a") + "}\t\n\r ", 8),  # trailing JSON whitespace
    ("{" + META + "," + _entry("a") + "", 8),  # unterminated
    ("{" + META + "," + _entry("a", shape="[" + ",".join(["1"] * 65) + "]", offs="[0,4]") + "}", 4),  # 65 dims
    ("{" + META + "," + _entry("a", shape="[99999999999999999999]", offs="[0,4]") + "}", 4),  # a huge dim
    ("{" + META + "," + _entry("a", shape="[4611686018427387904,2]", offs="[0,0]") + "}", 0),  # 2**63 bytes
    ("{" + META + "," + _entry("a", shape="[0]", offs="[0,0]") + "}", 0),  # empty tensor
    ("{" + META + "," + _entry("tab\there") + "}", 8),  # an escaped control char
    ("{" + META + "," + _entry("a", shape="[2]", offs="[0,8]").replace('"shape"', '"shape" ') + "}", 8),
    ("{" + META + "," + _entry("a").replace("}", ',"x":1}') + "}", 8),  # an extra key
    ("{" + META + "}", 0),  # no tensors
    ("{" + META + "}", 8),  # no tensors, data left
]


@pytest.mark.parametrize("chunk", [1 << 20, 1, 40])
@pytest.mark.parametrize(("body", "data_len"), CASES)
def test_every_header_gets_what_the_general_parse_gives(
    body: str, data_len: int, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_header, "_CHUNK", chunk)  # (the entries checked a chunk of text at a time)
    head, size = _shard_head(body.encode("utf-8"), data_len)
    assert _fast(head, size) == _general(head, size)


def _many(names: list[str]) -> str:
    return "{" + META + "".join("," + _entry(n, offs=f"[{8 * i},{8 * i + 8}]") for i, n in enumerate(names)) + "}"


@pytest.mark.parametrize("chunk", [1, 50, 120, 1000])
def test_a_header_checked_in_chunks_is_taken_whole_or_left_to_the_general_parse(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_header, "_CHUNK", chunk)
    names = [f"layer.{i}" for i in range(40)]
    head, size = _shard_head(_many(names).encode(), 8 * len(names))
    assert _taken_fast(head, size, monkeypatch) and _fast(head, size) == _general(head, size)
    monkeypatch.setattr(_header, "_CHUNK", chunk)
    # a name holding the text a chunk is cut after: still every entry, the fast path or not
    tricky = [*names[:20], "x]},", "]},", "z]},]},", *names[23:]]
    head, size = _shard_head(_many(tricky).encode(), 8 * len(tricky))
    assert _taken_fast(head, size, monkeypatch) and _fast(head, size) == _general(head, size)
    monkeypatch.setattr(_header, "_CHUNK", chunk)
    # text between two entries of a later chunk (valid JSON: whitespace; invalid: junk), a
    # duplicate name in another chunk, an offset that does not go on from the last chunk's
    body = _many(names)
    at = body.index(',"layer.31"')
    for bad in (body[:at] + " " + body[at:], body[:at] + "x" + body[at:], body.replace('"layer.35"', '"layer.2"'),
                body.replace("[248,256]", "[256,264]")):  # fmt: skip
        head, size = _shard_head(bad.encode(), 8 * len(names))
        assert _header._canonical(bad, 8 * len(names)) is None
        assert _fast(head, size) == _general(head, size)


def test_invalid_utf8_and_a_lone_surrogate_escape() -> None:
    for body in [b'{"__metadata__":{},"\xff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
                 b'{"__metadata__":{},"\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}']:  # fmt: skip
        head, size = _shard_head(body, 8)
        assert _fast(head, size) == _general(head, size)


_NAMES = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
_DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float64])
_SHAPES = st.lists(st.integers(0, 5), max_size=3).map(tuple)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_NAMES.filter(lambda n: n != "__metadata__"), st.tuples(_DTYPES, _SHAPES), max_size=6),
       st.dictionaries(_NAMES, _NAMES, max_size=3))  # fmt: skip
def test_written_headers_of_any_names_match_the_general_parse(specs: dict[str, Any], meta: dict[str, str]) -> None:
    layout = plan_layout([(n, d, s) for n, (d, s) in specs.items()], meta)
    head, size = layout.header, layout.file_size
    assert _fast(head, size) == _general(head, size)
    assert [tuple(s) for s in parse_slots(head, size)[2]] == [tuple(s) for s in layout.slots]
