"""One acceptance rule (issue 26, problem 1): what ``save()`` accepts, ``load()`` restores exactly;
what a reader would refuse, ``save()`` refuses at the call, naming the key path and the limit.

The outsiders' five honest states that committed and then could not be loaded (a 9 MB string
of commas, a sampler's permutation of 9M ints, 200 MiB of ``bytes``, 600k tiny tensors, 120
tensors with 1 MB names), the boundaries the writer and the reader must agree on (nesting
depth, dimensions, shapes of no elements, digits of int keys), the committing rank's check of
the manifest and the global index with the readers' parsers, and a property test over states
at and past every limit. The full-size 600k tensors and 200 MiB of bytes run with ``-m slow``;
the default run covers those limits with tests/test_hostile_bounds.py's header of 2**19 + 2
tensors (the old limit), a 270 MB string and the property test's shards at the header limit.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _cli_util import run_cli
from _ranks import free_port, log_tail, run_ranks
from conftest import FaultOps, assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncckpt import CheckpointCorruptError, Checkpointer, SaveError, load
from asyncckpt.format import _header, _manifest
from asyncckpt.format._bounds import MAX_DEPTH
from asyncckpt.format._checksum import crc32c
from asyncckpt.format._manifest import MANIFEST, FileEntry, encode
from asyncckpt.loading._verify import verify_step
from asyncckpt.reading import read_rank_outline
from asyncckpt.roots.posix._discovery import open_step, read_manifest
from asyncckpt.saving import _leadercommit

HERE = Path(__file__).resolve().parent


def committed(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step_"))


def save_and_load(root: Path, state: Any, step: int = 1) -> Any:
    with Checkpointer(root) as ck:
        ck.save(step, state).result(timeout=120)
    return load(root, step)


# ------------------------------------------------------------------ the outsiders' five states


def test_a_9_mb_string_of_commas_loads_back(tmp_path: Path) -> None:
    """9M commas are 9M "JSON items" to a byte count, over the old 2**23 limit: one value."""
    state = {"csv": "," * 9_000_000, "quoted": '"\\,' * 1000, "w": torch.ones(3)}
    assert_same(save_and_load(tmp_path, state), state)


def test_a_sampler_permutation_of_9m_ints_loads_back(tmp_path: Path) -> None:
    perm = torch.randperm(9_000_000, generator=torch.Generator().manual_seed(0)).tolist()
    state = {"sampler": {"perm": perm, "pos": 12_345}, "w": torch.ones(3)}
    out = save_and_load(tmp_path, state)
    assert out["sampler"]["perm"] == perm and out["sampler"]["pos"] == 12_345


@pytest.mark.slow
def test_200_mib_of_bytes_loads_back(tmp_path: Path) -> None:
    """Its base64 makes a structure file of 280 MB, over the old 256 MiB limit (the default
    run covers that limit with a 270 MB string: test_info_verify_and_export_read_what_load_reads)."""
    blob = np.random.default_rng(0).integers(0, 256, 200 * 2**20, dtype=np.uint8).tobytes()
    out = save_and_load(tmp_path, {"blob": blob})
    assert out["blob"] == blob


@pytest.mark.slow
@pytest.mark.timeout(600)  # several CLI runs of up to 300 s each; hit 120 s in a loaded slow phase
def test_600k_tiny_tensors_load_back_and_every_tool_reads_them(tmp_path: Path) -> None:
    """Over the old 2**19 tensors per shard (the header holds 600k entries in 41 MB)."""
    state = {f"layer{i}.bias": torch.full((1,), float(i)) for i in range(600_000)}
    out = save_and_load(tmp_path, state)
    assert list(out) == list(state)  # (assert_same's key check is quadratic)
    assert torch.equal(torch.cat(list(out.values())), torch.cat(list(state.values())))
    for argv in (["info", tmp_path], ["verify", tmp_path], ["export", tmp_path, "--to", tmp_path / "x.safetensors"]):
        r = run_cli(*argv, timeout=300)
        assert r.code == 0, (argv, r.err[-2000:])


def test_names_too_long_for_a_shard_header_are_refused_at_the_call(tmp_path: Path) -> None:
    """120 tensors with 1 MB names need a 120 MB header, over what safetensors readers take:
    refused by save(), naming the longest key path and the limit; nothing is written."""
    with Checkpointer(tmp_path, keep_last=1) as ck:
        ck.save(1, {"w": torch.ones(2)}).result(timeout=60)
        long_names = {f"n{i:03d}" + "x" * 1_000_000: torch.zeros(1) for i in range(120)}
        with pytest.raises(ValueError, match=r"100,000,000-byte limit of safetensors readers") as ei:
            ck.save(2, long_names)
        msg = str(ei.value)
        assert "longest key path is 'n000xxxx" in msg and "1,000,004 characters" in msg
        assert len(msg) < 1000  # the name is shown shortened, not a megabyte of it
        with pytest.raises(ValueError, match="limit"):
            ck.reserve(long_names)
        assert committed(tmp_path) == ["step_00000001"] and ck.steps() == [1]
        ck.save(2, {"w": torch.zeros(2)}).result(timeout=60)  # the step is free again
    assert_same(load(tmp_path, 2), {"w": torch.zeros(2)})


def test_a_declared_header_length_over_the_limit_is_named_as_such(tmp_path: Path) -> None:
    """The reader said 'does not fit the file' of a header that fit but was over the limit."""
    save_and_load(tmp_path, {"w": torch.ones(2)})
    sd = tmp_path / "step_00000001"
    n = _header.MAX_HEADER + 4096
    shard = sd / "rank00000.safetensors"
    with open(shard, "r+b") as f:  # sparse: a declared length that fits a file of that size
        f.write(n.to_bytes(8, "little"))
        f.truncate(8 + n + 8)
    m = read_manifest(str(sd))
    size = shard.stat().st_size
    crc = 0
    with open(shard, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            crc = crc32c(chunk, crc)
    files = [FileEntry(f.name, size, crc, f.rank) if f.name == shard.name else f for f in m.files]
    (sd / MANIFEST).write_bytes(encode(m.step, m.attempt, m.world_size, m.nbytes, m.created, files, m.extra))
    with pytest.raises(CheckpointCorruptError, match=r"exceeds the 104,857,600-byte \(100 MiB\) limit") as ei:
        load(tmp_path, 1)
    assert "does not fit" not in str(ei.value) and ei.value.path == str(shard)


# ------------------------------------------------------------------ boundaries the two sides share


def nested(depth: int, leaf: Any) -> Any:
    """``leaf`` under ``depth`` levels of dicts: the leaf sits ``depth`` levels below the root."""
    for _ in range(depth):
        leaf = {"k": leaf}
    return leaf


def test_nesting_depth_is_one_rule_for_save_and_load(tmp_path: Path) -> None:
    """A value 200 levels down loads back; one level deeper is refused at the call (save()
    used to accept a leaf at 201 that no reader took). A Parameter, numpy scalar or Generator
    holds its value one level further down, an OrderedDict its _metadata."""
    od = collections.OrderedDict(a=1)
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    fine = [
        nested(MAX_DEPTH, 7),
        nested(MAX_DEPTH, {}),
        nested(MAX_DEPTH, []),
        nested(MAX_DEPTH, torch.ones(2)),
        nested(MAX_DEPTH - 1, torch.nn.Parameter(torch.ones(2))),
        nested(MAX_DEPTH - 1, np.float32(1.5)),
        nested(MAX_DEPTH - 1, [1, 2, 3]),
        nested(MAX_DEPTH - 3, od),  # its _metadata's values sit 3 levels below it
    ]
    too_deep = [
        nested(MAX_DEPTH + 1, 7),
        nested(MAX_DEPTH, [1]),
        nested(MAX_DEPTH, {"x": 1}),
        nested(MAX_DEPTH, torch.nn.Parameter(torch.ones(2))),
        nested(MAX_DEPTH, np.float32(1.5)),
        nested(MAX_DEPTH, torch.Generator()),
        nested(MAX_DEPTH - 2, od),
    ]
    with Checkpointer(tmp_path) as ck:
        for step, state in enumerate(fine, 1):
            ck.save(step, state).result(timeout=60)
            assert_same(load(tmp_path, step), state)
        for state in too_deep:
            with pytest.raises(ValueError, match=rf"nested too deep at 'k\.k\.k.*at most {MAX_DEPTH} levels"):
                ck.save(100, state)
        assert ck.steps() == list(range(1, len(fine) + 1))


_limit_at_import = sys.getrecursionlimit()


def _from_deeper(frames: int, fn: Any) -> Any:
    return _from_deeper(frames - 1, fn) if frames else fn()


@pytest.mark.parametrize("kind", [collections.OrderedDict, dict, tuple])
def test_the_deepest_state_saves_and_loads_from_a_deep_call_stack(tmp_path: Path, kind: Any) -> None:
    """200 levels of OrderedDicts are 800 levels of JSON, counted against the interpreter's
    recursion limit with the caller's own frames: saved from one stack, it loaded as "not
    valid JSON" (corrupt!) from 200 frames deeper, and a save from 300 frames deeper raised
    RecursionError. Both now take what they need on top of the caller's stack."""
    state: Any = 1
    for _ in range(MAX_DEPTH):
        state = (state,) if kind is tuple else kind(k=state)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, state).result(timeout=60)
        _from_deeper(300, lambda: ck.save(2, state).result(timeout=60))
    for step in (1, 2):
        assert _from_deeper(300, lambda: load(tmp_path, step)) == state  # noqa: B023 - called at once
    assert sys.getrecursionlimit() == _limit_at_import  # raised only while needed


def test_a_tensor_of_no_elements_but_a_huge_shape_is_refused_at_the_call(tmp_path: Path) -> None:
    """[0, 2**62] float32: 0 bytes, but 2**64 with the 0 counted as 1, which readers refuse."""
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(
            ValueError, match=r"tensor 'opt\.empty' has a shape \[0, 4611686018427387904\] of 2\*\*63 bytes or more"
        ):
            ck.save(1, {"opt": {"empty": torch.empty((0, 2**62))}})
        ck.save(1, {"opt": {"empty": torch.empty((0, 2**62), dtype=torch.uint8)}}).result(timeout=60)
    assert load(tmp_path, 1)["opt"]["empty"].shape == (0, 2**62)


def test_an_int_key_too_long_for_text_is_refused_naming_its_key_path(tmp_path: Path) -> None:
    limit = sys.get_int_max_str_digits()
    if limit == 0:
        pytest.skip("this interpreter converts ints of any length")
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(ValueError, match=r"dict key at 'counts' has more digits"):
            ck.save(1, {"counts": {10 ** (limit + 10): 1}})
        ck.save(1, {"counts": {10**500: 1, -(2**1999): 2}}).result(timeout=60)
    assert load(tmp_path, 1) == {"counts": {10**500: 1, -(2**1999): 2}}


# ------------------------------------------------------------------ the committing rank's check


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "guard-off"])
def test_a_manifest_no_reader_would_accept_is_never_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checked: bool
) -> None:
    """The manifest bounds (2**18 files) take 2**17 ranks to reach; lowered to 1 file, the
    readers' parser refuses every manifest, so the save must fail before its commit point
    (the rename to step_N never happens): nothing committed, nothing retired (keep_last=1),
    the previous step loads. With the check off (the guard's teeth) the commit rename happens,
    and only the check after it takes the step back."""
    monkeypatch.setattr(_leadercommit, "_CHECK_BEFORE_COMMIT", checked)
    ops = FaultOps()  # records every rename; injects nothing
    with Checkpointer(tmp_path, keep_last=1, os_ops=ops) as ck:
        ck.save(1, {"w": torch.ones(2)}).result(timeout=60)
        monkeypatch.setattr(_manifest, "MAX_MANIFEST_FILES", 1)
        with pytest.raises(SaveError) as ei:
            ck.save(2, {"w": torch.zeros(2)}).result(timeout=60)
        failure = ei.value.failures[0]
        assert failure.exc_type == "CheckpointCorruptError", failure
        assert "at most 1 entries" in failure.message, failure
        assert isinstance(ei.value.__cause__, CheckpointCorruptError)
        with pytest.raises(SaveError):
            ck.flush()  # (reported once more there, as every failed save is)
        renamed = any(op == "rename" and path.endswith("step_00000002") for op, path in ops.calls)
        assert renamed is not checked and ("not committed" in failure.message) is checked, (ops.calls, failure)
        monkeypatch.setattr(_manifest, "MAX_MANIFEST_FILES", 2**18)
        assert committed(tmp_path) == ["step_00000001"] and ck.steps() == [1]
        assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []
        assert_same(ck.load(), {"w": torch.ones(2)})
        ck.save(2, {"w": torch.zeros(2)}).result(timeout=60)  # the next save commits
    assert_same(load(tmp_path), {"w": torch.zeros(2)})


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "guard-off"])
def test_a_global_index_no_reader_would_accept_is_never_committed(tmp_path: Path, checked: bool) -> None:
    """Two gloo ranks with a replicated state (dedupe writes a global index); rank 0 lowers
    the index size bound the readers apply: every rank's save fails naming rank 0's
    CheckpointCorruptError, nothing is committed or retired, and both ranks load step 1.
    With the check off (the guard's teeth: nothing after the commit point parses the index)
    the unloadable step commits and keep_last=1 retires the good one."""
    root, out = tmp_path / "root", tmp_path / "out"
    port = free_port()
    worker = str(HERE / "support" / "_acceptance_worker.py")
    scenario = "index" if checked else "index_unchecked"
    hung = run_ranks(lambda r: [worker, scenario, str(r), "2", str(port), str(root), str(out)], 2, tmp_path, 100)
    assert not hung, [log_tail(tmp_path, r) for r in hung]
    for rank in range(2):
        res = json.loads(Path(f"{out}.{rank}.json").read_text())
        assert "crash" not in res, res.get("crash")
        if not checked:
            assert res["error"] is None and res["steps"] == [2] and res["load_error"] == "CheckpointCorruptError", res
            continue
        failure = res["error"]["failures"]["0"]
        assert res["error"]["type"] == "SaveError" and failure["exc_type"] == "CheckpointCorruptError", res
        assert "global index" in failure["message"] and "index larger than 10 bytes" in failure["message"], res
        assert res["steps"] == [1] and res["loaded_step1"], res
    assert committed(root) == (["step_00000001"] if checked else ["step_00000002"])
    assert [n for n in os.listdir(root) if ".tmp-" in n] == []


# ------------------------------------------------------------------ every tool reads what load reads


@pytest.mark.slow  # > 15 s in make test's parallel phase: make test-slow (and CI) runs it
def test_info_verify_and_export_read_what_load_reads(tmp_path: Path) -> None:
    """load(), `info`, `verify` and `export` all refused these before (9M commas: over 2**23
    JSON items; a 270 MB string: a structure file over 256 MiB); they share the readers' bounds."""
    state = {"csv": "," * 9_000_000, "text": "a" * 270_000_000, "w": torch.arange(4.0)}
    with Checkpointer(tmp_path) as ck:
        ck.save(1, state).result(timeout=120)
    assert (tmp_path / "step_00000001" / "rank00000.json").stat().st_size > 270_000_000
    for argv in (["info", tmp_path], ["verify", tmp_path], ["export", tmp_path, "--to", tmp_path / "w.safetensors"]):
        r = run_cli(*argv, timeout=120)
        assert r.code == 0, (argv, r.err[-2000:])
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(tmp_path / "w.safetensors"))["w"], torch.arange(4.0))
    out = load(tmp_path)
    assert out["csv"] == state["csv"] and out["text"] == state["text"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # several CLI runs of up to 300 s each; hit 120 s in a loaded slow phase
def test_info_verify_and_export_read_a_9m_int_permutation(tmp_path: Path) -> None:
    state = {"perm": list(range(9_000_000)), "w": torch.arange(4.0)}
    with Checkpointer(tmp_path) as ck:
        ck.save(1, state).result(timeout=120)
    for argv in (["info", tmp_path], ["verify", tmp_path], ["export", tmp_path, "--to", tmp_path / "w.safetensors"]):
        r = run_cli(*argv, timeout=300)
        assert r.code == 0, (argv, r.err[-2000:])


# ------------------------------------------------------------------ the property


def _comparable(x: Any) -> Any:
    """``x`` with every Generator as its state and every OrderedDict's _metadata as an entry
    (assert_same compares neither)."""
    if isinstance(x, torch.Generator):
        return ("generator", str(x.device), x.get_state())
    if isinstance(x, dict):
        out = type(x)() if type(x) is not collections.defaultdict else {}
        for k, v in x.items():
            out[k] = _comparable(v)
        meta = getattr(x, "_metadata", None)
        return (out, _comparable(meta)) if meta is not None else out
    if type(x) in (list, tuple):
        return type(x)(_comparable(v) for v in x)
    return x


#: Characters that stress the counting and the encoders: JSON's own, escapes, lone surrogates.
_CHARS = st.sampled_from([",", "[", "{", '"', "\\", "\n", "\x00", "é", "\U0001f600", "\ud800", "a", ".", "~"])
_TEXT = st.lists(_CHARS, max_size=400).map("".join) | st.builds(lambda c, n: c * n, _CHARS, st.integers(0, 20_000))
_INTS = st.integers(-(2**70), 2**70) | st.sampled_from([2**63 - 1, 2**63, 2**64, -(2**63) - 1, 2**1999, 2**2001])
_SCALARS = st.none() | st.booleans() | _INTS | st.floats(allow_nan=True) | _TEXT | st.binary(max_size=3000)
_DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.complex64])


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(_DTYPES)
    kind = draw(st.sampled_from(["small", "dims", "empty_huge"]))
    if kind == "dims":  # at and past MAX_DIMS
        shape = [1] * draw(st.integers(_header.MAX_DIMS - 2, _header.MAX_DIMS + 2))
    elif kind == "empty_huge":  # 0 elements, a byte size at and past 2**63 with the 0 counted as 1
        shape = [0, 2 ** draw(st.integers(59, 63)) // dtype.itemsize - draw(st.integers(0, 1))]
    else:
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
    try:
        return torch.zeros(shape, dtype=dtype)
    except (RuntimeError, TypeError):  # torch refuses some shapes itself (a 1-byte dtype's 2**63 elements: TypeError)
        return torch.zeros(0, dtype=dtype)


def _param(t: torch.Tensor, grad: bool) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=grad and (t.is_floating_point() or t.is_complex()))


_KEYS = st.integers(-(2**64), 2**64) | st.sampled_from(["", ".", "a.b", "__metadata__", "x~2", "k" * 5000]) | _TEXT
_LEAVES = (
    _SCALARS
    | _tensors()
    | st.builds(_param, _tensors(), st.booleans())
    | st.builds(np.float32, st.floats(width=32, allow_nan=False))
    | st.builds(lambda s: torch.Generator().manual_seed(s), st.integers(0, 2**32))
)


def _deep(leaf: Any, depth: int) -> Any:
    return nested(depth, leaf)


_STATES = st.recursive(
    _LEAVES,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(_KEYS, inner, max_size=5)
        | st.builds(tuple, st.lists(inner, max_size=3))
        | st.builds(collections.OrderedDict, st.dictionaries(st.text(max_size=5), inner, max_size=3))
    ),
    max_leaves=12,
)
#: states around every limit: depth (MAX_DEPTH), names against the header limit, long lists
_AT_LIMITS = (
    st.builds(_deep, _LEAVES | st.just([1, 2]) | st.just({}), st.integers(MAX_DEPTH - 2, MAX_DEPTH + 1))
    | st.builds(
        lambda n, size: {f"p{i}." + "n" * size: torch.ones(1) for i in range(n)},
        st.integers(1, 4),
        st.integers(1000, 4000),
    )
    | st.builds(lambda n: {"ids": list(range(n)), "t": torch.ones(1)}, st.integers(0, 200_000))
)


@pytest.fixture(scope="module")
def small_header_limit() -> Iterator[None]:
    """The header limit lowered to 8 KiB for the property test (the one constant writer and
    readers share), so names just under and over it cost kilobytes, not 100 MiB."""
    mp = pytest.MonkeyPatch()
    mp.setattr(_header, "MAX_HEADER", 8192)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def prop_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("property")


_steps = itertools.count(1)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(state=_STATES | _AT_LIMITS)
def test_accepted_means_it_loads_back_exactly(state: Any, small_header_limit: None, prop_root: Path) -> None:
    """save() raises TypeError/ValueError at the call, or the step commits and load(), the
    CLI's verification and outline (`verify`, `info`) all take it and load() returns it exactly."""
    step = next(_steps)
    root = prop_root / f"s{step}"
    with Checkpointer(root) as ck:
        try:
            handle = ck.save(step, state)
        except (TypeError, ValueError) as e:
            assert "at '" in str(e) or "key path" in str(e) or "tensor '" in str(e), e  # names where
            assert ck.steps() == [] and not committed(root)
            return
        handle.result(timeout=60)
    assert_same(_comparable(load(root, step)), _comparable(state))
    step_dir, manifest = open_step(str(root), step)
    assert verify_step(str(root), manifest.step, record=False) == []
    read_rank_outline(step_dir, manifest, 0)
