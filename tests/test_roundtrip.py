"""Every supported type round-trips exactly; unsupported ones fail at the call, by key path."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import assert_same
from safetensors import safe_open
from safetensors.torch import load_file

from asyncckpt import Checkpointer, load
from asyncckpt.format._structure_encode import flatten_parts
from asyncckpt.format._structure_names import TensorFacts

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.complex64, torch.uint16, torch.uint32, torch.uint64,
    torch.float8_e4m3fn, torch.float8_e5m2,
]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, math.prod(shape)) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw[: math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape).clone()


def roundtrip(tmp_path: Path, state: Any, **kw: Any) -> Any:
    with Checkpointer(tmp_path / "ck", **kw) as ck:
        ck.save(1, state).result(timeout=60)
        return ck.load(1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_and_shapes(tmp_path: Path, dtype: torch.dtype) -> None:
    state = {
        "scalar0d": _tensor(dtype, (), 1),
        "empty": _tensor(dtype, (0, 3), 2),
        "vec": _tensor(dtype, (7,), 3),
        "mat": _tensor(dtype, (5, 3), 4),
    }
    assert_same(roundtrip(tmp_path, state), state)


def test_noncontiguous_and_views(tmp_path: Path) -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    state = {
        "t": base.t(),
        "slice": base[1:4, ::3],
        "expand": torch.ones(3, 1).expand(3, 4),
        "view": base.view(-1)[7:19],
    }
    out = roundtrip(tmp_path, state)
    for k, v in state.items():
        assert out[k].is_contiguous()
        assert torch.equal(out[k], v), k


def test_python_values_and_containers(tmp_path: Path) -> None:
    py_rng = random.Random(5).getstate()
    state = {
        "int": 3, "big": 2**80, "neg": -7, "float": 0.1, "whole_float": 2.0, "nan": float("nan"),
        "inf": float("inf"), "ninf": float("-inf"), "true": True, "false": False, "none": None,
        "str": "héllo", "bytes": b"\x00\xffab", "empty_list": [], "empty_tuple": (), "empty_dict": {},
        "tuple": (1, 2.5, "x", (None, [True])), "list": [1, [2, (3,)]],
        "int_keys": {0: "a", 1: {2: torch.ones(2)}, -1: "neg"}, "mixed_keys": {0: 1, "0": 2},
        "dotted.key": {"a.b": torch.zeros(1), "a\\b": torch.ones(1)},
        "collide": {"a.b": torch.zeros(2), "a": {"b": torch.ones(2)}},
        "py_rng": py_rng, "torch_rng": torch.get_rng_state(),
    }
    out = roundtrip(tmp_path, state)
    assert_same(out, state)
    r = random.Random()
    r.setstate(out["py_rng"])
    assert r.random() == random.Random(5).random()


def test_module_optimizer_scheduler(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        sched.step()
    out = roundtrip(tmp_path, {"model": model, "optim": opt, "sched": sched})
    assert_same(out["model"], dict(model.state_dict()))
    assert_same(out["optim"], opt.state_dict())
    assert list(out["optim"]["state"].keys()) == [0, 1, 2, 3, 4, 5]
    assert out["sched"] == sched.state_dict()

    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2)
    load(Path(tmp_path / "ck"), into={"model": model2, "optim": opt2, "sched": sched2})
    assert_same(dict(model2.state_dict()), dict(model.state_dict()))
    assert_same(opt2.state_dict(), opt.state_dict())
    assert sched2.state_dict() == sched.state_dict()


def test_into_copies_tensors_in_place_and_replaces_plain_values(tmp_path: Path) -> None:
    saved = {"w": torch.arange(4.0), "nested": [torch.ones(2), 5], "meta": {"epoch": 3}}
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(0, saved).result(timeout=60)
        target = {"w": torch.zeros(4), "nested": [torch.zeros(2), 0], "meta": {"epoch": 0}}
        w = target["w"]
        out = ck.load(into=target)
    assert target["w"] is w and torch.equal(w, saved["w"])
    assert torch.equal(target["nested"][0], torch.ones(2)) and target["nested"][1] == 5
    assert target["meta"]["epoch"] == 3
    assert_same(out, saved)
    with Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(KeyError, match="missing"):
            ck.load(into={"missing": torch.zeros(1)})
        with pytest.raises(ValueError, match="shape"):
            ck.load(into={"w": torch.zeros(5)})


def test_files_are_readable_by_safetensors_under_dotted_names(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    opt.step()
    with Checkpointer(tmp_path / "ck") as ck:
        info = ck.save(7, {"model": model, "optim": opt, "x": {"a.b": torch.ones(1)}}).result(timeout=60)
    shard = info.path / "rank00000.safetensors"
    tensors = load_file(str(shard))
    assert torch.equal(tensors["model.0.weight"], model[0].weight.detach())
    assert "optim.state.0.exp_avg" in tensors and "x.a.b" in tensors
    with safe_open(str(shard), framework="pt") as f:
        assert f.metadata()["format"] == "pt"
    header_len = int.from_bytes(shard.read_bytes()[:8], "little")
    assert (8 + header_len) % 4096 == 0  # data section page-aligned for O_DIRECT
    json.loads((info.path / "rank00000.json").read_text())  # structure is plain JSON


class Opaque:
    pass


@pytest.mark.parametrize(
    ("state", "exc", "where"),
    [
        ({"a": {"b": Opaque()}}, TypeError, "a.b"),
        ({"a": [1, {"c": object()}]}, TypeError, "a.1.c"),
        ({"a": {1.5: 1}}, TypeError, "dict key"),
        ({"a": {(1, 2): 1}}, TypeError, "dict key"),
        ({"m": torch.empty(2, device="meta")}, TypeError, "meta tensor at 'm'"),
        ({"s": torch.eye(2).to_sparse()}, TypeError, "layout"),
        ({"c": torch.ones(2, dtype=torch.complex128)}, TypeError, "dtype"),
        ({"n": {torch.ones(1)}}, TypeError, "set at 'n' holds tensors"),
    ],
)
def test_unsupported_objects_fail_at_the_call_and_writer_keeps_working(
    tmp_path: Path, state: Any, exc: type[Exception], where: str
) -> None:
    with Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(exc, match=where.replace(".", r"\.")):
            ck.save(1, state)
        assert ck.steps() == []
        ck.save(1, {"ok": torch.ones(2)}).result(timeout=60)
        assert ck.steps() == [1]


def test_cycle_is_a_value_error(tmp_path: Path) -> None:
    cyc: dict[str, Any] = {}
    cyc["self"] = cyc
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(ValueError, match="cycle"):
        ck.save(0, cyc)


def test_one_address_ties_only_the_identical_view(tmp_path: Path) -> None:
    # tie detection looks at the full key only where an address repeats: every tensor here
    # starts at base's first element, and only the second `base` is the same tensor
    base = torch.arange(12, dtype=torch.float32)
    grad = torch.arange(6, dtype=torch.float32).reshape(2, 3).requires_grad_()
    state = {
        "base": base,
        "ints": base.view(torch.int32),
        "empty": base[:0],
        "grid": base.view(3, 4),
        "strided": base.view(3, 4).t(),
        "again": base,
        "grad_t": grad.t(),  # requires grad, not contiguous: staged through torch's copy
        "grad_leaf": grad,
    }
    with Checkpointer(tmp_path) as ck:
        ck.save(1, state).result(timeout=60)
    with safe_open(str(tmp_path / "step_00000001" / "rank00000.safetensors"), "pt") as f:
        names = sorted(f.keys())
    assert names == sorted(k for k in state if k != "again")
    out = load(tmp_path)
    assert out["again"] is out["base"]
    for k, v in state.items():
        assert torch.equal(out[k], v.detach()), k
        assert not out[k].requires_grad, k
    assert grad.grad_fn is None and grad.grad is None  # the save recorded no autograd graph


def test_conj_and_neg_views_are_not_tied_to_their_base(tmp_path: Path) -> None:
    # same address, shape, strides and dtype: the conj/neg bit is what tells them apart
    z = torch.complex(torch.arange(4.0), torch.arange(4.0) + 1)
    x = torch.arange(5.0)
    state = {"z": z, "zc": z.conj(), "x": x, "xn": torch._neg_view(x)}
    with Checkpointer(tmp_path) as ck:
        ck.save(1, state).result(timeout=60)
    out = load(tmp_path)
    assert torch.equal(out["zc"], z.conj().resolve_conj()) and torch.equal(out["z"], z)
    assert torch.equal(out["xn"], -x) and torch.equal(out["x"], x)


def test_many_views_at_one_address_each_stored(tmp_path: Path) -> None:
    # every view starts at the same address; none is the same tensor as another
    base = torch.arange(400, dtype=torch.float32)
    state = {f"v{i}": base[: i + 1] for i in range(400)} | {"again": base[:7]}
    with Checkpointer(tmp_path) as ck:
        ck.save(1, state).result(timeout=60)
    out = load(tmp_path)
    for i in range(400):
        assert torch.equal(out[f"v{i}"], base[: i + 1])
    assert out["again"] is out["v6"]


def test_a_tensor_keyed_like_the_header_metadata_round_trips(tmp_path: Path) -> None:
    # "__metadata__" is the safetensors header's own entry: the tensor gets another name
    state = {"__metadata__": torch.ones(3), "__metadata__~2": torch.zeros(2), "m": {"__metadata__": 1}}
    with Checkpointer(tmp_path) as ck:
        ck.save(1, state).result(timeout=60)
        assert ck.steps() == [1]
    out = load(tmp_path)
    assert torch.equal(out["__metadata__"], torch.ones(3)) and torch.equal(out["__metadata__~2"], torch.zeros(2))
    assert out["m"] == {"__metadata__": 1}


def _t(i: int) -> torch.Tensor:
    return torch.full((2,), float(i))


@pytest.mark.parametrize(
    ("state", "names"),
    [
        ({"a.b": _t(0), "a": {"b": _t(1)}}, ["a.b", "a.b~2"]),
        ({"a": {"b": _t(1)}, "a.b": _t(0)}, ["a.b", "a.b~2"]),
        ({1: _t(0), "1": _t(1)}, ["1", "1~2"]),
        ({"__metadata__": _t(0)}, ["__metadata__~2"]),
        ({"w": {"p": np.zeros(2, dtype=np.float32)}, "w.p": _t(0)}, ["w.p", "w.p~2"]),
        ({"x": torch.nn.Parameter(_t(0)), "y": {"x~2": _t(1)}, "x~2": _t(2)}, ["x", "y.x~2", "x~2"]),
        ({"m": {"x": _t(0)}, "m.x": _t(1), "m.x~2": _t(2)}, ["m.x", "m.x~2", "m.x~2~2"]),
        ({"e": _t(5), "f": _t(6)[:1]}, ["e", "f"]),
    ],
)
def test_a_name_made_twice_gets_the_suffix_of_a_walk_that_checks_each_name(
    tmp_path: Path, state: dict[Any, Any], names: list[str]
) -> None:
    # the walk checks its plain tensors' names for repeats only at its end (issue 32): where one
    # repeats, the state is walked again, checking each name: the names are what they always were
    facts = TensorFacts()
    _, got, tensors = flatten_parts(state, facts=facts)
    assert got == names
    assert facts.dtypes == [t.dtype for t in tensors] and facts.shapes == [t.shape for t in tensors]
    with Checkpointer(tmp_path) as ck:
        ck.save(1, state).result(timeout=60)
    _, again, back = flatten_parts(load(tmp_path))
    assert again == names and all(torch.equal(a, b) for a, b in zip(back, tensors, strict=True))


def test_a_tensor_of_more_dimensions_than_a_reader_takes_is_refused_at_save(tmp_path: Path) -> None:
    ok = torch.ones([1] * 64)
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(ValueError, match=r"'deep' has 65 dimensions; a checkpoint holds at most 64"):
            ck.save(1, {"ok": ok, "deep": torch.ones([1] * 65)})
        with pytest.raises(ValueError, match="65 dimensions"):
            ck.reserve({"deep": torch.ones([1] * 65)})
        assert ck.steps() == []
        ck.save(2, {"ok": ok}).result(timeout=60)
    assert load(tmp_path)["ok"].shape == ok.shape


def test_an_int_too_long_for_text_is_refused_naming_its_key(tmp_path: Path) -> None:
    import sys

    limit = sys.get_int_max_str_digits()
    if limit == 0:
        pytest.skip("this interpreter converts ints of any length")
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(ValueError, match=r"int at 'a\.big' has more digits"):
            ck.save(1, {"a": {"big": 10 ** (limit + 10)}, "t": torch.ones(1)})
        assert ck.steps() == []
        big = 10 ** (limit - 10)  # below the limit: saved exactly
        ck.save(2, {"big": big, "t": torch.ones(1)}).result(timeout=60)
    assert load(tmp_path)["big"] == big


def test_an_int_over_a_lowered_digit_limit_is_refused_naming_its_key(tmp_path: Path) -> None:
    import sys

    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)  # the least Python allows
    try:
        with Checkpointer(tmp_path) as ck:
            with pytest.raises(ValueError, match=r"int at 'n' has more digits"):
                ck.save(1, {"n": 10**650, "t": torch.ones(1)})
            assert ck.steps() == []
    finally:
        sys.set_int_max_str_digits(before)
