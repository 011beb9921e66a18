"""A rank of the DTensor layout test: init gloo, build every layout in turn, report what
asyncckpt.format._sharding says about each DTensor (and whether it matches ``full_tensor()``).

Run as ``python _shard_worker.py RANK WORLD PORT OUT``; writes ``OUT.RANK.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from asyncckpt.format import _sharding
from asyncckpt.format._reshard import check_tiling


class Net(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(6, hidden)
        self.down = nn.Linear(hidden, 4)
        self.register_buffer("buf", torch.arange(4.0))


def net(hidden: int, seed: int) -> tuple[Net, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    m = Net(hidden)
    return m, {k: v.detach().clone() for k, v in m.state_dict().items()}


def record(key: str, value: Any, original: torch.Tensor | None) -> dict[str, Any]:
    """What _sharding reports for one DTensor, checked against the real data."""
    info = _sharding.describe(key, value)
    full = value.full_tensor()  # a collective: every rank visits the keys in the same order
    assert info.box is not None
    sl = tuple(slice(o, o + s) for o, s in zip(info.box.offsets, info.box.sizes, strict=True))
    layout = info.layout
    ranks = _sharding.mesh_ranks(value)
    groups = _sharding.box_groups(layout, ranks)
    distinct = [g.box for g in groups]
    check_tiling(info.global_shape, distinct, key)  # the whole-tensor check agrees with the per-dim one
    coord = [int(c) for c in value.device_mesh.get_coordinate()]
    return {
        "rank": info.rank,
        "coord": coord,
        "global_shape": list(info.global_shape),
        "box": [list(info.box.offsets), list(info.box.sizes)],
        "placements": list(layout.placements),
        "no_copy": info.local.data_ptr() == value._local_tensor.data_ptr() and info.local is value._local_tensor,
        "matches_full": bool(torch.equal(full[sl], info.local)),
        "matches_original": None if original is None else bool(torch.equal(original[sl], info.local)),
        "all_boxes": {
            ",".join(map(str, c)): [list(layout.box(c).offsets), list(layout.box(c).sizes)]
            for c in layout.coordinates()
        },
        "mesh_ranks": ranks,
        "replicas": list(info.replicas),
        "writer": info.writer,
        "groups": [[list(g.box.offsets), list(g.box.sizes), list(g.ranks)] for g in groups],
    }


def record_state(out: dict[str, Any], name: str, sd: dict[str, Any], originals: dict[str, torch.Tensor]) -> None:
    entries: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, DTensor):
            entries[k] = record(k, v, originals.get(k))
        else:
            entries[k] = {"plain": True, "is_dtensor": _sharding.is_dtensor(v)}
    out[name] = entries


def refusal(fn: Any) -> dict[str, str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test checks the type and message
        return {"type": type(e).__name__, "msg": str(e)}
    return None


def run(rank: int, world: int, out: dict[str, Any]) -> None:
    mesh1 = init_device_mesh("cpu", (world,))
    # FSDP2, uneven (5 rows, 3 rows) and, on 4 ranks, empty shards
    for hidden in (5, 3):
        m, orig = net(hidden, seed=hidden)
        fully_shard(m, mesh=mesh1)
        record_state(out, f"fsdp_h{hidden}", m.state_dict(), orig)
    # TP by distribute_tensor: Shard(0), Shard(1), Replicate, uneven
    torch.manual_seed(7)
    base = torch.randn(5, 7)
    tp = {
        "s0": distribute_tensor(base, mesh1, [Shard(0)]),
        "s1": distribute_tensor(base, mesh1, [Shard(1)]),
        "rep": distribute_tensor(base, mesh1, [Replicate()]),
        "scalar": distribute_tensor(torch.tensor(3.5), mesh1, [Replicate()]),
    }
    record_state(out, "tp", tp, {"s0": base, "s1": base, "rep": base, "scalar": torch.tensor(3.5)})
    # refused: Partial, and 1-D _StridedShard (rows {0,1,4,5} / {2,3,6,7}: not a box)
    local = torch.zeros(8 // world, 6)
    strided = DTensor.from_local(local, mesh1, [_StridedShard(0, split_factor=2)], shape=(8, 6), stride=(6, 1))
    partial = DTensor.from_local(torch.ones(3), mesh1, [Partial()])
    # a local shard whose shape disagrees with what torch's layout rules say for this rank
    rows = 3 if rank == 0 else 1
    wrong = DTensor.from_local(torch.zeros(rows, 6), mesh1, [Shard(0)], shape=(4 * world, 6), stride=(6, 1))
    out["refused"] = {
        "strided_1d": refusal(lambda: _sharding.describe("opt.strided", strided)),
        "partial": refusal(lambda: _sharding.describe("opt.partial", partial)),
        "plain": refusal(lambda: _sharding.describe("plain", torch.zeros(2))),
        "wrong_local": refusal(lambda: _sharding.describe("opt.wrong", wrong)),
    }
    if world != 4:
        return
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # FSDP x TP: TP on "tp", then FSDP2 on "dp" -> (_StridedShard(0), Shard(0)) for colwise weights
    for hidden in (8, 5, 3):
        m, orig = net(hidden, seed=10 + hidden)
        parallelize_module(m, mesh2["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(m, mesh=mesh2["dp"])
        record_state(out, f"fsdp_tp_h{hidden}", m.state_dict(), orig)
    # HSDP: (Replicate(), Shard(0))
    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    m, orig = net(5, seed=21)
    fully_shard(m, mesh=hsdp_mesh)
    record_state(out, "hsdp", m.state_dict(), orig)
    # 2-D distribute_tensor layouts
    torch.manual_seed(8)
    base = torch.randn(5, 6)
    two_d = {
        "s0_s1": distribute_tensor(base, mesh2, [Shard(0), Shard(1)]),
        "r_s1": distribute_tensor(base, mesh2, [Replicate(), Shard(1)]),
        "s1_r": distribute_tensor(base, mesh2, [Shard(1), Replicate()]),
        "s0_s0": distribute_tensor(base, mesh2, [Shard(0), Shard(0)]),
    }
    record_state(out, "two_d", two_d, dict.fromkeys(two_d, base))
    bad = DTensor.from_local(
        torch.zeros(2, 6), mesh2, [Shard(0), _StridedShard(0, split_factor=2)], shape=(8, 6), stride=(6, 1)
    )
    out["refused"]["shard_strided_2d"] = refusal(lambda: _sharding.describe("opt.bad", bad))


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    result: dict[str, Any] = {"rank": rank}
    try:
        run(rank, world, result)
    except BaseException as e:  # noqa: BLE001 - the test reads what happened from the file
        result["crash"] = "".join(traceback.format_exception(e))
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    os._exit(0)


if __name__ == "__main__":
    main()
