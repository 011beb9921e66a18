"""A rank of the placement tests: DTensors on sub-meshes of a 2-D mesh (the parameters FSDP2
shards over ``mesh["dp"]`` only, replicated over ``tp``), saved by asyncckpt and loaded back.

Run as ``python _placement_worker.py SCENARIO RANK WORLD PORT ROOT OUT``; writes ``OUT.RANK.json``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from _ranks import run_scenario
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from asyncckpt import Checkpointer, CheckpointError


def full(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by its full tensor (collective, in key order)."""
    if isinstance(obj, DTensor):
        return obj.full_tensor().detach().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: full(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full(v) for v in obj)
    return obj


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (so NaNs and signed zeros compare bit for bit)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two states differ (tensors bit for bit, with dtype and shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        ok = ok and a.shape == b.shape and torch.equal(bits(a), bits(b))
        return [] if ok else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in diff(x, y, f"{path}.{i}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def linear(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One ``nn.Linear`` FSDP2-sharded over ``mesh["dp"]`` of a 2 x 2 ``(dp, tp)`` mesh: two
    copies of every shard, one per tp column (the issue's minimal case)."""
    torch.manual_seed(seed)
    m = nn.Linear(64, 48)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    fully_shard(m, mesh=mesh["dp"])
    optim = torch.optim.Adam(m.parameters(), lr=0.01)
    train(m, optim)
    return m, optim


def train(m: nn.Module, optim: torch.optim.Optimizer) -> None:
    torch.manual_seed(100)  # equal data on every rank: the tp replicas stay equal
    m(torch.randn(4, 64)).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()


def linear_submesh(rank: int, world: int, root: str, out: str, res: dict[str, Any]) -> None:
    """Save the sub-mesh Linear with and without dedupe, twice (the second save of a structure
    takes the plan the first one's round made), and load each step back on the same mesh."""
    model, optim = linear(seed=1)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    refs = {1: full(state)}
    train(model, optim)  # the state's tensors alias the model's and optimizer's: new values
    refs[2] = full(state)
    if rank == 0:
        torch.save(refs[1], out + ".ref.pt")
    for name, dedupe in (("dedupe", True), ("plain", False)):
        path = f"{root}-{name}"
        with Checkpointer(path, dedupe=dedupe, timeout=60) as ck:
            train(model, optim)  # undone below: step 1 is saved from refs[1]'s values
            for step in (1, 2):
                load_into(state, refs[step])
                ck.save(step, state).result(timeout=60)
        dist.barrier()
        res[name] = {"diff": []}
        for step in (1, 2):
            fresh, optim2 = linear(seed=2)
            msd2, osd2 = get_state_dict(fresh, optim2)
            try:
                with Checkpointer(path, timeout=60) as ck:
                    ck.load(step, into={"model": msd2, "optim": osd2})
                set_state_dict(fresh, optim2, model_state_dict=msd2, optim_state_dict=osd2)
                msd3, osd3 = get_state_dict(fresh, optim2)
                res[name]["diff"] += diff(full({"model": msd3, "optim": osd3}), refs[step], f"step{step}")
            except CheckpointError as e:
                res[name]["error"] = f"{type(e).__name__}: {e}"
                dist.barrier()
        if rank == 0:
            res[name]["bytes"] = du(os.path.join(path, "step_00000001"))
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=root + ".dcp")
    dist.barrier()
    if rank == 0:
        res["dcp_bytes"] = du(root + ".dcp")
        res["dtensor_bytes"] = sum(
            v.numel() * v.element_size() for v in _leaves(state) if isinstance(v, DTensor)
        )


def load_into(state: Any, ref: Any) -> None:
    """Copy the full tensors ``ref`` into ``state``'s DTensors (their local shards) and tensors."""
    if isinstance(state, DTensor):
        from torch.distributed.tensor import distribute_tensor

        with torch.no_grad():
            state.to_local().copy_(distribute_tensor(ref, state.device_mesh, state.placements).to_local())
    elif isinstance(state, torch.Tensor):
        with torch.no_grad():
            state.copy_(ref)
    elif isinstance(state, dict):
        for k in state:
            load_into(state[k], ref[k])


def _leaves(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v)]
    return [obj]


class ModelWrapper:
    """A torchtitan-style Stateful model: a flat FQN -> DTensor state dict."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, sd)


class OptimizerWrapper:
    """A torchtitan-style Stateful optimizer: a flat optimizer state dict."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        self.model, self.optim = model, optim
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optim, options=self.options)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optim, sd, options=self.options)


def fsdp_mlp(seed: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.Adam(m.parameters(), lr=0.01)
    torch.manual_seed(100)
    m(torch.randn(4, 256)).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()
    return m, optim


def rchar() -> int:
    """Bytes this process has read through read()/pread() so far (page cache hits included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def stateful(rank: int, world: int, root: str, out: str, res: dict[str, Any]) -> None:
    """torchtitan-style Stateful wrappers saved on every rank, loaded into fresh wrappers:
    each rank reads about its share of the DTensor bytes (its shards), not whole tensors."""
    model, optim = fsdp_mlp(seed=1, world=world)
    state = {"model": ModelWrapper(model), "optim": OptimizerWrapper(model, optim)}
    ref = full({k: v.state_dict() for k, v in state.items()})
    with Checkpointer(root, timeout=60) as ck:
        ck.save(1, state).result(timeout=60)
    res["dtensor_bytes"] = sum(v.numel() * v.element_size() for v in _leaves(state["model"].state_dict()))
    res["dtensor_bytes"] += sum(
        v.numel() * v.element_size() for v in _leaves(state["optim"].state_dict()) if isinstance(v, DTensor)
    )
    res["read"] = {}
    # (each kind's first load imports what it needs: the second one's reads are the load's)
    for kind in ("plain", "stateful", "plain again", "stateful again"):
        fresh, optim2 = fsdp_mlp(seed=2, world=world)
        target: dict[str, Any] = {"model": ModelWrapper(fresh), "optim": OptimizerWrapper(fresh, optim2)}
        if kind.startswith("plain"):  # the same state as plain dicts of DTensors
            target = {k: v.state_dict() for k, v in target.items()}
        with Checkpointer(root, timeout=60) as ck:
            before = rchar()
            ck.load(1, into=target)
            res["read"][kind] = rchar() - before
        if kind == "stateful again":
            res["diff"] = diff(full({k: v.state_dict() for k, v in target.items()}), ref)


def paused_staging(rank: int, world: int, root: str, out: str, res: dict[str, Any]) -> None:
    """The copy in save() is paused halfway (a signal handler runs on the saving thread between
    two tensors) while the writer's dedupe round completes and it builds the file without the
    twins other ranks write: the file must hold what the copy staged, not what it had not yet.
    2048 twin DTensors of 8 KiB per rank (FSDP over ``mesh["dp"]`` of 2 x 2): two staging groups."""
    import signal

    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(5)
    full_ = {f"w{i}": torch.randn(4, 1024, generator=g) for i in range(2048)}
    state = {k: distribute_tensor(v, mesh["dp"], [Shard(0)], src_data_rank=None) for k, v in full_.items()}
    paused: list[float] = []

    def pause(signum: int, frame: Any) -> None:
        f = frame
        while f is not None and not (f.f_code.co_name == "work" and f.f_code.co_filename.endswith("_stagecopy.py")):
            f = f.f_back
        if f is None and not paused:
            signal.setitimer(signal.ITIMER_REAL, 0.0005)  # not copying yet: look again soon
        elif not paused:
            paused.append(time.monotonic())
            time.sleep(1.5)  # mid-copy: the writer runs on meanwhile

    old = signal.signal(signal.SIGALRM, pause)
    try:
        with Checkpointer(root, timeout=60) as ck:
            signal.setitimer(signal.ITIMER_REAL, 0.0005)
            ck.save(1, state).result(timeout=60)
            signal.setitimer(signal.ITIMER_REAL, 0)
            res["paused"] = bool(paused)
            target = {k: distribute_tensor(torch.zeros(4, 1024), mesh["dp"], [Shard(0)], src_data_rank=None)
                      for k in full_}  # fmt: skip
            ck.load(1, into=target)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    want = {k: distribute_tensor(v, mesh["dp"], [Shard(0)], src_data_rank=None) for k, v in full_.items()}
    res["diff"] = [k for k in full_ if not torch.equal(target[k].to_local(), want[k].to_local())]


SCENARIOS = {"linear_submesh": linear_submesh, "stateful": stateful, "paused_staging": paused_staging}


def main() -> None:
    scenario, rank, world, port, root, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]
    run_scenario(rank, world, port, out, lambda res: SCENARIOS[scenario](rank, world, root, out, res))


if __name__ == "__main__":
    main()
