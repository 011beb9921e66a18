"""``load(into=)`` of an indexed step (DTensors, deduplicated tensors) into targets that do not
fit it (a key the step lacks, a tensor of another shape, a DTensor of another shape or
dtype) refuses before it writes any target, as a step without an index does: every target
keeps its bytes (bit for bit), on real gloo ranks and on one process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _ranks import free_port, results, run_ranks

import asyncckpt
from asyncckpt import CheckpointError

WORKER = str(Path(__file__).parent / "support" / "_unfit_worker.py")
STEP = "step_00000001"


def spawn(tmp: Path, scenario: str, root: Path, out: Path, world: int = 2) -> dict[int, dict[str, Any]]:
    logs = tmp / f"logs-{scenario}"
    logs.mkdir()
    port = free_port()

    def args(r: int) -> list[str]:
        return [WORKER, scenario, str(r), str(world), str(port), str(root), str(out)]

    hung = run_ranks(args, world, logs, 120.0, warm=True)
    assert not hung, f"ranks {hung} still running at the deadline"
    return results(out, world, logs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("unfit")
    root, out = tmp / "ck", tmp / "out"
    spawn(tmp, "save", root, out)
    dt, dd = Path(f"{root}-dt"), Path(f"{root}-dd")
    assert (dt / STEP / "index.json").exists()
    index = json.loads((dd / STEP / "index.json").read_text())
    assert index["dedupe"]["copies_not_written"] > 0  # the large tensor is written once
    return root, out


#: case -> (the error's type names it must have, a part of its message)
EXPECTED = {
    "missing": (("CheckpointError", "KeyError"), "zz_not_saved is not in the checkpoint"),
    "plain_shape": (("ValueError",), "in checkpoint"),
    "dtensor_shape": (("ValueError",), "tp.s1"),
    "dtensor_dtype": (("ValueError",), "tp.s0"),
}


@pytest.mark.timeout(200)
def test_unfit_targets_of_an_indexed_step_are_refused_on_every_rank_before_any_write(
    saved: tuple[Path, Path], tmp_path: Path
) -> None:
    root, out = saved
    res = spawn(tmp_path, "load", root, out)
    for r, got in res.items():
        for kind in ("dt", "dd"):
            fit = got[f"{kind}_fit"]
            # teeth: targets that fit are written (the DTensors' local shards in place)
            assert fit["error"] is None and fit["equal"] and not fit["unchanged"], (r, kind, fit)
        cases = [k for k in got if k.startswith(("dt_", "dd_")) and not k.endswith("_fit")]
        assert len(cases) == 6, cases
        for case in cases:
            one = got[case]
            types, text = EXPECTED[case[3:]]
            assert one["error"] is not None and set(types) <= set(one["mro"]), (r, case, one)
            assert text in one["msg"], (r, case, one)
            assert one["unchanged"], f"rank {r}, {case}: a target was written before the refusal: {one}"
            assert "partly overwritten" not in one["msg"], (r, case, one)


def _plain_dt_targets(extra: dict[str, Any]) -> dict[str, Any]:
    return {"tp": {"s0": torch.full((6, 8), 0.5), "s1": torch.full((6, 8), 0.5), "rep": torch.full((8,), 0.5)},
            "own": torch.full((3,), 0.5), **extra}  # fmt: skip


@pytest.mark.parametrize(
    ("step", "target", "error", "text"),
    [
        ("dt", _plain_dt_targets({"zz_not_saved": torch.zeros(2)}), KeyError, "zz_not_saved is not in the checkpoint"),
        ("dt", _plain_dt_targets({"own": torch.zeros(4)}), ValueError, "own: shape (3,) in checkpoint, (4,) in target"),
        ("dd", {"big": torch.zeros(256, 1024), "small": torch.zeros(5), "own": torch.zeros(3), "zz_not_saved": 1},
         KeyError, "zz_not_saved is not in the checkpoint"),
        ("dd", {"big": torch.zeros(256, 1024), "own": torch.zeros(2)}, ValueError, "own: shape (3,) in checkpoint"),
    ],
    ids=["dt-missing", "dt-shape", "dd-missing", "dd-shape"],
)  # fmt: skip
def test_unfit_plain_targets_of_an_indexed_step_are_refused_before_any_write(
    saved: tuple[Path, Path], step: str, target: dict[str, Any], error: type[Exception], text: str
) -> None:
    root, _ = saved
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in target.items()}
    before_tp = {k: v.clone() for k, v in target.get("tp", {}).items()}
    with pytest.raises(error) as e:
        asyncckpt.load(Path(f"{root}-{step}"), 1, into=target, rank=0)
    assert text in str(e.value) and "partly overwritten" not in str(e.value)
    if error is KeyError:
        assert isinstance(e.value, CheckpointError)
    for k, v in before.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(target[k].view(torch.uint8), v.view(torch.uint8)), k
    for k, v in before_tp.items():
        assert torch.equal(target["tp"][k].view(torch.uint8), v.view(torch.uint8)), f"tp.{k}"
