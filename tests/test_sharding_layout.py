"""DTensor layouts as asyncckpt.format._sharding reports them, on real gloo ranks (FSDP2, TP, FSDP x TP,
HSDP, uneven and empty shards), checked against ``full_tensor()`` and the unsharded originals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _ranks import free_port, log_tail, run_ranks

from asyncckpt.format._reshard import Box, check_tiling

WORKER = str(Path(__file__).parent / "support" / "_shard_worker.py")


def run_world(tmp_path: Path, world: int) -> dict[int, dict[str, Any]]:
    out, port = tmp_path / "result", free_port()
    hung = run_ranks(lambda r: [WORKER, str(r), str(world), str(port), str(out)], world, tmp_path, 90.0, warm=True)
    assert not hung, f"ranks {hung} still running at the deadline"
    res = {}
    for r in range(world):
        f = Path(f"{out}.{r}.json")
        assert f.exists(), f"rank {r} wrote no result:\n{log_tail(tmp_path, r)}"
        res[r] = json.loads(f.read_text())
        assert "crash" not in res[r], res[r]["crash"]
    return res


@pytest.fixture(scope="module", params=[2, 4])
def world_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world = request.param
    return world, run_world(tmp_path_factory.mktemp(f"w{world}"), world)


def dtensor_entries(res: dict[int, dict[str, Any]]) -> dict[tuple[str, str], dict[int, dict[str, Any]]]:
    """(layout, key) -> rank -> entry, for every DTensor every rank reported."""
    out: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for r, doc in res.items():
        for name, entries in doc.items():
            if name in ("rank", "refused"):
                continue
            for key, e in entries.items():
                if not e.get("plain"):
                    out.setdefault((name, key), {})[r] = e
    return out


def expected_layouts(world: int) -> set[str]:
    base = {"fsdp_h5", "fsdp_h3", "tp"}
    return base | ({"fsdp_tp_h8", "fsdp_tp_h5", "fsdp_tp_h3", "hsdp", "two_d"} if world == 4 else set())


@pytest.mark.timeout(150)
def test_boxes_are_the_slices_of_the_full_tensor(world_results: Any) -> None:
    world, res = world_results
    entries = dtensor_entries(res)
    assert {name for name, _ in entries} == expected_layouts(world)
    for (name, key), per_rank in entries.items():
        assert sorted(per_rank) == list(range(world)), (name, key)
        for r, e in per_rank.items():
            where = (name, key, r)
            assert e["rank"] == r and e["matches_full"], where
            assert e["matches_original"] in (True, None), where
            assert e["no_copy"], where
    # plain values (FSDP buffers) are not DTensors
    assert res[0]["fsdp_h5"]["buf"] == {"plain": True, "is_dtensor": False}


def test_every_coordinate_box_matches_what_that_rank_reports(world_results: Any) -> None:
    _, res = world_results
    for (name, key), per_rank in dtensor_entries(res).items():
        reported = {",".join(map(str, e["coord"])): e["box"] for e in per_rank.values()}
        for r, e in per_rank.items():
            assert e["all_boxes"] == reported, (name, key, r)


def test_layouts_seen_include_uneven_empty_strided_and_replicated(world_results: Any) -> None:
    world, res = world_results
    entries = dtensor_entries(res)
    sizes = [tuple(e["box"][1]) for per in entries.values() for e in per.values()]
    assert (3, 6) in sizes and (2, 6) in sizes  # uneven FSDP2 rows: 5 rows on 2 ranks, or 2,2,1,0
    if world == 4:
        assert (0, 6) in sizes  # an empty FSDP2 shard
        placements = {tuple(e["placements"]) for per in entries.values() for e in per.values()}
        assert ("SS(0,2)", "S(0)") in placements  # FSDP x TP colwise weight
        assert ("R", "S(0)") in placements  # HSDP
        assert ("S(0)", "S(1)") in placements
        up = entries[("fsdp_tp_h8", "up.weight")]
        # offsets follow tp-major order, not rank order (research note §1.3)
        assert [up[r]["box"][0][0] for r in range(4)] == [0, 4, 2, 6]
        empty = entries[("fsdp_tp_h3", "up.weight")][3]
        assert empty["box"] == [[3, 0], [0, 6]] and empty["replicas"] == [] and not empty["writer"]


def test_tiling_and_exactly_one_writer_per_box(world_results: Any) -> None:
    world, res = world_results
    for (name, key), per_rank in dtensor_entries(res).items():
        e0 = per_rank[0]
        shape = e0["global_shape"]
        holders: dict[tuple[Any, ...], list[int]] = {}
        for r, e in per_rank.items():
            if 0 not in e["box"][1] or not e["box"][1]:
                holders.setdefault((tuple(e["box"][0]), tuple(e["box"][1])), []).append(r)
        # replicas are exactly the ranks that report the same box; the writer is the lowest
        for r, e in per_rank.items():
            b = (tuple(e["box"][0]), tuple(e["box"][1]))
            assert e["replicas"] == sorted(holders.get(b, [])), (name, key, r)
        writers = [(tuple(e["box"][0]), tuple(e["box"][1])) for e in per_rank.values() if e["writer"]]
        assert sorted(writers) == sorted(holders), (name, key)  # one writer per distinct box
        for b, rs in holders.items():
            assert [r for r in rs if per_rank[r]["writer"]] == [min(rs)], (name, key, b)
        # the written boxes tile the global tensor exactly
        check_tiling(shape, [Box(o, s) for o, s in writers], key)
        assert e0["groups"] == [[list(o), list(s), sorted(rs)] for (o, s), rs in sorted(holders.items())]
    if world == 4:
        tp = dtensor_entries(res)[("tp", "rep")]
        assert [tp[r]["writer"] for r in range(4)] == [True, False, False, False]
        hsdp = dtensor_entries(res)[("hsdp", "up.weight")]
        assert hsdp[0]["replicas"] == [0, 2] and hsdp[1]["replicas"] == [1, 3]


def test_non_box_layouts_and_partial_are_refused_naming_the_key(world_results: Any) -> None:
    world, res = world_results
    for r in range(world):
        ref = res[r]["refused"]
        assert ref["strided_1d"]["type"] == "TypeError"
        assert "'opt.strided'" in ref["strided_1d"]["msg"] and "not contiguous" in ref["strided_1d"]["msg"]
        assert ref["partial"]["type"] == "TypeError"
        assert "'opt.partial'" in ref["partial"]["msg"] and "redistribute" in ref["partial"]["msg"]
        assert ref["plain"]["type"] == "TypeError"
        assert ref["wrong_local"]["type"] == "TypeError" and "'opt.wrong'" in ref["wrong_local"]["msg"]
        assert "layout rules" in ref["wrong_local"]["msg"]
        if world == 4:
            assert ref["shard_strided_2d"]["type"] == "TypeError" and "'opt.bad'" in ref["shard_strided_2d"]["msg"]


def test_import_without_torch_distributed() -> None:
    code = (
        "import torch, torch.distributed\n"
        "torch.distributed.is_available = lambda: False\n"
        "from asyncckpt.format import _sharding\n"
        "assert not _sharding.AVAILABLE and not _sharding.is_dtensor(torch.zeros(1))\n"
        "try:\n    _sharding.describe('k', torch.zeros(1))\nexcept TypeError as e:\n    print('refused', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.stdout.startswith("refused 'k' is a Tensor, not a DTensor"), out
