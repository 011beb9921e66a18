"""Tied DTensors (GPT-2's ``lm_head.weight`` is ``wte.weight``) under FSDP2, real gloo ranks:
stored once, even where a rank's local shard is empty and cannot show the tie; tied again
after a resharded load and after a load without a process group; exported once; ranks that
disagree on a tie fail the save instead of writing an inconsistent index."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import asyncckpt
from asyncckpt.format import _index
from asyncckpt.loading._verify import verify_step

HERE = Path(__file__).parent
WORKER = str(HERE / "support" / "_tied_worker.py")
sys.path.insert(0, str(HERE / "support"))
from _global_worker import same  # noqa: E402
from _ranks import free_port, log_tail, run_ranks  # noqa: E402
from _tied_worker import DIM, VOCAB  # noqa: E402

STEP = "step_00000001"
pytestmark = pytest.mark.timeout(240)


def spawn(tmp: Path, scenario: str, world: int, root: Path, out: Path) -> dict[int, dict[str, Any]]:
    logs = tmp / f"logs-{scenario}-{world}"
    logs.mkdir()
    port = str(free_port())
    argv = [scenario, str(world), port, str(root), str(out)]
    hung = run_ranks(lambda r: [WORKER, argv[0], str(r), *argv[1:]], world, logs, 150.0, warm=True)
    assert not hung, f"ranks {hung} still running at the deadline"
    res = {}
    for r in range(world):
        f = Path(f"{out}.{r}.json")
        assert f.exists(), f"rank {r} wrote no result:\n{log_tail(logs, r)}"
        res[r] = json.loads(f.read_text())
        assert "crash" not in res[r], res[r]["crash"]
    return res


@pytest.fixture(scope="module")
def saved_on_4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[int, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("tied")
    root, out = tmp / "ck", tmp / "out"
    return root, out, spawn(tmp, "save", 4, root, out)


def test_tied_dtensor_is_stored_once(saved_on_4: Any) -> None:
    root, _, res = saved_on_4
    assert [res[r]["local_rows"] for r in range(4)] == [1, 1, 1, 0]  # rank 3: an empty shard
    index = json.loads((root / STEP / "index.json").read_text())
    assert index["aliases"] == {"model.lm_head.weight": "model.wte.weight"}
    assert "model.lm_head.weight" not in index["tensors"]
    chunks = index["tensors"]["model.wte.weight"]["chunks"]
    assert sum(c[4] for c in chunks) == VOCAB * DIM * 4  # every byte of the tied weight once
    for r in range(4):
        with safe_open(str(root / STEP / f"rank{r:05d}.safetensors"), "pt") as f:
            assert "model.lm_head.weight" not in f.keys()
    assert verify_step(str(root), 1, record=False) == []
    print(f"\nrank 3's empty local shard lies over {res[3]['local_storage_bytes']} bytes of storage")


def test_resharded_load_on_2_keeps_the_tie_and_is_bit_equal(saved_on_4: Any, tmp_path: Path) -> None:
    root, out, _ = saved_on_4
    res = spawn(tmp_path, "load", 2, root, out)
    assert all(res[r]["still_tied"] for r in range(2))
    assert res[0]["diff"] == []


def test_load_without_a_process_group_returns_one_shared_tensor(saved_on_4: Any) -> None:
    root, out, _ = saved_on_4
    ref = torch.load(f"{out}.ref.pt")
    loaded = asyncckpt.load(root)
    model = loaded["model"]
    assert model["lm_head.weight"] is model["wte.weight"]
    assert same({"model": model, "optim": loaded["optim"]}, ref) == []


def test_export_writes_the_tied_weight_once(saved_on_4: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_model

    sys.path.insert(0, str(HERE / "support"))
    from _tied_worker import TiedLM

    root, out, _ = saved_on_4
    dest = tmp_path / "model.safetensors"
    from asyncckpt.cli import main

    assert main(["export", str(root), "--key", "model", "--to", str(dest)]) == 0
    with safe_open(str(dest), "pt") as f:
        assert sorted(f.keys()) == ["lm_head.weight", "mid.bias", "mid.weight"]  # save_model's choice
    model = TiedLM()
    load_model(model, str(dest), strict=True)
    assert model.lm_head.weight is model.wte.weight
    ref = torch.load(f"{out}.ref.pt")["model"]
    assert torch.equal(model.wte.weight.detach(), ref["wte.weight"])


def _part(rank: int, tensors: dict[str, Any], aliases: dict[str, str] | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"file": f"rank{rank:05d}.safetensors", "tensors": tensors, "plain": []}
    part["block"] = _index.BLOCK
    if aliases:
        part["aliases"] = aliases
    return part


def _entry(chunk: Any) -> dict[str, Any]:
    return {"dtype": "F32", "shape": [2, 2], "placements": ["S(0)"], "mesh": [2], "chunk": chunk}


def test_merge_takes_an_empty_untied_entry_and_refuses_a_disagreement() -> None:
    row = [[0, 0], [1, 2], 100, 8, 1, [1]]
    row2 = [[1, 0], [1, 2], 100, 8, 2, [2]]
    # rank 1 could not see the tie (its shard of both is empty of storage): accepted
    parts = {
        0: _part(0, {"w": _entry(row)}, {"h": "w"}),
        1: _part(1, {"w": _entry(row2), "h": _entry(None)}),
    }
    doc = json.loads(_index.merge(2, parts))
    assert doc["aliases"] == {"h": "w"} and set(doc["tensors"]) == {"w"}
    # rank 1 wrote bytes of "h" as a tensor of its own: the ranks disagree
    parts[1] = _part(1, {"w": _entry(row2), "h": _entry(row2)})
    with pytest.raises(ValueError, match="disagree on whether DTensor 'h' is tied"):
        _index.merge(2, parts)
    parts[1] = _part(1, {"w": _entry(row2)}, {"h": "other"})
    with pytest.raises(ValueError, match="disagree on DTensor 'h'"):
        _index.merge(2, parts)


def test_hostile_index_aliases_are_refused(saved_on_4: Any, tmp_path: Path) -> None:
    import shutil

    from test_sharded_state import _rewrite_index  # the block tests' helper: reseals the manifest

    root, _, _ = saved_on_4
    for n, aliases in enumerate([{"model.lm_head.weight": "model.nowhere"}, {"model.mid.weight": "model.wte.weight"}]):
        copy = tmp_path / f"ck{n}"
        shutil.copytree(root, copy)
        _rewrite_index(copy, lambda doc, a=aliases: doc.__setitem__("aliases", a))
        with pytest.raises(asyncckpt.CheckpointCorruptError, match="names no single stored DTensor"):
            asyncckpt.load(copy, step=1)
