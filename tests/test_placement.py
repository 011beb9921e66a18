"""DTensors whose replicas lie outside their own mesh (issue 28): a parameter FSDP2 shards over
``mesh["dp"]`` of a 2 x 2 ``(dp, tp)`` mesh lives on two dp sub-meshes, one per tp column. Its
global tensor must be written once and load, on real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _ranks import free_port, log_tail, run_ranks

from asyncckpt import reading
from asyncckpt._discovery import read_manifest

WORKER = str(Path(__file__).with_name("_placement_worker.py"))
STEP = "step_00000001"


def spawn(tmp: Path, scenario: str, world: int, root: Path, out: Path) -> dict[int, dict[str, Any]]:
    logs = tmp / f"logs-{scenario}-{world}"
    logs.mkdir()
    port = free_port()
    argv = [str(world), str(port), str(root), str(out)]
    hung = run_ranks(lambda r: [WORKER, scenario, str(r), *argv], world, logs, 100.0)
    assert not hung, f"ranks {hung} still running at the deadline"
    res = {}
    for r in range(world):
        f = Path(f"{out}.{r}.json")
        assert f.exists(), f"rank {r} wrote no result:\n{log_tail(logs, r)}"
        res[r] = json.loads(f.read_text())
        assert "crash" not in res[r], res[r]["crash"]
    return res


@pytest.mark.timeout(120)
def test_linear_on_dp_submesh_of_2x2_is_written_once_and_loads(tmp_path: Path) -> None:
    root, out = tmp_path / "ck", tmp_path / "out"
    res = spawn(tmp_path, "linear_submesh", 4, root, out)
    for r, got in res.items():
        for name in ("dedupe", "plain"):
            assert got[name].get("error") is None and got[name]["diff"] == [], (r, name, got[name])
    written = {}
    for name in ("dedupe", "plain"):
        step = Path(f"{root}-{name}") / STEP
        index = json.loads((step / "index.json").read_text())
        for key, e in index["tensors"].items():
            boxes = [(tuple(c[0]), tuple(c[1])) for c in e["chunks"]]
            assert len(boxes) == len(set(boxes)), (name, key, boxes)  # each global chunk once
        assert reading.verify_step(str(root) + f"-{name}", str(step), read_manifest(str(step)), record=False) == []
        written[name] = dtensor_bytes_written(step, index)
    r0 = res[0]
    # default (dedupe): no byte of a global tensor written twice, and no more bytes than DCP
    assert written["dedupe"] == r0["dtensor_bytes"], (written, r0)
    assert r0["dedupe"]["bytes"] <= r0["dcp_bytes"], r0
    # without dedupe (no round before the write) each tp column writes its copy; one is indexed
    assert written["plain"] == 2 * r0["dtensor_bytes"], (written, r0)


def dtensor_bytes_written(step: Path, index: dict[str, Any]) -> int:
    """Bytes of DTensor data in the step's rank files (whether or not the index points at them)."""
    total = 0
    for f in sorted(step.glob("rank*.safetensors")):
        slots = reading.read_shard_slots(str(f), f.stat().st_size)
        total += sum(s.end - s.begin for n, s in slots.items() if n in index["tensors"])
    return total
