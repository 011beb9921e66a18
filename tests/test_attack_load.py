"""Save and load memory paths under hostile but legal input: keys with odd unicode, escapes,
very long names and int keys, nested empty containers, a structure file far over 16 MiB; and
``load(into=)`` into targets that do not fit the checkpoint (another shape, a key the
checkpoint lacks, a tensor where it holds a dict): a typed error before the first byte is
read, every target as it was (main raised the same error only after the tensors before the
mismatch had been read into)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import Checkpointer
from asyncckpt.loading._restore import MissingKeyError

ODD_KEYS = ['é\u2028"\\ \x00', "\U0001f600", "k" * 5000, "a.b", "", " ", "\n\t", "$tensor", "$dict", "{}", "\x7f\x1f"]


def same(a: Any, b: Any, path: str = "") -> None:
    """``a`` and ``b`` equal as states: tensors by value, containers by type, keys in order."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
        return
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}/{k!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}/{i}")
    else:
        assert a == b, path


def odd_state() -> dict[Any, Any]:
    state: dict[Any, Any] = {k: torch.full((2,), float(i)) for i, k in enumerate(ODD_KEYS)}
    state.update({5: torch.ones(1), -1: torch.zeros(1), 10**30: torch.ones(2)})
    state["nest"] = {"a": {}, "b": [], "c": (), "d": {"e": {"f": {}}}, "g": [[], [{}]],
                     "h": collections.OrderedDict(), "i": collections.defaultdict(list)}  # fmt: skip
    state["tup"] = (torch.ones(1), (torch.zeros(1),))
    return state


def test_odd_keys_and_nested_empties_round_trip_fresh_and_into(tmp_path: Path) -> None:
    state = odd_state()
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state).result(timeout=60)
    same(state, asyncckpt.load(tmp_path / "ck"))
    into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    into["tup"] = (torch.zeros(1), (torch.ones(1),))
    same(state, asyncckpt.load(tmp_path / "ck", into=into))
    for k in ODD_KEYS:
        assert torch.equal(into[k], state[k]), repr(k)


def test_a_tensor_keyed_by_a_lone_surrogate_is_refused_at_save_values_keep_it(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(ValueError, match="lone surrogate"):
        ck.save(1, {"\ud800": torch.ones(1)})
    with Checkpointer(tmp_path / "ck2") as ck:
        ck.save(1, {"x": {"\ud800": 1, "s": "a\udfffb"}, "w": torch.ones(1)}).result(timeout=60)
    assert asyncckpt.load(tmp_path / "ck2")["x"] == {"\ud800": 1, "s": "a\udfffb"}


def test_a_structure_file_over_16_mib_saves_and_loads(tmp_path: Path) -> None:
    """40,000 tensors with 400-character names needing escapes, and a 4 MiB string: a
    structure file of ~24 MiB, loaded fresh and into targets."""
    state: dict[str, Any] = {("k" * 390) + f'{i:08d}é"': torch.full((1,), float(i)) for i in range(40_000)}
    state["meta"] = {"s": "x" * (4 << 20)}
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(1, state).result(timeout=120)
    assert (root / "step_00000001" / "rank00000.json").stat().st_size > 16 << 20
    got = asyncckpt.load(root)
    assert got["meta"] == state["meta"] and list(got) == list(state)
    assert all(torch.equal(got[k], v) for k, v in state.items() if k != "meta")
    into = {k: torch.zeros(1) for k in state if k != "meta"}
    asyncckpt.load(root, into=into)
    assert all(torch.equal(into[k], state[k]) for k in into)


def saved(tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(1, {"x": {"n": 1}, "w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
                    "i": torch.arange(3)}).result(timeout=60)  # fmt: skip
    return root


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"w": torch.zeros(3, 2)}, ValueError, r"w: shape \(2, 3\) in checkpoint, \(3, 2\) in target"),
        ({"w": torch.zeros(7)}, ValueError, r"w: shape \(2, 3\) in checkpoint, \(7,\) in target"),
        ({"zz": torch.zeros(1)}, MissingKeyError, "zz is not in the checkpoint"),
        ({"x": torch.zeros(1)}, ValueError, "x: checkpoint holds dict, target is a tensor"),
        ({"x": [torch.zeros(1)]}, ValueError, "x: sequence length or type differs from the checkpoint"),
    ],
    ids=["shape", "numel", "missing-key", "tensor-for-dict", "list-for-dict"],
)
def test_a_load_into_targets_that_do_not_fit_raises_before_writing_any(
    tmp_path: Path, change: dict[str, Any], error: type[Exception], match: str
) -> None:
    root = saved(tmp_path)
    into: dict[str, Any] = {"x": {}, "w": torch.full((2, 3), 7.0), "b": torch.full((4,), 7.0, dtype=torch.bfloat16),
                            "i": torch.full((3,), 7)}  # fmt: skip
    into.update(change)
    before = {k: v.clone() for k, v in into.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(error, match=match) as caught:
        asyncckpt.load(root, into=into)
    assert "partly overwritten" not in str(caught.value)
    assert [k for k, v in before.items() if not torch.equal(v, into[k])] == []
    with Checkpointer(root) as ck, pytest.raises(error, match=match):
        ck.load(1, into=into)
    assert [k for k, v in before.items() if not torch.equal(v, into[k])] == []
