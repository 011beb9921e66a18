"""Every supported value round-trips through a real checkpoint as exactly what was saved;
everything else is refused at save() with a hint how to convert it."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import enum
import json
import pathlib
import re
import zoneinfo
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from asyncckpt import Checkpointer, load
from asyncckpt.format._structure_decode import unflatten
from asyncckpt.format._structure_encode import flatten

NP_DTYPES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
]  # fmt: skip


def roundtrip(tmp_path: Path, value: Any) -> Any:
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"v": value}).result(timeout=60)
    return load(tmp_path / "ck")["v"]


def same(a: Any, b: Any) -> None:
    """Equal in type and value, all the way down."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    elif not isinstance(a, (set, frozenset)) and a != a:  # NaN somewhere: same spelling
        assert repr(a) == repr(b)
    else:
        assert a == b


def sample(dtype: str) -> np.ndarray[Any, Any]:
    base = np.arange(12).reshape(3, 4) % 2 if dtype == "bool" else np.arange(12).reshape(3, 4)
    a = base.astype(dtype)
    if dtype.startswith("complex"):
        a = a + 1j * a[::-1]
    return a


@pytest.mark.parametrize("dtype", NP_DTYPES)
def test_ndarray_of_every_shared_dtype(tmp_path: Path, dtype: str) -> None:
    a = sample(dtype)
    got = roundtrip(tmp_path, a)
    same(got, a)
    assert got.flags.writeable


def test_ndarray_shapes_and_views(tmp_path: Path) -> None:
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    ro = np.arange(5, dtype=np.int64)
    ro.flags.writeable = False
    value = {
        "scalar0d": np.array(3.5),
        "empty": np.zeros((0, 3), dtype=np.int16),
        "strided": a[:, ::2, 1:],  # not contiguous
        "fortran": np.asfortranarray(a),
        "readonly": ro,
        "nan": np.array([np.nan, np.inf, -np.inf]),
        "c128_0d": np.array(1 + 2j),
    }
    got = roundtrip(tmp_path, value)
    same(got, value)


def test_ndarray_is_stored_as_tensor_data_and_staged_from_a_view(tmp_path: Path) -> None:
    a = np.arange(1000, dtype=np.float32)
    tree, refs = flatten({"a": a})
    assert tree == {"$dict": [["a", {"$ndarray": ["a", "float32", [1000]]}]]}
    # zero-copy: the staged tensor shares the array's memory
    assert refs[0].tensor.data_ptr() == a.ctypes.data
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"a": a}).result(timeout=60)
    header = (tmp_path / "ck" / "step_00000001" / "rank00000.safetensors").read_bytes()
    n = int.from_bytes(header[:8], "little")
    assert json.loads(header[8 : 8 + n])["a"]["dtype"] == "F32"


@pytest.mark.parametrize("dtype", NP_DTYPES)
def test_numpy_scalar_of_every_shared_dtype(tmp_path: Path, dtype: str) -> None:
    x = sample(dtype).reshape(-1)[7]
    assert isinstance(x, np.generic)
    same(roundtrip(tmp_path, x), x)


def test_numpy_scalar_extremes(tmp_path: Path) -> None:
    value = [np.uint64(2**64 - 1), np.int64(-(2**63)), np.float32(np.nan), np.float16(-np.inf), np.float64(0.1)]
    same(roundtrip(tmp_path, value), value)


def test_numpy_global_rng_state_resumes_the_stream(tmp_path: Path) -> None:
    np.random.seed(1234)
    np.random.rand(3)
    state = np.random.get_state()
    expect = np.random.rand(5)
    got = roundtrip(tmp_path, state)
    same(got, state)
    np.random.set_state(got)
    assert np.array_equal(np.random.rand(5), expect)


@pytest.mark.parametrize(
    "bitgen", [np.random.PCG64, np.random.PCG64DXSM, np.random.Philox, np.random.SFC64, np.random.MT19937]
)
def test_numpy_generator_state_resumes_the_stream(tmp_path: Path, bitgen: Any) -> None:
    g = np.random.Generator(bitgen(7))
    g.random(3)
    state = g.bit_generator.state
    expect = g.random(5)
    got = roundtrip(tmp_path, state)
    same(got, state)
    h = np.random.Generator(bitgen())
    h.bit_generator.state = got
    assert np.array_equal(h.random(5), expect)


def test_python_random_state(tmp_path: Path) -> None:
    import random

    r = random.Random(5)
    state = r.getstate()
    same(roundtrip(tmp_path, state), state)


def test_ordered_dict_keeps_order_and_metadata(tmp_path: Path) -> None:
    od = collections.OrderedDict([("z", 1), ("a", 2)])
    od._metadata = collections.OrderedDict([("", {"version": 3})])  # type: ignore[attr-defined]
    got = roundtrip(tmp_path, od)
    same(got, od)
    assert got._metadata == {"": {"version": 3}}


class Versioned(torch.nn.Module):
    """A module that upgrades old state in _load_from_state_dict, as BatchNorm does."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))
        self.seen: list[Any] = []

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, *args: Any) -> None:
        self.seen.append(local_metadata.get("version"))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def test_module_state_dict_metadata_reaches_load_state_dict(tmp_path: Path) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), Versioned())
    sd = net.state_dict()
    got = roundtrip(tmp_path, sd)
    assert type(got) is collections.OrderedDict
    assert got._metadata == sd._metadata  # type: ignore[attr-defined]
    fresh = torch.nn.Sequential(torch.nn.Linear(2, 2), Versioned())
    fresh.load_state_dict(got)
    assert fresh[1].seen == [2]
    # and through load(into=): the module gets the saved version too
    with Checkpointer(tmp_path / "ck2") as ck:
        ck.save(1, {"model": net}).result(timeout=60)
        other = torch.nn.Sequential(torch.nn.Linear(2, 2), Versioned())
        ck.load(into={"model": other})
    assert other[1].seen == [2]


@pytest.mark.parametrize("factory", [None, list, int, dict, set, str])
def test_defaultdict_of_builtin_factory(tmp_path: Path, factory: Any) -> None:
    d: collections.defaultdict[Any, Any] = collections.defaultdict(factory)
    d["x"] = factory() if factory is not None else 1
    got = roundtrip(tmp_path, d)
    same(got, d)
    assert got.default_factory is factory


def test_parameter_comes_back_as_parameter(tmp_path: Path) -> None:
    value = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.ones(2), requires_grad=False)]
    got = roundtrip(tmp_path, value)
    same(got, value)
    assert [p.requires_grad for p in got] == [True, False]


def test_parameters_load_into_parameters_in_place_and_the_step_stays_good(tmp_path: Path) -> None:
    # load(into=) with Parameter targets (a model's named_parameters()) was refused as "malformed
    # $param tensor", and the refusal marked the good step bad: a plain load() then failed too
    model = torch.nn.Linear(3, 2)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": dict(model.named_parameters())}).result(timeout=60)
    fresh = torch.nn.Linear(3, 2)
    targets = dict(fresh.named_parameters())
    got = load(tmp_path / "ck", into={"model": targets})
    for name, p in model.named_parameters():
        assert got["model"][name] is targets[name]  # the caller's own Parameter, filled in place
        assert torch.equal(targets[name].detach(), p.detach()) and targets[name].requires_grad
    assert torch.equal(load(tmp_path / "ck")["model"]["weight"], model.weight.detach())


def _generator_state_shape() -> tuple[int, ...]:
    return tuple(torch.Generator().get_state().shape)


@pytest.mark.parametrize(
    ("key", "target", "message"),
    [
        # a tensor of the saved tensor's shape where the checkpoint holds an array or a generator:
        # it was read into in place (its bytes overwritten) and then refused, or worse ...
        ("a", lambda: torch.zeros(2, 3), "checkpoint holds ndarray, target is a tensor"),
        ("a", lambda: torch.nn.Parameter(torch.zeros(2, 3)), "checkpoint holds ndarray, target is a tensor"),
        # ... a Parameter in place of a generator's state made the decoder refuse the *file*
        # ("malformed $generator state"): the good step was marked bad and no load took it again
        ("g", lambda: torch.nn.Parameter(torch.zeros(_generator_state_shape(), dtype=torch.uint8), requires_grad=False),
         "checkpoint holds Generator, target is a tensor"),
        ("a", lambda: np.zeros((3, 2), np.float32), "checkpoint holds float32[2, 3], target is an array float32[3, 2]"),
        ("a", lambda: np.zeros((2, 3), np.float64), "checkpoint holds float32[2, 3], target is an array float64[2, 3]"),
        ("w", lambda: np.zeros(3, np.float32), "checkpoint holds Tensor, target is an array float32[3]"),
        ("w", torch.Generator, "checkpoint holds Tensor, target is a torch.Generator"),
    ],
    ids=["tensor-for-array", "param-for-array", "param-for-generator", "array-shape", "array-dtype",
         "array-for-tensor", "generator-for-tensor"],
)  # fmt: skip
def test_a_target_of_another_kind_is_refused_before_any_read_and_the_step_stays_good(
    tmp_path: Path, key: str, target: Any, message: str
) -> None:
    g = torch.Generator()
    g.manual_seed(3)
    saved = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "g": g, "w": torch.ones(3)}
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, saved).result(timeout=60)
    into = {"a": np.full((2, 3), 7, np.float32), "g": torch.Generator(), "w": torch.full((3,), 7.0)}
    into[key] = target()
    before = {
        k: (v.get_state() if isinstance(v, torch.Generator) else torch.as_tensor(v).clone()) for k, v in into.items()
    }
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        load(tmp_path / "ck", into=into)
    assert "corrupt" not in str(err.value) and "malformed" not in str(err.value)
    for k, v in into.items():  # refused before the first byte was read: every target as it was
        assert torch.equal(_bytes_of(v), before[k]), k
    got = load(tmp_path / "ck")  # the step is still good: a bad mark would refuse this load
    assert np.array_equal(got["a"], saved["a"]) and torch.equal(got["g"].get_state(), g.get_state())


def _bytes_of(v: Any) -> torch.Tensor:
    return v.get_state() if isinstance(v, torch.Generator) else torch.as_tensor(v).detach()


@pytest.mark.parametrize(
    "value",
    [
        torch.Size([2, 3, 0]),
        torch.Size([]),
        torch.float32,
        torch.bfloat16,
        torch.complex128,
        torch.device("cpu"),
        torch.device("cuda", 1),
        torch.device("meta"),
        complex(1.5, -2),
        complex(float("nan"), float("inf")),
        {1, "a", (2, 3), None, 2.5},
        set(),
        frozenset({b"x", frozenset({1})}),
        bytearray(b"\x00\xff"),
        pathlib.PurePosixPath("/a/b c"),
        pathlib.PureWindowsPath(r"C:\data\x.bin"),
        pathlib.Path("rel/dir"),
        datetime.date(2024, 2, 29),
        datetime.timedelta(days=-3, seconds=5, microseconds=7),
        datetime.datetime(2024, 1, 2, 3, 4, 5, 678901),
        datetime.datetime(2024, 1, 2, tzinfo=datetime.timezone.utc),
        datetime.datetime(2024, 1, 2, tzinfo=datetime.timezone(datetime.timedelta(hours=-5, microseconds=3))),
        datetime.datetime(2024, 1, 2, tzinfo=datetime.timezone(datetime.timedelta(hours=1), "CET")),
        datetime.datetime(2024, 10, 27, 2, 30, fold=1, tzinfo=zoneinfo.ZoneInfo("Europe/Berlin")),
    ],
    ids=repr,
)
def test_plain_values_roundtrip_exactly(tmp_path: Path, value: Any) -> None:
    got = roundtrip(tmp_path, value)
    same(got, value)
    if isinstance(value, datetime.datetime):
        assert got.fold == value.fold and got.tzname() == value.tzname() and got.utcoffset() == value.utcoffset()
    if isinstance(value, (set, frozenset)):
        assert {type(x) for x in got} == {type(x) for x in value}


def test_torch_generator_resumes_its_stream(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    torch.rand(2, generator=g)
    expect = torch.rand(4, generator=torch.Generator().set_state(g.get_state()))
    got = roundtrip(tmp_path, g)
    assert type(got) is torch.Generator and got.device == torch.device("cpu")
    assert torch.equal(torch.rand(4, generator=got), expect)
    # load(into=) sets the target generator's state in place
    target = torch.Generator()
    with Checkpointer(tmp_path / "ck2") as ck:
        ck.save(1, {"g": g}).result(timeout=60)
        ck.load(into={"g": target})
    assert torch.equal(torch.rand(4, generator=target), expect)


def test_load_into_restores_arrays_in_place_and_replaces_values(tmp_path: Path) -> None:
    a = np.arange(4.0)
    state = {"arr": a, "when": datetime.date(2020, 1, 1), "tags": {"x"}}
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state).result(timeout=60)
        target = {"arr": np.zeros(4), "when": None, "tags": set()}
        buf = target["arr"]
        ck.load(into=target)
    assert target["arr"] is buf and np.array_equal(buf, a)
    assert target["when"] == datetime.date(2020, 1, 1) and target["tags"] == {"x"}
    with pytest.raises(ValueError, match="target is an array"):
        from asyncckpt.loading._restore import restore_into

        restore_into({"arr": np.zeros(3)}, {"arr": a})


# ---------------------------------------------------------------- refusals


class Color(enum.Enum):
    RED = 1


class Level(enum.IntEnum):
    HIGH = 2


@dataclasses.dataclass
class Cfg:
    lr: float = 0.1


class Pt(NamedTuple):
    x: int
    y: int


class MyInt(int):
    pass


class MyDict(dict):  # type: ignore[type-arg]
    pass


class OwnZone(datetime.tzinfo):
    def utcoffset(self, dt: datetime.datetime | None) -> datetime.timedelta:
        return datetime.timedelta(hours=2)


def _factory() -> int:
    return 0


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        (Cfg(), "dataclasses.asdict(x)"),
        (argparse.Namespace(lr=1), "vars(x)"),
        (Color.RED, "x.value"),
        (Level.HIGH, "x.value"),
        (Pt(1, 2), "x._asdict()"),
        (MyInt(3), "save int(x)"),
        (MyDict(a=1), "save dict(x)"),
        (collections.defaultdict(_factory), "save dict(x)"),
        (collections.defaultdict(lambda: 0), "save dict(x)"),
        (np.random.default_rng(1), "x.bit_generator.state"),
        (np.random.RandomState(1), "x.get_state()"),
        (np.array(["a", "b"]), "x.tolist()"),
        (np.array([object()], dtype=object), "x.tolist()"),
        (np.array([1.0], dtype=np.longdouble), "x.astype("),
        (np.array([1.0], dtype=">f4"), "x.astype("),
        (np.array(["2024-01-01"], dtype="datetime64[D]"), "x.astype("),
        (np.ma.masked_array([1, 2]), "np.asarray(x)"),
        (np.str_("s"), "x.item()"),
        (np.longdouble(1), "x.item()"),
        (datetime.time(1, 2), "isoformat()"),
        (datetime.datetime(2024, 1, 1, tzinfo=OwnZone()), "astimezone"),
        ({(1, 2)}, None),
        (pathlib.PurePath, "state_dict()"),
    ],
    ids=lambda v: type(v).__name__,
)
def test_unsupported_values_are_refused_with_a_hint(tmp_path: Path, value: Any, hint: str | None) -> None:
    if hint is None:  # a set of tuples is fine: the control row
        same(roundtrip(tmp_path, value), value)
        return
    with Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(TypeError, match=r"at 'outer\.v'") as info:
            ck.save(1, {"outer": {"v": value}})
        assert hint in str(info.value)
        assert ck.steps() == []


def test_dict_key_subclasses_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="dict key"):
        flatten({Level.HIGH: 1})
    with pytest.raises(TypeError, match="dict key"):
        flatten({np.int64(1): 1})


def test_a_tensor_under_a_key_that_is_not_utf8_is_refused_naming_it(tmp_path: Path) -> None:
    # tensor names go into the shard's UTF-8 header; other values may hold any str
    with Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(ValueError, match=r"tensor at 'a\.\\udc80x'.*not valid UTF-8"):
            ck.save(1, {"a": {"\udc80x": torch.ones(2)}})
        with pytest.raises(ValueError, match="not valid UTF-8"):
            ck.reserve({"\ud800": torch.ones(2)})
        assert ck.steps() == []
        state = {"t": torch.ones(2), "s": "\udcff", "k": {"\ud800": 1.5}}
        ck.save(2, state).result(timeout=60)
        same(ck.load(2), state)


def test_ordered_dict_with_other_attributes_is_refused() -> None:
    od: Any = collections.OrderedDict(a=1)
    od.extra = 5
    with pytest.raises(TypeError, match="only _metadata"):
        flatten(od)


# ---------------------------------------------------------------- hostile trees


@pytest.mark.parametrize(
    "node",
    [
        {"$ndarray": ["t", "object", [2]]},
        {"$ndarray": ["t", "float32", [3]]},
        {"$ndarray": ["t", "int64", [2]]},
        {"$ndarray": ["t", "float32", [-2]]},
        {"$np": ["object", 1]},
        {"$np": ["int8", 1000]},
        {"$np": ["float32", "x"]},
        {"$dtype": "onnx"},
        {"$dtype": "Tensor"},
        {"$device": "nowhere:7"},
        {"$path": ["WindowsPath", "x"]},
        {"$path": ["os.system", "x"]},
        {"$defaultdict": ["os.system", []]},
        {"$set": [[1]]},
        {"$datetime": ["2024-01-01T00:00:00+01:00", 0, None]},
        {"$datetime": ["2024-01-01", 2, None]},
        {"$datetime": ["2024-01-01", 0, ["zone", "../../etc/passwd"]]},
        {"$timedelta": [10**10, 0, 0]},
        {"$param": [{"$tensor": "t"}, 1]},
        {"$generator": ["cpu", {"$tensor": "t"}]},
        {"$odict": [[], 5]},
        {"$size": [-1]},
        {"$complex": ["a", 0]},
    ],
    ids=repr,
)
def test_malformed_new_nodes_are_value_errors(node: Any) -> None:
    with pytest.raises(ValueError):
        unflatten(node, {"t": torch.zeros(2, dtype=torch.float32)})


def test_cli_info_and_verify_read_every_value_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from asyncckpt.cli import main

    state = {
        "model": torch.nn.Linear(2, 2),
        "arr": np.arange(6.0).reshape(2, 3),
        "c128": np.ones(2, np.complex128),
        "p": torch.nn.Parameter(torch.ones(2)),
        "g": torch.Generator(),
        "np_rng": np.random.get_state(),
        "dd": collections.defaultdict(list, a=[1]),
        "misc": [np.float32(1), 1j, {1}, frozenset(), torch.Size([2]), torch.int8, torch.device("cpu")],
        "when": [datetime.date(2020, 1, 1), datetime.timedelta(1), datetime.datetime(2020, 1, 1), pathlib.Path("x")],
    }
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state).result(timeout=60)
    assert main(["verify", str(tmp_path / "ck")]) == 0
    assert main(["info", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "numpy.float64 [2, 3]" in out and "weight" in out and "set (1 item)" in out
    assert main(["info", "--json", str(tmp_path / "ck")]) == 0
