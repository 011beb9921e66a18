"""A rank of the unfit-target test of indexed steps (``tests/test_unfit_indexed.py``).

``save``: two steps on real gloo ranks, each indexed: ``ROOT-dt`` holds DTensors (Shard(0),
Shard(1), Replicate()) beside a per-rank tensor; ``ROOT-dd`` holds no DTensor, only a large
tensor equal on every rank, written once (dedupe), and a per-rank one.

``load``: each rank loads both steps into targets that do not fit them (a key the step
lacks, a tensor of another shape, a DTensor of another shape or dtype), recording the error
and whether every target kept its bytes, then into targets that fit (which must change them:
the DTensors' local shards are read into in place).

Run as ``python _unfit_worker.py SCENARIO RANK WORLD PORT ROOT OUT``; writes ``OUT.RANK.json``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _global_worker import snapshot
from _ranks import run_scenario
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from asyncckpt import Checkpointer


def dt_state(world: int, rank: int, fill: float | None, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(7)
    base = torch.randn(6, 8) if fill is None else torch.full((6, 8), fill)
    return {
        "tp": {
            "s0": distribute_tensor(base.to(dtype), mesh, [Shard(0)]),
            "s1": distribute_tensor(base.clone(), mesh, [Shard(1)]),
            "rep": distribute_tensor(base[0].clone(), mesh, [Replicate()]),
        },
        "own": torch.full((3,), float(rank) if fill is None else fill),
    }


def dd_state(rank: int, fill: float | None) -> dict[str, Any]:
    torch.manual_seed(11)
    big = torch.randn(256, 1024) if fill is None else torch.full((256, 1024), fill)  # 1 MiB: worth writing once
    return {"big": big, "small": torch.arange(5.0) if fill is None else torch.full((5,), fill),
            "own": torch.full((3,), float(rank) if fill is None else fill)}  # fmt: skip


def same(a: Any, b: Any) -> bool:
    """Bit-equal (tensors: dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def save(rank: int, world: int, root: str) -> None:
    with Checkpointer(root + "-dt") as ck:
        ck.save(1, dt_state(world, rank, None)).result(timeout=60)
    with Checkpointer(root + "-dd", dedupe=True) as ck:
        ck.save(1, dd_state(rank, None)).result(timeout=60)


def unfit_dt(world: int, rank: int) -> dict[str, Callable[[], dict[str, Any]]]:
    def missing() -> dict[str, Any]:
        return {**dt_state(world, rank, 0.5), "zz_not_saved": torch.zeros(2)}

    def plain_shape() -> dict[str, Any]:
        return {**dt_state(world, rank, 0.5), "own": torch.full((4,), 0.5)}

    def dtensor_shape() -> dict[str, Any]:
        s = dt_state(world, rank, 0.5)
        s["tp"]["s1"] = distribute_tensor(torch.full((6, 10), 0.5), init_device_mesh("cpu", (world,)), [Shard(1)])
        return s

    def dtensor_dtype() -> dict[str, Any]:
        return dt_state(world, rank, 0.5, torch.float64)

    return {"missing": missing, "plain_shape": plain_shape, "dtensor_shape": dtensor_shape,
            "dtensor_dtype": dtensor_dtype}  # fmt: skip


def unfit_dd(rank: int) -> dict[str, Callable[[], dict[str, Any]]]:
    return {
        "missing": lambda: {**dd_state(rank, 0.5), "zz_not_saved": torch.zeros(2)},
        "plain_shape": lambda: {**dd_state(rank, 0.5), "small": torch.full((6,), 0.5)},
    }


def try_load(root: str, target: dict[str, Any]) -> dict[str, Any]:
    before = snapshot(target)
    out: dict[str, Any] = {"error": None}
    with Checkpointer(root) as ck:
        try:
            ck.load(1, into=target)
        except Exception as e:  # noqa: BLE001 - the test checks the type
            out = {"error": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "msg": str(e)}
    out["unchanged"] = same(snapshot(target), before)
    dist.barrier()
    return out


def load(rank: int, world: int, root: str, res: dict[str, Any]) -> None:
    for name, make in unfit_dt(world, rank).items():
        res[f"dt_{name}"] = try_load(root + "-dt", make())
    for name, make in unfit_dd(rank).items():
        res[f"dd_{name}"] = try_load(root + "-dd", make())
    # teeth: targets that fit are written (the DTensors' local shards in place)
    for kind, target, want in (
        ("dt", dt_state(world, rank, 0.5), dt_state(world, rank, None)),
        ("dd", dd_state(rank, 0.5), dd_state(rank, None)),
    ):
        fit = try_load(f"{root}-{kind}", target)
        fit["equal"] = same(snapshot(target), snapshot(want))
        res[f"{kind}_fit"] = fit


def main() -> None:
    scenario, rank, world, port, root, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]
    if scenario == "save":
        run_scenario(rank, world, port, out, lambda res: save(rank, world, root))
    run_scenario(rank, world, port, out, lambda res: load(rank, world, root, res))


if __name__ == "__main__":
    main()
