"""A rank of the real-model tests: transformers' Llama at a tiny config (random init from a
config, nothing downloaded), tensor-parallel by its own TP plan (``config.base_model_tp_plan``,
applied with torch's ``parallelize_module``) over ``mesh["tp"]`` and FSDP2 over ``mesh["dp"]``
of a 2 x 2 mesh: the norms, embeddings and output layer (and their Adam states) are sharded
over dp only, so each lies on two dp sub-meshes, one per tp column (issue 28).

Run as ``python _llama_worker.py SCENARIO RANK WORLD PORT ROOT OUT``; writes ``OUT.RANK.json``.
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
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM

from asyncckpt import Checkpointer, SaveError

CONFIG = {
    "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
    "attn_implementation": "eager",
}  # fmt: skip
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def tp_plan(model: LlamaForCausalLM) -> dict[str, Any]:
    """The model's own TP plan (``layers.*.self_attn.q_proj: colwise``, ...) for every layer."""
    plan: dict[str, Any] = {}
    for pattern, style in model.config.base_model_tp_plan.items():
        for i in range(model.config.num_hidden_layers):
            plan["model." + pattern.replace("*", str(i))] = STYLES[style]()
    return plan


def build(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``2d``: TP by its plan over tp, FSDP2 over dp of a 2 x 2 mesh; ``fsdp``: FSDP2 over every rank."""
    model = tiny_llama(seed)
    world = dist.get_world_size()
    if kind == "2d":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan(model))
        dp = mesh["dp"]
    else:
        dp = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_step(model: nn.Module, optim: torch.optim.Optimizer) -> float:
    torch.manual_seed(123)  # the same batch on every rank
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return float(loss)


def full(obj: Any) -> Any:
    if isinstance(obj, DTensor):
        return obj.full_tensor().detach().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: full(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full(v) for v in obj)
    return obj


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        return [] if ok and a.shape == b.shape and torch.equal(a, b) else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))[:5]}"]
        return [d for k in a for d in diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in diff(x, y, f"{path}.{i}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def leaves(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in leaves(v)]
    return [obj]


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def restored(kind: str, load: Any) -> Any:
    """A fresh ``kind`` model and optimizer filled by ``load(state)`` (asyncckpt or DCP), as
    full tensors, and one more training step's loss from there."""
    model, optim = build(kind, seed=99)
    msd, osd = get_state_dict(model, optim)  # materializes the optimizer state: a load target
    load({"model": msd, "optim": osd})
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    msd, osd = get_state_dict(model, optim)
    got = full({"model": msd, "optim": osd})
    return got, train_step(model, optim)


def save2d(rank: int, root: str, out: str, res: dict[str, Any]) -> None:
    """Save on 2 x 2 (with DCP beside), load back on 2 x 2 and on FSDP over all 4 ranks."""
    import torch.distributed.checkpoint as dcp

    model, optim = build("2d", seed=1)
    train_step(model, optim)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    ref = full(state)
    res["next_loss"] = None
    with Checkpointer(root, timeout=60) as ck:
        t0 = time.perf_counter()
        info = ck.save(1, state).result(timeout=60)
        res["durable_s"] = time.perf_counter() - t0
        res["nbytes"] = info.nbytes
    dcp.save(state, checkpoint_id=root + ".dcp")
    dist.barrier()
    if rank == 0:
        torch.save(ref, out + ".ref.pt")
        res["bytes"] = du(os.path.join(root, "step_00000001"))
        res["dcp_bytes"] = du(root + ".dcp")
        res["dtensor_bytes"] = sum(v.numel() * v.element_size() for v in leaves(state) if isinstance(v, DTensor))
    ref_loss = train_step(model, optim)  # what the saved run computes next
    for kind in ("2d", "fsdp"):
        with Checkpointer(root, timeout=60) as ck:
            got, loss = restored(kind, lambda target: ck.load(1, into=target))
        theirs, dcp_loss = restored(kind, lambda target: dcp.load(target, checkpoint_id=root + ".dcp"))
        res[kind] = {
            "diff": diff(got, ref), "dcp_diff": diff(got, theirs),
            "loss": loss, "dcp_loss": dcp_loss, "ref_loss": ref_loss,
        }  # fmt: skip


def savekill(rank: int, root: str, out: str, res: dict[str, Any]) -> None:
    """Save step 1 on 2 x 2; the last rank dies in the middle of step 2's save."""
    model, optim = build("2d", seed=1)
    train_step(model, optim)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    with Checkpointer(root, timeout=10) as ck:
        ck.save(1, state).result(timeout=60)
        ref = full(state)
        if rank == 0:
            torch.save(ref, out + ".ref.pt")
        train_step(model, optim)  # step 2 holds other values
        dist.barrier()
        handle = ck.save(2, state)
        if rank == dist.get_world_size() - 1:
            os._exit(9)  # staged, the dedupe round and the writes under way
        try:
            handle.result(timeout=60)
            res["second"] = "committed"
        except SaveError as e:
            res["second"] = type(e).__name__
        try:
            ck.flush()
        except SaveError:
            pass


def resume(rank: int, root: str, out: str, res: dict[str, Any]) -> None:
    """Resume on another mesh (FSDP2 over this job's ranks) from the newest complete step."""
    with Checkpointer(root, timeout=60) as ck:
        res["steps"] = ck.steps()
        got, _ = restored("fsdp", lambda target: ck.load(into=target))
    if rank == 0:
        res["diff"] = diff(got, torch.load(out + ".ref.pt"))


SCENARIOS = {"save2d": save2d, "savekill": savekill, "resume": resume}


def main() -> None:
    scenario, rank, world, port, root, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]
    run_scenario(rank, world, port, out, lambda res: SCENARIOS[scenario](rank, root, out, res))


if __name__ == "__main__":
    main()
