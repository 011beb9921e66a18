"""A rank (or a lone process) of tests/test_deferred_ranks.py: deferred staging under DDP and
FSDP2 (gloo), and a process killed with SIGKILL while its deferred save is in flight.

    python _deferred_worker.py ddp|fsdp2 RANK WORLD PORT ROOT OUT
    python _deferred_worker.py crash 0 1 0 ROOT OUT      (prints SAVED once save() returned)
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import asyncckpt
from asyncckpt import Checkpointer
from asyncckpt.saving import _deferred


def same(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
        return [] if ok and torch.equal(a, b) else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys differ"]
        return [d for k in a for d in same(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in same(x, y, f"{path}.{i}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def clone(obj: Any) -> Any:
    """A deep copy with every DTensor replaced by its full tensor (collective, in key order)."""
    full = getattr(obj, "full_tensor", None)
    if isinstance(obj, torch.Tensor):
        return (full() if callable(full) else obj).detach().clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone(v) for v in obj)
    return obj


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 64))


def step(model: nn.Module, optim: torch.optim.Optimizer, rank: int, micro: int = 2) -> None:
    optim.zero_grad(set_to_none=False)
    for i in range(micro):
        torch.manual_seed(100 * rank + i)
        model(torch.randn(8, 64)).pow(2).mean().backward()
    optim.step()


def ddp(rank: int, world: int, root: str, res: dict[str, Any]) -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(net())
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    step(model, optim, rank)
    with Checkpointer(root, strip_prefixes=("module.",)) as ck:
        want = clone({"model": model.module.state_dict(), "optim": optim.state_dict()})
        h = ck.save(1, {"model": model, "optim": optim}, until=optim)
        res["deferred"] = _deferred.pending() > 0
        step(model, optim, rank)  # DDP's all-reduce in backward, then the guarded step
        h.result(60)
        loaded = ck.load(step=1)
        res["exact"] = same(loaded, want)
        # a write by hand on rank 1 only: that save fails on every rank, named on rank 1
        h = ck.save(2, {"model": model, "optim": optim}, until=optim)
        if rank == 1:
            with torch.no_grad():
                model.module[2].weight.mul_(2)
        step(model, optim, rank)
        try:
            h.result(60)
            res["changed"] = None
        except asyncckpt.SaveError as e:
            res["changed"] = {"type": type(e).__name__, "keys": list(getattr(e, "keys", ())), "msg": str(e)}
        try:
            ck.flush()
        except asyncckpt.SaveError:
            pass
        res["steps"] = ck.steps()


def fsdp2(rank: int, world: int, root: str, res: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        m = net()
        mesh = init_device_mesh("cpu", (world,))
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m, torch.optim.AdamW(m.parameters(), lr=0.01)

    model, optim = build(0)
    step(model, optim, rank)
    with Checkpointer(root) as ck:
        msd, osd = get_state_dict(model, optim)
        want = clone({"model": msd, "optim": osd})
        h = ck.save(1, {"model": msd, "optim": osd}, until=optim)
        res["deferred"] = _deferred.pending() > 0  # the DTensors' local shards were recognised
        step(model, optim, rank)  # all-gather in forward, reduce-scatter in backward, the guarded step
        h.result(60)
        m2, o2 = build(99)
        step(m2, o2, rank)
        msd2, osd2 = get_state_dict(m2, o2)
        target = {"model": msd2, "optim": osd2}
        ck.load(step=1, into=target)
        res["exact"] = same(clone(target), want)


def crash(root: str, out: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])  # 32 MiB: the copy takes a while
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = Checkpointer(root)
    torch.save(model.state_dict(), out + ".step1.pt")  # what the step-1 save must hold
    ck.save(1, {"model": model}, until=optim)
    step_big(model, optim)
    ck.flush()
    ck.save(2, {"model": model}, until=optim)
    print("SAVED", flush=True)
    time.sleep(60)  # killed here: the copy may be running, the guard never ran


def step_big(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    model(torch.randn(4, 1024)).sum().backward()
    optim.step()


def main() -> None:
    scenario, rank, world, port, root, out = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        *sys.argv[5:7],
    )
    if scenario == "crash":
        crash(root, out)
        return
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    result: dict[str, Any] = {"rank": rank}
    try:
        {"ddp": ddp, "fsdp2": fsdp2}[scenario](rank, world, root, result)
    except BaseException as e:  # noqa: BLE001 - the test reads what happened from the file
        result["crash"] = "".join(traceback.format_exception(e))
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    os._exit(0)


if __name__ == "__main__":
    main()
