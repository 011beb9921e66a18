"""A rank of the sharded save/load test: FSDP2, TP and FSDP x TP state saved by asyncckpt on
one world size and loaded on another, checked against the full tensors of what was saved.

Run as ``python _global_worker.py SCENARIO RANK WORLD PORT ROOT OUT [SAVED_WORLD]``; writes
``OUT.RANK.json`` and, for ``save`` on rank 0, ``OUT.ref.pt`` (the full tensors saved).
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
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from asyncckpt import Checkpointer, CheckpointError


class Net(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(6, hidden)
        self.down = nn.Linear(hidden, 4)
        self.register_buffer("buf", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Pair(nn.Module):
    """Two nets: hidden 5 (uneven shards) and 3 (empty shards on 4 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Net(5)
        self.b = Net(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def build(world: int, seed: int) -> tuple[Pair, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Pair()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train_step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    torch.manual_seed(123)
    x = torch.randn(8, 6)
    model(x).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()


def tp_state(world: int, fill: float | None) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(7)
    base = torch.randn(5, 7) if fill is None else torch.full((5, 7), fill)
    return {
        "s1": distribute_tensor(base, mesh, [Shard(1)]),
        "s0": distribute_tensor(base.t().contiguous(), mesh, [Shard(0)]),
        "rep": distribute_tensor(base[0].clone(), mesh, [Replicate()]),
    }


def tp2d_model(seed: int) -> nn.Module:
    """FSDP x TP on a 2 x 2 mesh: (_StridedShard(0), Shard(0)) for the colwise weight."""
    torch.manual_seed(seed)
    m = Net(8)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(m, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp"])
    return m


def fsdp_model(world: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = Net(8)
    fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
    return m


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


def same(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two states differ (tensors bit for bit, with dtype and shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        ok = ok and a.shape == b.shape and torch.equal(a, b)
        return [] if ok else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in same(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in same(x, y, f"{path}.{i}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def save(rank: int, world: int, root: str, out: str, res: dict[str, Any], kill: bool = False) -> None:
    model, optim = build(world, seed=1)
    train_step(model, optim)
    msd, osd = get_state_dict(model, optim)
    state: dict[str, Any] = {"model": msd, "optim": osd, "tp": tp_state(world, None), "rng": torch.full((3,), rank)}
    state["step"] = 7
    if world == 4:
        state["tp2d"] = tp2d_model(seed=2).state_dict()
    # dedupe (the default): the FSDP buffers and optimizer steps, equal on every rank, are written
    # once, and the Replicate()d vector by one rank
    with Checkpointer(root, timeout=10 if kill else 600) as ck:
        t0 = time.perf_counter()
        ck.save(1, state)
        res["blocking_s"] = time.perf_counter() - t0
        ck.flush()
        res["durable_s"] = time.perf_counter() - t0
        if kill:
            ref = full(state)  # while every rank is alive (collective)
            if rank == 0:
                torch.save(ref, out + ".ref.pt")
            dist.barrier()
            # step 2: the last rank dies in the middle of the save; the others fail it
            if rank == world - 1:
                os._exit(9)
            try:
                ck.save(2, state).result(timeout=60)
                res["second"] = "committed"
            except Exception as e:  # noqa: BLE001 - the test checks the type
                res["second"] = type(e).__name__
            try:
                ck.flush()
            except Exception:  # noqa: BLE001 - the same failure, already recorded
                pass
    if kill:
        return
    ref = full(state)
    dist.barrier()
    if rank == 0:
        torch.save(ref, out + ".ref.pt")
        res["bytes"] = du(os.path.join(root, "step_00000001"))
    # DCP's bytes for the same state, for the report
    import torch.distributed.checkpoint as dcp

    dcp_state = {k: v for k, v in state.items() if k != "step"}
    dcp.save(dcp_state, checkpoint_id=root + ".dcp")
    dist.barrier()
    if rank == 0:
        res["dcp_bytes"] = du(root + ".dcp")


def load(rank: int, world: int, saved: int, root: str, out: str, res: dict[str, Any]) -> None:
    model, optim = build(world, seed=99)  # different values than saved
    msd, osd = get_state_dict(model, optim)  # initializes the optimizer state (DCP's recipe)
    target: dict[str, Any] = {"model": msd, "optim": osd, "tp": tp_state(world, 0.0), "rng": torch.zeros(3)}
    if saved == 4:
        target["tp2d"] = fsdp_model(world, seed=3).state_dict()  # another layout than the saved 2-D one
    with Checkpointer(root) as ck:
        if saved != world:
            try:
                ck.load(into=target)
                res["refused"] = None
            except CheckpointError as e:
                res["refused"] = str(e)
        t0 = time.perf_counter()
        loaded = ck.load(into=target, per_rank="rank0")
        res["load_s"] = time.perf_counter() - t0
        res["rng"] = target["rng"].tolist()
        res["step"] = loaded["step"]
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    msd2, osd2 = get_state_dict(model, optim)
    got = full({"model": msd2, "optim": osd2, "tp": target["tp"], **({"tp2d": target["tp2d"]} if saved == 4 else {})})
    # DCP's own reshard of the same state (saved next to ours) gives the same values
    if os.path.isdir(root + ".dcp"):
        import torch.distributed.checkpoint as dcp

        model3, optim3 = build(world, seed=98)
        msd3, osd3 = get_state_dict(model3, optim3)
        dcp_target: dict[str, Any] = {"model": msd3, "optim": osd3, "tp": tp_state(world, 0.0), "rng": torch.zeros(3)}
        if saved == 4:
            dcp_target["tp2d"] = fsdp_model(world, seed=4).state_dict()
        dcp.load(dcp_target, checkpoint_id=root + ".dcp")
        set_state_dict(model3, optim3, model_state_dict=msd3, optim_state_dict=osd3)
        msd4, osd4 = get_state_dict(model3, optim3)
        extra = {"tp2d": dcp_target["tp2d"]} if saved == 4 else {}
        theirs = full({"model": msd4, "optim": osd4, "tp": dcp_target["tp"], **extra})
        res["diff_dcp"] = same(got, theirs) if rank == 0 else []
    # local shards of the targets really are DTensors of this job's mesh
    res["local_shapes"] = {k: list(v.to_local().shape) for k, v in target["tp"].items()}
    if rank == 0:
        ref = torch.load(out + ".ref.pt")
        want = {"model": ref["model"], "optim": ref["optim"], "tp": ref["tp"]}
        if saved == 4:
            want["tp2d"] = ref["tp2d"]
        res["diff"] = same(got, want)
        # the model still trains from the restored state
        train_step(model, optim)
    else:
        train_step(model, optim)


def ddp(rank: int, world: int, root: str, out: str, res: dict[str, Any]) -> None:
    """DDP on ``world`` ranks: the model and optimizer are identical on every rank, the RNG
    state is not; saved with and without dedupe, then loaded back on every rank."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(1000 + rank)  # per-rank data and RNG
    model(torch.randn(8, 64)).pow(2).sum().backward()
    optim.step()
    rng = torch.random.get_rng_state()
    if rank == 0:
        torch.save(rng, out + ".ddp_rng0.pt")
    replicated = sum(t.numel() * t.element_size() for t in model.module.state_dict().values())
    replicated += sum(v.numel() * v.element_size() for st in optim.state_dict()["state"].values() for v in st.values())
    res["replicated_bytes"] = replicated
    res["rng_bytes"] = rng.numel()
    for name, dedupe in (("plain", False), ("dedup", True)):
        with Checkpointer(f"{root}-{name}", strip_prefixes=("module.",), dedupe=dedupe) as ck:
            ck.save(1, {"model": model, "optim": optim, "rng": rng}).result(timeout=60)
            t0 = time.perf_counter()  # the second save: the first of a job's second Checkpointer waits ~5 s
            info = ck.save(2, {"model": model, "optim": optim, "rng": rng}).result(timeout=60)
            res[f"{name}_durable_s"] = time.perf_counter() - t0
            res[f"{name}_nbytes"] = info.nbytes  # data bytes of every rank's file
        dist.barrier()
    with Checkpointer(f"{root}-dedup", strip_prefixes=("module.",), dedupe=True) as ck:
        loaded = ck.load()
    if rank == 0:  # what every rank saved as its model and optimizer (equal on all of them)
        torch.save({"model": model.module.state_dict(), "optim": optim.state_dict()["state"]}, out + ".ddp_ref.pt")
    res["model_equal"] = all(torch.equal(loaded["model"][k], v) for k, v in model.module.state_dict().items())
    res["optim_equal"] = same(loaded["optim"]["state"], optim.state_dict()["state"]) == []
    res["rng_equal"] = bool(torch.equal(loaded["rng"], rng))
    # a state refused on rank 1 fails the save on every rank at once, naming rank 1 only
    from asyncckpt import SaveError

    with Checkpointer(f"{root}-bad", dedupe=True, timeout=30) as ck:
        t0 = time.perf_counter()
        try:
            ck.save(1, {"w": torch.zeros(4), "bad": object() if rank == 1 else 0}).result(timeout=60)
            res["bad"] = "saved"
        except TypeError:
            res["bad"] = "TypeError"
        except SaveError as e:
            res["bad"] = sorted(e.failures)
        res["bad_s"] = time.perf_counter() - t0
        try:
            ck.flush()
        except SaveError:
            pass
        ck.save(2, {"w": torch.zeros(4)}).result(timeout=60)
        res["after_bad"] = ck.steps()


def wide_state(world: int) -> dict[str, Any]:
    """Two 2 MiB tensors: ``w1`` column-sharded (16 KiB rows per chunk), ``w0`` row-sharded."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(11)
    return {
        "w1": distribute_tensor(torch.randn(32, 16384), mesh, [Shard(1)]),
        "w0": distribute_tensor(torch.randn(64, 8192), mesh, [Shard(0)]),
        "step": 3,
    }


def save_wide(rank: int, world: int, root: str, out: str, res: dict[str, Any]) -> None:
    """The wide state saved with 4 KiB block CRCs (the reader takes the size from the index)."""
    from asyncckpt.format import _index

    _index.BLOCK = 4096
    state = wide_state(world)
    with Checkpointer(root) as ck:
        ck.save(1, state).result(timeout=60)
    ref = full(state)
    if rank == 0:
        torch.save(ref, out + ".ref.pt")


def snapshot(obj: Any) -> Any:
    """Every tensor's local bytes (DTensors: the local shard), copied."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [snapshot(v) for v in obj]
    return obj


def load_corrupt(rank: int, world: int, root: str, out: str, res: dict[str, Any]) -> None:
    """Load step 2, which has one flipped byte that only rank 1 reads: every rank must raise
    ``CheckpointCorruptError`` naming the file with its targets bit-identical under
    ``verify_first=True``; then with the agreement off (a test-only switch) and in the default
    one pass (``verify_first=False``), where targets are written; then ``load(step=None)`` into
    the same, now dirty, targets, which must fall back to the intact step 1 and restore them all."""
    from asyncckpt import CheckpointCorruptError
    from asyncckpt.loading import _load_global

    def targets(seed: int) -> dict[str, Any]:
        model, optim = build(world, seed=seed)
        msd, osd = get_state_dict(model, optim)
        return {"model": msd, "optim": osd, "tp": tp_state(world, 0.0), "rng": torch.zeros(3)}

    target = targets(99)
    for guard in ("on", "agree_off", "verify_off"):
        _load_global._AGREE_BEFORE_WRITE = guard != "agree_off"
        before = snapshot(target)
        with Checkpointer(root) as ck:
            try:
                ck.load(2, into=target, per_rank="rank0", verify_first=guard != "verify_off")
                res[guard] = {"error": None}
            except CheckpointCorruptError as e:
                res[guard] = {"error": type(e).__name__, "path": e.path, "msg": str(e)}
        res[guard]["unchanged"] = same(snapshot(target), before) == []
        dist.barrier()
    _load_global._AGREE_BEFORE_WRITE = True
    fresh = target  # written by the one-pass attempt above
    with Checkpointer(root) as ck:
        ck.load(into=fresh, per_rank="rank0")  # step 2 is corrupt on rank 1: every rank takes step 1
    got = full({"tp": fresh["tp"], "model": fresh["model"]})
    if rank == 0:
        ref = torch.load(out + ".ref.pt")
        res["fallback_diff"] = same(got, {"tp": ref["tp"], "model": ref["model"]})
def ddp_load(rank: int, world: int, root: str, out: str, res: dict[str, Any]) -> None:
    """Resume the 4-rank DDP checkpoint of :func:`ddp` (deduplicated) on ``world`` ranks: the
    model and optimizer, identical on every saved rank, load; the per-rank RNG states do not
    without a policy, and ``per_rank="rank0"`` takes rank 0's."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(5)  # other values than saved
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(8, 64)).pow(2).sum().backward()
    optim.step()  # the optimizer state exists, so load(into=) restores it in place
    target = {"model": model, "optim": optim, "rng": torch.zeros(5056, dtype=torch.uint8)}
    with Checkpointer(f"{root}-dedup", strip_prefixes=("module.",)) as ck:
        try:
            ck.load(into=target)
            res["refused"] = None
        except CheckpointError as e:
            res["refused"] = str(e)
        res["rng_untouched"] = bool((target["rng"] == 0).all())
        ck.load(into=target, per_rank="rank0")
    ref = torch.load(out + ".ddp_ref.pt")
    res["model_equal"] = same(dict(model.module.state_dict()), ref["model"]) == []
    res["optim_equal"] = same(optim.state_dict()["state"], ref["optim"]) == []
    res["rng0"] = bool(torch.equal(target["rng"], torch.load(out + ".ddp_rng0.pt")))


def hsdp_model(seed: int) -> nn.Module:
    """HSDP on a 2 x 2 mesh (replicate x shard): every parameter (Replicate(), Shard(0))."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8), nn.Linear(8, 96))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(m, mesh=mesh)
    return m


def hsdp(rank: int, world: int, root: str, out: str, res: dict[str, Any]) -> None:
    """HSDP on 4 ranks saved with the default (replica writes spread) and with dedupe=False
    (the lowest replica writes every box); the first loaded back into a fresh HSDP model."""
    model = hsdp_model(seed=1)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step_hsdp(model, optim)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    boxes = [v.to_local().numel() * v.element_size() for v in [*msd.values(), *_leaves(osd)] if isinstance(v, DTensor)]
    res["largest_box"] = max(boxes)
    for name, dedupe in (("spread", True), ("lowest", False)):
        with Checkpointer(f"{root}-{name}", dedupe=dedupe) as ck:
            ck.save(1, state).result(timeout=120)
    ref = full(state)
    dist.barrier()
    if rank == 0:
        torch.save(ref, out + ".hsdp_ref.pt")
    fresh = hsdp_model(seed=2)
    optim2 = torch.optim.Adam(fresh.parameters(), lr=0.01)
    msd2, osd2 = get_state_dict(fresh, optim2)
    with Checkpointer(f"{root}-spread") as ck:
        ck.load(into={"model": msd2, "optim": osd2})
    set_state_dict(fresh, optim2, model_state_dict=msd2, optim_state_dict=osd2)
    msd3, osd3 = get_state_dict(fresh, optim2)
    got = full({"model": msd3, "optim": osd3})
    res["diff"] = same(got, ref) if rank == 0 else []


def train_step_hsdp(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    torch.manual_seed(123)
    model(torch.randn(8, 16)).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()


def _leaves(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v)]
    return [obj]


def main() -> None:
    scenario, rank, world, port, root, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]
    saved = int(sys.argv[7]) if len(sys.argv) > 7 else world

    def run(res: dict[str, Any]) -> None:
        if scenario == "save":
            save(rank, world, root, out, res)
        elif scenario == "savekill":
            save(rank, world, root, out, res, kill=True)
        elif scenario == "ddp":
            ddp(rank, world, root, out, res)
        elif scenario == "savewide":
            save_wide(rank, world, root, out, res)
        elif scenario == "loadcorrupt":
            load_corrupt(rank, world, root, out, res)
        elif scenario == "ddp_load":
            ddp_load(rank, world, root, out, res)
        elif scenario == "hsdp":
            hsdp(rank, world, root, out, res)
        else:
            load(rank, world, saved, root, out, res)

    run_scenario(rank, world, port, out, run)


if __name__ == "__main__":
    main()
