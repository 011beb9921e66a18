"""What the loader does to keep a load of many tensors small (issue 32), checked against the
plain path: the tree parsed compact (``compact_node``) and emptied as it is decoded
(``consume``) rebuilds exactly the same state; the shard's slots stand in for the tensors
when the targets of ``into=`` are planned, with every node checked as for the real load;
runs of tensors (``Tiles``) land every byte and chain the CRC as one destination a tensor did.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import random
from array import array
from pathlib import Path
from typing import Any

import crc32c as _crc
import numpy as np
import pytest
import torch

from asyncckpt.format._header import TensorSlot
from asyncckpt.format._safetensors import DTYPE_TO_ST
from asyncckpt.format._structure_decode import StandInSites, ValueStandIn, compact_node, fill_in, unflatten
from asyncckpt.format._structure_encode import flatten
from asyncckpt.format._structure_json import tree_json
from asyncckpt.loading import _readinto


def _varied() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    od: collections.OrderedDict[str, Any] = collections.OrderedDict(w=torch.rand(2, generator=g))
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return {
        "model": {f"l{i}.weight": torch.rand(3, generator=g) for i in range(5)},
        "param": torch.nn.Parameter(torch.rand(2, generator=g), requires_grad=False),
        "array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "rng": torch.Generator().manual_seed(7),
        "odict": od,
        "dd": collections.defaultdict(list, {"a": [torch.ones(1)]}),
        "tuple": (torch.zeros(2), 1, "x", None, 2.5),
        "nested": [[{"t": torch.arange(4)}]],
        "set": {1, 2},
        "when": datetime.date(2026, 12, 5),
        "size": torch.Size([2, 3]),
        "iteration": 12345,
    }


def compact_tree_name(tree: Any, *path: str) -> str:
    """The tensor name at ``path`` of a tree of plain (dict) nodes."""
    node = tree
    for key in path:
        node = dict(node["$dict"])[key]
    return str(node["$tensor"])


def _parsed(state: Any, hook: Any = None) -> tuple[Any, dict[str, torch.Tensor]]:
    tree, refs = flatten(state)
    return json.loads(tree_json(tree), object_hook=hook), {r.name: r.tensor.detach() for r in refs}


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a is b or (a.dtype == b.dtype and torch.equal(a, b))
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, torch.Generator):
        assert torch.equal(a.get_state(), b.get_state())
    elif isinstance(a, dict):
        assert list(a) == list(b) and getattr(a, "_metadata", None) == getattr(b, "_metadata", None)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def test_a_compact_tree_emptied_as_it_is_decoded_rebuilds_the_same_state() -> None:
    plain, tensors = _parsed(_varied())
    compact, _ = _parsed(_varied(), compact_node)
    tag, items = compact
    assert tag == "$dict" and items[0][0] == "model" and items[0][1][0] == "$dict"
    assert items[0][1][1][0] == ["l0.weight", (compact_tree_name(plain, "model", "l0.weight"),)]
    want = unflatten(plain, tensors)
    named: list[str] = []
    got = unflatten(compact, tensors, named, consume=True)
    _same(got, want)
    assert sorted(set(named)) == sorted(tensors)
    assert items == []  # consumed: every item list emptied as it was decoded
    assert got["model"]["l0.weight"] is tensors[compact_tree_name(plain, "model", "l0.weight")]


def _slots(tensors: dict[str, torch.Tensor]) -> dict[str, TensorSlot]:
    return {n: TensorSlot(n, DTYPE_TO_ST[t.dtype], tuple(t.shape), 0, t.nbytes) for n, t in tensors.items()}


def test_slots_stand_in_for_the_tensors_of_every_node() -> None:
    tree, tensors = _parsed(_varied(), compact_node)
    slots = _slots(tensors)
    skeleton = unflatten(tree, slots)
    assert type(skeleton["param"]) is TensorSlot
    # an array and a generator are values made of a tensor, not the tensor: their own stand-ins
    arr, rng = skeleton["array"], skeleton["rng"]
    assert type(arr) is ValueStandIn and arr.kind is np.ndarray and type(arr.tensor) is TensorSlot
    assert (arr.dtype, arr.shape) == (_varied()["array"].dtype, _varied()["array"].shape)
    assert type(rng) is ValueStandIn and rng.kind is torch.Generator and rng.tensor.dtype == "U8"
    plain, _ = _parsed(_varied())
    assert skeleton["model"]["l3.weight"] is slots[compact_tree_name(plain, "model", "l3.weight")]
    assert type(skeleton["tuple"][0]) is TensorSlot and skeleton["tuple"][1:] == (1, "x", None, 2.5)


@pytest.mark.parametrize(
    "node",
    [
        {"$ndarray": ["t", "object", [2]]},
        {"$ndarray": ["t", "float32", [3]]},
        {"$ndarray": ["t", "int64", [2]]},
        {"$param": [{"$tensor": "t"}, 1]},
        {"$param": [5, True]},
        {"$param": [{"$tuple": []}, True]},
        {"$generator": ["cpu", {"$tensor": "t"}]},
        {"$generator": ["cpu", 5]},
        {"$dict": {"$tensor": "t"}},
        {"$tuple": {"$tensor": "t"}},
        {"$tensor": {"$tensor": "t"}},
        {"$dict": [["k", {"$tensor": "u"}]]},
    ],
    ids=repr,
)
@pytest.mark.parametrize("compact", [False, True], ids=["dict-nodes", "compact"])
def test_malformed_nodes_are_value_errors_over_stand_ins_too(node: Any, compact: bool) -> None:
    tree = json.loads(json.dumps(node), object_hook=compact_node if compact else None)
    stand_in = {"t": TensorSlot("t", "F32", (2,), 0, 8)}
    with pytest.raises(ValueError):
        unflatten(tree, stand_in)
    with pytest.raises(ValueError):
        unflatten(json.loads(json.dumps(node)), {"t": torch.zeros(2)})


def test_tiles_land_every_byte_and_chain_one_crc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_readinto, "BOUNCE", 4096)  # a few bounce buffers' worth: runs are cut
    rng = random.Random(5)
    sizes = [rng.choice([0, 1, 8, 100, 1000, 5000]) for _ in range(300)] + [3 * 4096 + 4, 8]
    data = os.urandom(sum(sizes))
    path = tmp_path / "f"
    path.write_bytes(data)
    fresh = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    dests = _readinto.Destinations()
    at = 0
    skip_at = (10, 11, 12)  # adjacent skips join
    for i, (n, t) in enumerate(zip(sizes, fresh, strict=True)):
        if i in skip_at:
            dests.other(_readinto.Skip(at, n))
        else:
            dests.tensor(at, n, t)
        at += n
    built = dests.done()
    assert sum(isinstance(d, _readinto.Skip) for d in built) == 1
    assert sum(isinstance(d, _readinto.Tiles) for d in built) == 2
    fd = os.open(path, os.O_RDONLY)
    try:
        crc = _readinto.read_into(fd, str(path), built, checksum=True, threads=4)
    finally:
        os.close(fd)
    assert crc == _crc.crc32c(data)
    at = 0
    for i, (n, t) in enumerate(zip(sizes, fresh, strict=True)):
        if i not in skip_at:
            assert bytes(t.numpy()) == data[at : at + n], i
        at += n


def test_a_large_tensor_in_a_run_is_cut_for_every_thread() -> None:
    big = torch.empty(1 << 20, dtype=torch.uint8)
    small = [torch.empty(10, dtype=torch.uint8) for _ in range(3)]
    d = _readinto.Tiles(0, 30 + big.numel(), [*small, big], array("q", [10, 10, 10, big.numel()]))
    groups = _readinto._split([d], 4)
    assert len(groups) == 4
    assert sum(p.nbytes for g in groups for p in g) == d.nbytes
    offsets = [p.offset for g in groups for p in g]
    assert offsets == sorted(offsets) and offsets[0] == 0


@pytest.mark.parametrize("into", [False, True], ids=["fresh", "into"])
@pytest.mark.parametrize("name", ["a", "c"], ids=["a-tensor-twice-b-never", "a-tensor-the-shard-lacks"])
def test_a_tree_that_does_not_name_the_shards_tensors_exactly_is_corrupt(
    tmp_path: Path, into: bool, name: str
) -> None:
    from asyncckpt import CheckpointCorruptError, Checkpointer, load

    state = {"a": torch.ones(2), "b": torch.zeros(2)}
    with Checkpointer(tmp_path) as ck:
        ck.save(1, state).result()
    (tree_file,) = tmp_path.glob("step_*/rank*.json")
    text = tree_file.read_bytes()
    assert text.count(b'{"$tensor":"b"}') == 1
    tree_file.write_bytes(text.replace(b'{"$tensor":"b"}', b'{"$tensor":"%s"}' % name.encode()))  # (same size)
    target = {"a": torch.empty(2), "b": torch.empty(2)} if into else None
    with pytest.raises(CheckpointCorruptError, match="structure and shard disagree on tensor names"):
        load(tmp_path, 1, verify=False, into=target)


def _plain() -> dict[str, Any]:
    g = torch.Generator().manual_seed(4)
    od: collections.OrderedDict[str, Any] = collections.OrderedDict(w=torch.rand(2, generator=g), v=3)
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return {
        "model": {f"l{i}.weight": torch.rand(3, generator=g) for i in range(5)},
        "tied": {"a": None, "b": None},
        "odict": od,
        "dd": collections.defaultdict(list, {"a": torch.ones(1), "n": [1, 2]}),
        "nested": [[{"t": torch.arange(4)}], ("x", 2.5)],
        "iteration": 12345,
    }


def test_a_skeleton_whose_slots_sit_in_mappings_only_is_filled_into_the_very_state_a_second_decode_builds() -> None:
    state = _plain()
    state["tied"]["a"] = state["tied"]["b"] = state["model"]["l0.weight"]
    tree, tensors = _parsed(state, compact_node)
    sites = StandInSites()
    skeleton = unflatten(tree, _slots(tensors), sites=sites)
    assert not sites.elsewhere and sites.maps
    fill_in(sites, tensors)
    _same(skeleton, unflatten(tree, tensors))
    assert skeleton["tied"]["a"] is skeleton["tied"]["b"] is skeleton["model"]["l0.weight"]
    assert type(skeleton["odict"]) is collections.OrderedDict and skeleton["odict"]._metadata == {"": {"version": 1}}
    assert type(skeleton["dd"]) is collections.defaultdict and skeleton["dd"].default_factory is list


@pytest.mark.parametrize("key", ["param", "array", "rng", "tuple", "dd"])
def test_a_slot_outside_a_mapping_is_noted_and_fill_in_refuses(key: str) -> None:
    # a Parameter, an ndarray, a generator's state, a tensor in a tuple or a list: the skeleton holds
    # the slot where the state holds something made of the tensor, or in a container not filled in place
    tree, tensors = _parsed({key: _varied()[key], "plain": torch.ones(1)}, compact_node)
    sites = StandInSites()
    unflatten(tree, _slots(tensors), sites=sites)
    assert sites.elsewhere
    with pytest.raises(ValueError, match="stand-ins outside"):
        fill_in(sites, tensors)


@pytest.mark.parametrize("key", ["model", "param", "array", "rng", "tuple", "odict", "dd", "nested"])
def test_load_into_restores_every_kind_of_node_with_the_tree_decoded_once_or_twice(tmp_path: Path, key: str) -> None:
    from asyncckpt import Checkpointer, load
    from asyncckpt.loading import _load

    decodes: list[int] = []
    real = _load._rebuild

    def counted(*a: Any, **k: Any) -> Any:
        decodes.append(1)
        return real(*a, **k)

    saved = {key: _varied()[key], "step": torch.tensor(3.0)}
    with Checkpointer(tmp_path) as ck:
        ck.save(1, saved).result()
    target = {key: _varied()[key], "step": torch.tensor(0.0)}  # a Parameter target too (read in place)
    for t in (v for v in [target["step"], *_tensors_of(target[key])]):
        t.data.fill_(7) if t.is_floating_point() else t.data.zero_()
    mp = pytest.MonkeyPatch()
    mp.setattr(_load, "_rebuild", counted)
    try:
        load(tmp_path, 1, into=target)
    finally:
        mp.undo()
    if key == "param":
        assert torch.equal(target[key], _varied()[key].detach())
    else:
        _same(target, {key: _varied()[key], "step": torch.tensor(3.0)})
    # the tree is decoded a second time only where a tensor sits outside the state's mappings
    assert len(decodes) == (1 if key in ("param", "array", "rng", "tuple", "dd") else 0)


def _tensors_of(v: Any) -> list[torch.Tensor]:
    """The tensors in ``v``'s dicts, lists and tuples (a module's or generator's: none)."""
    seq = list(v.values()) if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else None
    return [v] if isinstance(v, torch.Tensor) else [t for x in seq or () for t in _tensors_of(x)]


def test_a_run_of_tensors_of_every_kind_lands_every_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the Tiles loop's inline view (numpy dtypes without grad) and byte_view's other cases (bf16, requires_grad,
    # empty, larger than a bounce buffer), a run split across preadv calls, a Direct and a Skip between runs
    monkeypatch.setattr(_readinto, "BOUNCE", 4096)
    kinds = [(torch.float32, 10, False), (torch.bfloat16, 7, False), (torch.float32, 3, True), (torch.uint8, 0, False),
             (torch.float64, 1500, False), (torch.int16, 1, False), (torch.float32, 2000, True)]  # fmt: skip
    tensors = [torch.zeros(n, dtype=dt, requires_grad=g) for dt, n, g in kinds * 5]
    sizes = [t.nbytes for t in tensors]
    data = os.urandom(sum(sizes) + 100)
    path = tmp_path / "f"
    path.write_bytes(data)
    dests = _readinto.Destinations()
    at = 0
    for i, (t, n) in enumerate(zip(tensors, sizes, strict=True)):
        if i == 9:
            dests.other(_readinto.Skip(at, n))
        elif i == 20:
            dests.other(_readinto.Direct(at, _readinto.byte_view(t)))
        else:
            dests.tensor(at, n, t)
        at += n
    dests.tensor(at, 100, last := torch.zeros(100, dtype=torch.uint8))
    fd = os.open(path, os.O_RDONLY)
    try:
        crc = _readinto.read_into(fd, str(path), dests.done(), checksum=True, threads=1)
    finally:
        os.close(fd)
    assert crc == _crc.crc32c(data)
    at = 0
    for i, (t, n) in enumerate(zip(tensors, sizes, strict=True)):
        if i != 9:
            assert bytes(t.detach().reshape(-1).view(torch.uint8).numpy()) == data[at : at + n], i
        at += n
    assert bytes(last.numpy()) == data[at:]


def _targets_of_every_kind() -> list[torch.Tensor]:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with torch.inference_mode():
        inference = torch.zeros(3, 4)
    return [base, base.clone().requires_grad_(), torch.nn.Parameter(base.clone()), base.t().contiguous(),
            base.t(), base[:, :2], torch.zeros(1, 4).expand(3, 4), torch.zeros(0, 4), torch.zeros(0, 1).expand(0, 4),
            torch.zeros(3, 4, dtype=torch.complex64).conj(), torch._neg_view(base), inference, base.double(),
            torch.zeros(4, 3), base.to_sparse(), torch.zeros(1, 4)[:, None].squeeze(1).expand(3, 4)]  # fmt: skip


@pytest.mark.parametrize("i", range(len(_targets_of_every_kind())))
def test_a_plain_targets_span_in_one_visit_is_what_fits_and_span_give(i: int) -> None:
    from asyncckpt.loading import _targets

    t = _targets_of_every_kind()[i]
    for dtype in (torch.float32, torch.complex64):
        for shape in ((3, 4), tuple(t.shape)):
            want = (t.get_device(), *_targets._span(t)) if _targets._fits(t, dtype, shape) else None
            plain = want is not None and t.is_cpu and t.is_contiguous() and t.nbytes > 0
            assert _targets._plain_span(t, dtype, shape) == (want if plain else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn])
@pytest.mark.parametrize("grad", [False, True], ids=["plain", "requires-grad"])
def test_a_raw_view_is_the_tensors_own_bytes_writable(dtype: torch.dtype, grad: bool) -> None:
    for shape in [(), (3,), (2, 5)]:
        t = torch.zeros(shape, dtype=torch.float32).to(dtype)
        if grad and dtype.is_floating_point and dtype in (torch.float32, torch.bfloat16):
            t.requires_grad_()
        view = _readinto.raw_view(t, t.nbytes)
        assert len(view) == t.nbytes and not view.readonly and view.format == "B"
        view[:] = bytes(range(1, t.nbytes + 1))
        assert bytes(_readinto.byte_view(t)) == bytes(range(1, t.nbytes + 1))
