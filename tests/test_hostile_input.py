"""Hostile checkpoints: whatever sits on disk, reading it fails cleanly and stays inside.

Property-based (hypothesis) and corpus fuzzing of everything the loader parses: the
safetensors length prefix and header, ``manifest.json`` (re-sealed so the logic behind its
CRC-32C seal is reached), the structure file ``rankRRRRR.json``; plus symlinks out of the
checkpoint, pickles dropped in, and tensor keys that look like paths. Properties:

* ``find_latest`` / ``complete_checkpoints`` never raise, and ``load(root, step)`` raises
  nothing but ``CheckpointError`` subclasses (no IndexError, RuntimeError, MemoryError,
  RecursionError, UnicodeError, OverflowError, ...);
* nothing outside the checkpoint directory is opened (every ``os.open`` is watched and its
  inode compared with the files planted outside);
* memory stays bounded: a successful load holds no more tensor bytes than the shard has,
  and under an address-space limit of +1 GiB hostile declared sizes fail fast;
* nothing is unpickled.

To get past the per-file CRCs of the manifest, a mutated file is written together with a
manifest re-sealed with its real size and CRC-32C (``Work.put``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import pickle
import resource
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncckpt import CheckpointCorruptError, Checkpointer, CheckpointError, CheckpointNotFoundError, find_latest, load
from asyncckpt.format._checksum import crc32c
from asyncckpt.format._header import MAX_HEADER
from asyncckpt.format._manifest import MANIFEST, FileEntry, decode, encode
from asyncckpt.format._safetensors import ST_TO_DTYPE
from asyncckpt.reading import complete_checkpoints

STEP2 = "step_00000002"
SHARD, TREE = "rank00000.safetensors", "rank00000.json"
FUZZ = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "l1.weight": torch.randn(4, 5, generator=g),
            "l1.bias": torch.randn(5, generator=g),
            "emb": torch.randn(3, 2, generator=g).to(torch.bfloat16),
        },
        "opt": {
            "state": {0: {"exp_avg": torch.randn(5, generator=g), "step": torch.tensor(3)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}],
        },
        "rng": torch.arange(6, dtype=torch.uint8),
        "extra": {"nan": float("nan"), "inf": float("-inf"), "blob": b"\x00\x01", "none": None, "flag": True},
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with two real checkpoints (steps 1 and 2) that every example copies."""
    root = tmp_path_factory.mktemp("hostile") / "ck"
    with Checkpointer(root) as ck:
        ck.save(1, state(1)).result(timeout=60)
        ck.save(2, state(2)).result(timeout=60)
    return root


@pytest.fixture(scope="module")
def shared(pristine: Path) -> Iterator[Work]:
    """One work copy for all examples of a fuzz test; each example starts with ``reset()``."""
    with Work(pristine) as w:
        yield w


def seal(body: dict[str, Any]) -> bytes:
    """Seal a manifest body the way ``decode`` checks it (CRC-32C of the canonical JSON)."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return (
        json.dumps(dict(body, checksum=crc32c(canonical)), sort_keys=True, indent=1, ensure_ascii=True).encode() + b"\n"
    )


class Work:
    """A private copy of the pristine root; ``outside`` is a directory next to it, not under it."""

    def __init__(self, pristine: Path) -> None:
        self.base = Path(tempfile.mkdtemp(dir=pristine.parent, prefix="work-"))
        self.root = self.base / "ck"
        shutil.copytree(pristine, self.root, symlinks=True)
        self.step_dir = self.root / STEP2
        self.outside = self.base / "outside"
        self.outside.mkdir()
        # copies of the real files outside: following a symlink to them would "work"
        for name in (SHARD, TREE, MANIFEST):
            shutil.copy(self.step_dir / name, self.outside / name)
        (self.outside / "sentinel").write_bytes(b"SECRET")
        self.forbidden = {(st_.st_dev, st_.st_ino) for st_ in (p.stat() for p in self.outside.iterdir())}
        self.pristine = {p.name: p.read_bytes() for p in self.step_dir.iterdir()}

    def reset(self) -> Work:
        """Put step 2 back as it was (cheaper than a new copy for every example)."""
        sd = self.step_dir
        if sd.is_symlink() or not sd.is_dir():
            sd.unlink()
        sd.mkdir(exist_ok=True)
        for p in sd.iterdir():
            if p.name not in self.pristine or p.is_symlink() or not p.is_file():
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        for name, data in self.pristine.items():
            (sd / name).write_bytes(data)
        return self

    def __enter__(self) -> Work:
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.base, ignore_errors=True)

    def body(self) -> dict[str, Any]:
        doc = json.loads((self.step_dir / MANIFEST).read_bytes())
        doc.pop("checksum")
        return dict(doc)

    def put(self, name: str, data: bytes, reseal: bool = True) -> None:
        """Write ``data`` as ``name`` in step 2 and (by default) re-seal the manifest with its size and CRC."""
        (self.step_dir / name).write_bytes(data)
        if reseal:
            m = decode((self.step_dir / MANIFEST).read_bytes(), "")
            files = [f for f in m.files if f.name != name] + [FileEntry(name, len(data), crc32c(data), 0)]
            blob = encode(m.step, m.attempt, m.world_size, m.nbytes, m.created, files, m.extra)
            (self.step_dir / MANIFEST).write_bytes(blob)


@contextlib.contextmanager
def watched(work: Work) -> Iterator[list[str]]:
    """Record every path opened; fail if a file planted outside the root is ever opened."""
    real_open = os.open
    seen: list[str] = []
    bad: list[str] = []

    def spy(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        fd = real_open(path, flags, mode, dir_fd=dir_fd)
        st_ = os.fstat(fd)
        seen.append(os.fspath(path))
        if (st_.st_dev, st_.st_ino) in work.forbidden:
            bad.append(os.fspath(path))
        return fd

    with mock.patch.object(os, "open", spy):
        yield seen
    assert not bad, f"read outside the checkpoint: {bad}"


def probe(work: Work, step: int = 2) -> Any:
    """Everything a reader does; only CheckpointError may come out. Returns the loaded state or None."""
    with watched(work):
        info = find_latest(work.root)
        assert info is not None and info.step in (1, 2), info  # step 1 is intact
        assert [i.step for i in complete_checkpoints(work.root)] in ([1], [1, 2])
        try:
            loaded = load(work.root, step)  # load(root) is this or the intact step 1
        except CheckpointError:
            loaded = None
    return loaded


def test_pristine_round_trip_and_seal_helper(pristine: Path) -> None:
    with Work(pristine) as w:
        assert seal(w.body()) == (w.step_dir / MANIFEST).read_bytes()  # our sealer is the library's
        assert_same(probe(w), state(2))
        w.put(TREE, (w.step_dir / TREE).read_bytes())  # re-sealing unchanged content keeps it loadable
        assert_same(probe(w), state(2))


# --------------------------------------------------------------------------- the safetensors header

DTYPES = sorted(ST_TO_DTYPE)
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 2**70),
    st.sampled_from([2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 10**30, 10**400, -(2**63)]),
    st.integers(0, 600).map(lambda e: 10**e),  # beyond int64 and beyond float range
    st.text(max_size=4),
    # fresh containers each draw: st.just([]) hands out one shared object, which a mutation
    # below could then put inside itself (json.dumps: "Circular reference detected")
    st.builds(list),
    st.builds(dict),
    st.lists(st.integers(-3, 3), max_size=3),
)
dims = st.one_of(st.integers(0, 6), st.integers(0, 2**70), st.integers(-3, -1), junk)
zero_dims = st.one_of(st.integers(0, 8), st.sampled_from([2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64, 10**30]))
names = st.one_of(
    st.sampled_from(["w", "a.b", "../../evil", "/abs", "", "__metadata__", "x" * 300, "\u00e9", "\ud800"]),
    st.text(max_size=6),
)


@st.composite
def shards(draw: st.DrawFn) -> tuple[bytes, list[str]]:
    """A shard: mostly well-formed entries, then a few hostile mutations at every level."""
    header: dict[str, Any] = {}
    pos = 0
    for name in draw(st.lists(names, max_size=4, unique=True)):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        nbytes = math.prod(shape) * ST_TO_DTYPE[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    data_len = pos
    keys = [k for k in header if k != "__metadata__"]
    for _ in range(draw(st.integers(0, 3))):
        what = draw(
            st.sampled_from(["dtype", "shape", "dim", "zero", "offsets", "shift", "keys", "entry", "meta", "len"])
        )
        if what == "len":
            data_len = max(0, data_len + draw(st.integers(-9, 9)))
            continue
        if what == "meta":
            header["__metadata__"] = draw(st.one_of(junk, st.dictionaries(st.text(max_size=3), junk, max_size=2)))
            continue
        if not keys:
            continue
        k = draw(st.sampled_from(keys))
        e = header[k]
        if not isinstance(e, dict):
            continue
        if what == "dtype":
            e["dtype"] = draw(st.one_of(st.sampled_from(DTYPES), st.sampled_from(["F33", "f32", "", "I128"]), junk))
        elif what == "shape":
            e["shape"] = draw(st.one_of(st.lists(dims, max_size=66), junk))
        elif what == "zero":  # no elements, so no bytes: only the dims themselves can be hostile
            e["shape"] = [*draw(st.lists(zero_dims, min_size=1, max_size=5)), 0]
            e["data_offsets"] = [0, 0]
        elif what == "dim" and isinstance(e.get("shape"), list) and e["shape"]:
            e["shape"][draw(st.integers(0, len(e["shape"]) - 1))] = draw(dims)
        elif what == "offsets":
            e["data_offsets"] = draw(st.one_of(st.lists(dims, max_size=3), junk))
        elif what == "shift" and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2:
            d = draw(st.integers(-8, 8))  # overlaps, gaps, misalignment
            e["data_offsets"] = [o + d if isinstance(o, int) else o for o in e["data_offsets"]]
        elif what == "keys":
            if draw(st.booleans()):
                e.pop(draw(st.sampled_from(sorted(e))), None)
            else:
                e[draw(st.sampled_from(["extra", "dtype2", "shape "]))] = draw(junk)
        elif what == "entry":
            header[k] = draw(junk)
    text = json.dumps(header, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    # hostile framing in 40% of the examples; the others reach the entry checks and the allocation
    framing = draw(st.integers(0, 9)) < 4
    byte_level = draw(st.sampled_from(["dup", "deep", "utf8", "cut", "bigint", "nan", "none"])) if framing else "none"
    if byte_level == "dup" and keys:
        first = json.dumps({keys[0]: header[keys[0]]})[1:-1].encode("utf-8", "surrogatepass")
        text = b"{" + first + b"," + text[1:] if len(text) > 2 else text
    elif byte_level == "deep":
        depth = draw(st.integers(100, 5000))
        text = b'{"x":' + b"[" * depth + b"]" * depth + b"}"
    elif byte_level == "utf8":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"])) + text[at:]
    elif byte_level == "cut":
        text = text[: draw(st.integers(0, len(text)))]
    elif byte_level == "bigint":
        text = b'{"w":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,0]}}'
    elif byte_level == "nan":
        text = b'{"w":{"dtype":"F32","shape":[NaN],"data_offsets":[0,Infinity]}}'
    if not framing or draw(st.booleans()):
        text += b" " * (-(8 + len(text)) % 8)  # what a writer does: 8-byte aligned data
    n = draw(st.sampled_from(["exact", "huge", "max", "over", "under", "zero", "file"])) if framing else "exact"
    declared = {
        "exact": len(text),
        "huge": 2**64 - 1,
        "max": MAX_HEADER + 1,
        "over": len(text) + 1,
        "under": max(0, len(text) - 1),
        "zero": 0,
        "file": len(text) + data_len,
    }[n]
    data = draw(st.binary(min_size=min(data_len, 4096), max_size=min(data_len, 4096)))
    prefix = struct.pack("<Q", declared)[: draw(st.sampled_from([8, 8, 8, 3])) if framing else 8]
    return prefix + text + data, [k for k in keys if isinstance(k, str)]


@FUZZ
@given(shards())
def test_fuzzed_shard_headers_fail_cleanly(shared: Work, shard: tuple[bytes, list[str]]) -> None:
    blob, tensor_names = shard
    w = shared.reset()
    w.put(SHARD, blob)
    # a structure naming exactly the shard's tensors, so a header that passes reaches the allocation
    tree = {"$dict": [[k, {"$tensor": k}] for k in tensor_names]}
    w.put(TREE, json.dumps(tree).encode("utf-8", "surrogatepass"))
    loaded = probe(w)
    if loaded is not None:
        assert sum(t.numel() * t.element_size() for t in loaded.values()) <= len(blob)


@FUZZ
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.one_of(zero_dims, dims), max_size=8),
    empty=st.booleans(),
    lie=st.integers(-2, 2),
)
def test_fuzzed_shapes_of_one_tensor_fail_cleanly(
    shared: Work, dtype: str, shape: list[Any], empty: bool, lie: int
) -> None:
    """A well-framed shard with one tensor: every hostile shape reaches the validator and the allocation."""
    w = shared.reset()
    if empty:  # no elements: only the dims themselves are hostile
        shape = [*shape, 0]
    ok_dims = all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    nbytes = math.prod(shape) * ST_TO_DTYPE[dtype].itemsize if ok_dims else 16
    size = nbytes if nbytes <= 4096 else 16  # the data really there; beyond it the offsets lie
    header = {"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, max(0, size + lie)]}}
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    blob = struct.pack("<Q", len(text)) + text + bytes(size)
    w.put(SHARD, blob)
    w.put(TREE, b'{"$dict":[["w",{"$tensor":"w"}]]}')
    loaded = probe(w)
    if loaded is not None:
        assert list(loaded["w"].shape) == shape and loaded["w"].numel() * loaded["w"].element_size() <= size


# --------------------------------------------------------------------------- the manifest

bad_names = st.sampled_from([
    "../" + TREE, "../../outside/" + TREE, "/etc/passwd", "/", ".", "..", "", "a/b", TREE + "/..", TREE + "\x00",
    MANIFEST, " " + TREE, TREE.upper(), "x" * 200, "\u00fcnicode", "-rf", ".hidden", "rank00000.pt",
])  # fmt: skip


@st.composite
def manifest_bodies(draw: st.DrawFn, body: dict[str, Any], outside: str) -> dict[str, Any]:
    body = json.loads(json.dumps(body))
    for _ in range(draw(st.integers(1, 4))):
        what = draw(st.sampled_from(["name", "abs", "size", "crc", "rank", "fkey", "dup", "drop", "files", "top",
                                     "topdel", "topadd"]))  # fmt: skip
        files = body.get("files")
        entry = draw(st.sampled_from(files)) if isinstance(files, list) and files else None
        if what == "name" and isinstance(entry, dict):
            entry["name"] = draw(st.one_of(bad_names, junk))
        elif what == "abs" and isinstance(entry, dict):
            entry["name"] = os.path.join(outside, TREE)
        elif what in ("size", "crc", "rank") and isinstance(entry, dict):
            key = {"size": "size", "crc": "crc32c", "rank": "rank"}[what]
            old = entry.get(key, 0)
            near = (old if isinstance(old, int) else 0) + draw(st.integers(-2, 2))
            entry[key] = draw(st.one_of(junk, st.sampled_from([2**64, 2**63 - 1, 10**30, -1, near])))
        elif what == "fkey" and isinstance(entry, dict):
            if draw(st.booleans()) and entry:
                entry.pop(draw(st.sampled_from(sorted(entry))))
            else:
                entry["extra"] = draw(junk)
        elif what == "dup" and isinstance(entry, dict) and isinstance(files, list):
            files.append(dict(entry))
        elif what == "drop" and isinstance(files, list) and files:
            files.pop(draw(st.integers(0, len(files) - 1)))
        elif what == "files":
            body["files"] = draw(
                st.one_of(junk, st.lists(junk, max_size=3), st.dictionaries(st.text(max_size=3), junk))
            )
        elif what == "top":
            key = draw(st.sampled_from(["step", "world_size", "nbytes", "attempt", "created", "extra", "format"]))
            body[key] = draw(st.one_of(junk, st.sampled_from([2, 0, 2**64, 10**30, -2, 1.5, "2", "asyncckpt/2"])))
        elif what == "topdel":
            body.pop(draw(st.sampled_from(sorted(body))), None)
        elif what == "topadd":
            body[draw(st.sampled_from(["checksum2", "x", "__proto__"]))] = draw(junk)
    return body


@FUZZ
@given(st.data())
def test_fuzzed_manifests_fail_cleanly(shared: Work, data: st.DataObject) -> None:
    w = shared.reset()
    body = data.draw(manifest_bodies(w.body(), str(w.outside)))
    how = data.draw(st.sampled_from(["sealed"] * 5 + ["unsealed", "wrong", "compact", "dupkey"]))
    blob = seal(body)
    if how == "unsealed":
        blob = json.dumps(body, sort_keys=True, indent=1).encode() + b"\n"
    elif how == "wrong":
        doc = json.loads(blob)
        doc["checksum"] = (doc["checksum"] + 1) % 2**32
        blob = json.dumps(doc, sort_keys=True, indent=1).encode() + b"\n"
    elif how == "compact":  # right seal, not the canonical layout
        blob = json.dumps(json.loads(blob), separators=(",", ":")).encode()
    elif how == "dupkey":  # a second "step" key: parsers disagree on which one wins
        blob = blob.replace(b"{\n", b'{\n "step": 1,\n', 1)
    (w.step_dir / MANIFEST).write_bytes(blob)
    loaded = probe(w)
    if loaded is not None:
        assert_same(loaded, state(2))  # a manifest that passes still only yields the real data


MANIFEST_FIELDS = ["step", "world_size", "nbytes", "attempt", "created", "extra", "format", "files", "run"]
ENTRY_FIELDS = ["name", "size", "crc32c", "rank"]


@FUZZ
@given(data=st.data(), field=st.sampled_from(MANIFEST_FIELDS + ENTRY_FIELDS))
def test_fuzzed_manifest_fields_fail_cleanly(shared: Work, data: st.DataObject, field: str) -> None:
    """One field hostile, everything else intact and the seal right: every check behind the seal is reached."""
    w = shared.reset()
    body = w.body()
    value = data.draw(st.one_of(junk, bad_names, st.integers(0, 600).map(lambda e: -(10**e))))
    if field in ENTRY_FIELDS:
        entry = data.draw(st.sampled_from(body["files"]))
        entry[field] = value
    else:
        body[field] = value
    (w.step_dir / MANIFEST).write_bytes(seal(body))
    loaded = probe(w)
    if loaded is not None:
        assert_same(loaded, state(2))


# --------------------------------------------------------------------------- the structure file

REAL_TENSORS = ["model.l1.weight", "model.l1.bias", "model.emb", "opt.state.0.exp_avg", "opt.state.0.step", "rng"]
hostile_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.builds(lambda v: {"$tensor": v}, st.one_of(st.sampled_from([*REAL_TENSORS, "missing", "", "../x"]), junk)),
    st.builds(lambda v: {"$float": v}, st.one_of(st.sampled_from(["nan", "inf", "-inf", "NaN", "1.0"]), junk)),
    st.builds(lambda v: {"$bytes": v}, st.one_of(st.sampled_from(["AAEC", "!!", "AAE", "\u00fc", "A" * 7]), junk)),
    st.builds(lambda t, v: {t: v}, st.sampled_from(["$set", "$pickle", "__reduce__", "", "$Dict", "$tensor "]), junk),
)
hostile_node = st.recursive(
    hostile_leaf,
    lambda ch: st.one_of(
        st.lists(ch, max_size=3),
        st.builds(lambda v: {"$tuple": v}, st.one_of(st.lists(ch, max_size=3), junk)),
        st.builds(lambda v: {"$dict": v}, st.lists(st.one_of(st.tuples(st.one_of(st.text(max_size=3), junk), ch)
                                                             .map(list), junk, st.lists(ch, max_size=3)), max_size=3)),
        st.dictionaries(st.sampled_from(["$dict", "$tuple", "$tensor", "a"]), ch, min_size=2, max_size=3),
    ),
    max_leaves=12,
)  # fmt: skip


def _positions(node: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key) slot of a tree, to graft a hostile node into."""
    if isinstance(node, list):
        for i, v in enumerate(node):
            out.append((node, i))
            _positions(v, out)
    elif isinstance(node, dict):
        for k, v in node.items():
            out.append((node, k))
            _positions(v, out)
    return out


@FUZZ
@given(st.data())
def test_fuzzed_structure_files_fail_cleanly(shared: Work, data: st.DataObject) -> None:
    w = shared.reset()
    tree = json.loads((w.step_dir / TREE).read_bytes())
    how = data.draw(st.sampled_from(["graft", "graft", "whole", "deep", "bytes"]))
    if how == "graft":  # keep the real tensor names, so unflatten runs on the hostile part
        slots = _positions(tree, [])
        container, key = data.draw(st.sampled_from(slots))
        container[key] = data.draw(hostile_node)
        blob = json.dumps(tree, allow_nan=True).encode("utf-8", "surrogatepass")
    elif how == "whole":
        blob = json.dumps(data.draw(hostile_node), allow_nan=True).encode("utf-8", "surrogatepass")
    elif how == "deep":
        depth = data.draw(st.integers(150, 4000))
        wrap = data.draw(st.sampled_from([(b"[", b"]"), (b'{"$tuple":[', b"]}"), (b'{"$dict":[["k",', b"]]}")]))
        blob = wrap[0] * depth + json.dumps(tree).encode() + wrap[1] * depth
    else:
        blob = data.draw(st.sampled_from([
            b"\xff\xfe", b'{"$dict": [["a", 1]], "$dict": []}', b"9" * 5000, b'{"$bytes": "AAAA\\ud800"}', b"",
            b"null", b"[" * 10,
        ]))  # fmt: skip
    w.put(TREE, blob)
    probe(w)


# --------------------------------------------------------------------------- corpus mutations


@FUZZ
@given(st.data())
def test_mutated_real_files_fail_cleanly(shared: Work, data: st.DataObject) -> None:
    """Byte-level mutations of the real files, each re-sealed (the manifest: re-sealed if it still parses)."""
    w = shared.reset()
    name = data.draw(st.sampled_from([SHARD, SHARD, TREE, MANIFEST]))
    blob = bytearray((w.step_dir / name).read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "append", "prefix"]))
        at = data.draw(st.integers(0, max(0, len(blob) - 1)))
        if kind == "flip" and blob:
            blob[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set" and blob:
            blob[at] = data.draw(st.sampled_from([0, 0x22, 0x5B, 0x7B, 0x39, 0xFF, 0x20, 0x2D]))
        elif kind == "insert":
            blob[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del blob[at : at + data.draw(st.integers(1, 16))]
        elif kind == "truncate":
            del blob[at:]
        elif kind == "append":
            blob += data.draw(st.binary(min_size=1, max_size=64))
        elif kind == "prefix" and len(blob) >= 8:  # the header length of a shard, or 8 bytes of JSON
            blob[:8] = struct.pack("<Q", data.draw(st.sampled_from([0, 1, 2**63, 2**64 - 1, len(blob) - 8])))
    if name == MANIFEST:
        try:
            body = json.loads(bytes(blob))
            body.pop("checksum")
            blob = bytearray(seal(body))
        except (ValueError, KeyError, AttributeError, TypeError, RecursionError):
            pass
        (w.step_dir / MANIFEST).write_bytes(bytes(blob))
    else:
        w.put(name, bytes(blob))
    probe(w)


# --------------------------------------------------------------------------- memory and time


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize")


def _hostile_shards() -> dict[str, tuple[bytes, list[str], bool]]:
    """label -> (shard, tensor names for the structure file, must fail)."""

    def shard(header: Any, data: bytes = b"", declared: int | None = None) -> bytes:
        text = header if isinstance(header, bytes) else json.dumps(header).encode()
        text += b" " * (-(8 + len(text)) % 8)
        return struct.pack("<Q", len(text) if declared is None else declared) + text + data

    f32 = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    many = {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(5000)}
    return {
        "declared 2**64-1": (shard(f32, bytes(16), declared=2**64 - 1), ["w"], True),
        "declared 2**63": (shard(f32, bytes(16), declared=2**63), ["w"], True),
        "declared past the end": (shard(f32, bytes(16), declared=10**9), ["w"], True),
        "declared MAX_HEADER+1": (shard(f32, bytes(16), declared=MAX_HEADER + 1), ["w"], True),
        "shape 2**40": (shard({"w": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}, bytes(16)),
                        ["w"], True),
        "shape 2**20 x 2**20": (shard({"w": {"dtype": "F64", "shape": [2**20, 2**20], "data_offsets": [0, 2**43]}}),
                                ["w"], True),
        "offsets to 2**64": (shard({"w": {"dtype": "U8", "shape": [2**64], "data_offsets": [0, 2**64]}}, bytes(16)),
                             ["w"], True),
        "lying shape": (shard({"w": {"dtype": "F32", "shape": [2**30], "data_offsets": [0, 16]}}, bytes(16)),
                        ["w"], True),
        "5000 nested arrays": (shard(b'{"w":' + b"[" * 5000 + b"]" * 5000 + b"}", bytes(16)), ["w"], True),
        "a tensor named twice": (shard(b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
                                       b'"w":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}}', bytes(16)),
                                 ["w"], True),
        "5000 empty tensors (valid)": (shard(many), list(many), False),
    }  # fmt: skip


@pytest.mark.parametrize("where", ["top", "nested"])
def test_a_duplicate_key_in_a_shard_header_is_refused_by_name(where: str) -> None:
    from asyncckpt.format._header import parse_header

    entry = '{"dtype":"F32","shape":[4],"data_offsets":[0,16]}'
    text = (f'{{"w":{entry},"w":{entry}}}' if where == "top"
            else '{"w":{"dtype":"F32","shape":[4],"shape":[2],"data_offsets":[0,16]}}').encode()
    blob = struct.pack("<Q", len(text)) + text + bytes(16)
    dup = "'w'" if where == "top" else "'shape'"
    with pytest.raises(ValueError, match=f"duplicate key {dup} in header"):
        parse_header(blob, len(blob))


def test_huge_declared_sizes_fail_fast_within_an_address_space_limit(pristine: Path) -> None:
    """Under RLIMIT_AS = current + 1 GiB, each hostile size fails with CheckpointError in < 1 s."""
    cases = _hostile_shards()
    with Work(pristine) as w:
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = _vm_size() + 2**30
        timings: dict[str, float] = {}
        try:
            resource.setrlimit(
                resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard)
            )
            for label, (blob, names, must_fail) in cases.items():
                w.put(SHARD, blob)
                w.put(TREE, json.dumps({"$dict": [[k, {"$tensor": k}] for k in names]}).encode())
                t0 = time.perf_counter()
                with pytest.raises(CheckpointError) if must_fail else contextlib.nullcontext():
                    load(w.root, 2)
                if must_fail:
                    timings[label] = time.perf_counter() - t0
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    biggest = max(len(b) for b, _, _ in cases.values())
    print("\n== hostile sizes (s): " + ", ".join(f"{k}: {v:.3f}" for k, v in timings.items()))
    print(f"   peak RSS grew by {grew / 2**20:.1f} MiB (largest file {biggest / 2**20:.2f} MiB)")
    assert max(timings.values()) < 1.0, timings
    assert grew < 256 * 2**20


# --------------------------------------------------------------------------- symlinks, pickles, keys


@pytest.mark.parametrize("name", [SHARD, TREE, MANIFEST])
def test_symlink_to_an_outside_copy_is_never_followed(pristine: Path, name: str) -> None:
    """The symlink points at a byte-identical copy outside: following it would load fine."""
    with Work(pristine) as w:
        (w.step_dir / name).unlink()
        (w.step_dir / name).symlink_to(w.outside / name)
        with watched(w):
            with pytest.raises(CheckpointCorruptError) as ei:
                load(w.root, 2)
            assert ei.value.path is not None and os.path.basename(ei.value.path) in (name, STEP2)
            assert find_latest(w.root).step == 1  # type: ignore[union-attr]
            assert_same(load(w.root), state(1))
        probe(w)


def test_symlinked_step_directory_and_listed_symlink_are_not_checkpoints(pristine: Path) -> None:
    with Work(pristine) as w:
        shutil.copytree(w.step_dir, w.outside / STEP2)
        w.forbidden |= {(p.stat().st_dev, p.stat().st_ino) for p in (w.outside / STEP2).iterdir()}
        shutil.rmtree(w.step_dir)
        w.step_dir.symlink_to(w.outside / STEP2, target_is_directory=True)
        with watched(w):
            assert find_latest(w.root).step == 1  # type: ignore[union-attr]
            with pytest.raises(CheckpointNotFoundError):
                load(w.root, 2)
        w.step_dir.unlink()
        shutil.copytree(pristine / STEP2, w.step_dir)
        # a symlink to the outside sentinel, listed in a re-sealed manifest with the sentinel's size and CRC
        (w.step_dir / "sentinel").symlink_to(w.outside / "sentinel")
        body = w.body()
        body["files"].append({"name": "sentinel", "size": 6, "crc32c": crc32c(b"SECRET"), "rank": 0})
        body["files"].sort(key=lambda f: f["name"])
        (w.step_dir / MANIFEST).write_bytes(seal(body))
        with watched(w):
            with pytest.raises(CheckpointCorruptError, match="not a regular file"):
                load(w.root, 2)
            assert find_latest(w.root).step == 1  # type: ignore[union-attr]


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (Path(self.marker), "pwned"))


def test_nothing_is_unpickled(pristine: Path) -> None:
    with Work(pristine) as w:
        marker = w.base / "PWNED"
        evil = pickle.dumps(_Evil(str(marker)))
        zipped = w.base / "evil.pt"
        torch.save({"x": _Evil(str(marker))}, zipped)
        assert not marker.exists()
        with mock.patch.object(torch, "load", side_effect=AssertionError("torch.load called")), \
             mock.patch.object(pickle, "loads", side_effect=AssertionError("pickle.loads called")):  # fmt: skip
            # dropped in unlisted: ignored (every read goes by the manifest), never opened
            (w.step_dir / "rank00000.pt").write_bytes(evil)
            assert find_latest(w.root).step == 2  # type: ignore[union-attr]
            assert_same(load(w.root, 2), state(2))
            # listed in a re-sealed manifest: complete, and ignored by the loader
            w.put("rank00000.pt", evil)
            assert_same(load(w.root, 2), state(2))
            # in place of the shard and the structure file (pickle and torch.save's zip)
            for name in (SHARD, TREE):
                for blob in (evil, zipped.read_bytes()):
                    original = (w.step_dir / name).read_bytes()
                    w.put(name, blob)
                    with pytest.raises(CheckpointCorruptError):
                        load(w.root, 2)
                    w.put(name, original)
        assert not marker.exists()


def test_tensor_keys_never_become_paths(tmp_path: Path) -> None:
    root = tmp_path / "deep" / "ck"
    t = torch.arange(4, dtype=torch.float32)
    hostile = {
        "../../evil": t,
        "/abs": t + 1,
        "a/../../../b": t + 2,
        "..": {".": t + 3, "../..": {"/etc/passwd": t + 4}},
        "": t + 5,
        "nul\x00byte": t + 6,
        "back\\slash": t + 7,
        "~": {"$HOME": t + 8},
        "rank00000.safetensors": t + 9,
        MANIFEST: "not a file",
    }
    before = {p for p in tmp_path.rglob("*")}
    with Checkpointer(root) as ck:
        ck.save(1, hostile).result(timeout=60)
    after = {p for p in tmp_path.rglob("*")}
    step = root / "step_00000001"
    meta = root / ".asyncckpt"  # the owner lock, and nothing else outside the step
    made = {tmp_path / "deep", root, step, step / MANIFEST, step / SHARD, step / TREE, meta, meta / "owner.lock"}
    assert after - before == made
    assert_same(load(root, 1), hostile)


# --------------------------------------------------------------------------- regressions (bugs these fuzzers found)


@pytest.mark.parametrize("shape", [[0, 2**64], [0, 2**62, 2**62]])
def test_zero_sized_tensor_with_huge_dims_is_corrupt(pristine: Path, shape: list[int]) -> None:
    with Work(pristine) as w:
        header = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
        header += b" " * (-(8 + len(header)) % 8)
        w.put(SHARD, struct.pack("<Q", len(header)) + header)
        w.put(TREE, b'{"$dict":[["w",{"$tensor":"w"}]]}')
        with pytest.raises(CheckpointCorruptError):
            load(w.root, 2)


def test_huge_int_created_is_corrupt(pristine: Path) -> None:
    with Work(pristine) as w:
        body = w.body()
        body["created"] = 10**400
        (w.step_dir / MANIFEST).write_bytes(seal(body))
        assert find_latest(w.root).step == 1  # type: ignore[union-attr]
        with pytest.raises(CheckpointCorruptError):
            load(w.root, 2)


def test_fifo_in_place_of_the_manifest_does_not_block(pristine: Path) -> None:
    with Work(pristine) as w:
        marker = w.step_dir / MANIFEST
        marker.unlink()
        os.mkfifo(marker)
        result: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: result.update(latest=find_latest(w.root)), daemon=True)
        worker.start()
        worker.join(2.0)
        hung = worker.is_alive()
        if hung:  # let the blocked open go: it then reads EOF
            os.close(os.open(marker, os.O_WRONLY | os.O_NONBLOCK))
            worker.join(10.0)
        assert not hung, "find_latest blocked opening a FIFO"
        assert result["latest"].step == 1
        with pytest.raises(CheckpointCorruptError):
            load(w.root, 2)


def test_bytes_and_floats_in_the_structure_round_trip(pristine: Path) -> None:
    """Sanity of the structure fuzzer's base: the real tree's tagged leaves decode as saved."""
    with Work(pristine) as w:
        tree = json.loads((w.step_dir / TREE).read_bytes())
        flat = json.dumps(tree)
        assert '"$bytes"' in flat and '"$float"' in flat and '"$tuple"' in flat and '"$tensor"' in flat
        blobs = [c[k] for c, k in _positions(tree, []) if k == "$bytes"]
        assert [base64.b64decode(b) for b in blobs] == [b"\0\1"]
