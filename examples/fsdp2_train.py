"""FSDP2 training that checkpoints asynchronously, is killed, and resumes on another number of ranks.

    # 2 ranks, killed (SIGKILL, every rank) right after the save of step 8 was handed over
    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/fsdp2_train.py --root runs/fsdp2 --kill-at 8
    # resume on 4 ranks from the newest complete step (4 or 8), to step 16
    .venv/bin/torchrun --standalone --nproc_per_node=4 examples/fsdp2_train.py --root runs/fsdp2

gloo on CPU, NCCL when CUDA is present. The model is sharded with ``fully_shard`` (each
parameter and Adam moment a DTensor, ``Shard(0)`` over the ranks); every ``--save-every``
steps ``Checkpointer.save`` stages the state returned by ``get_state_dict(model, optim)`` and
returns, the write goes on in the background. Resuming builds a fresh model and optimizer on
the new world size and restores them the way DCP users do: ``get_state_dict`` (which also
creates the optimizer state), ``ckpt.load(into=...)``, ``set_state_dict``. Each rank reads
only the chunks overlapping its new shards.

What is and is not identical after a resume on another world size:

- the model and the optimizer (parameters, Adam moments, step counts, hyper-parameters) are
  **bit-identical** to the saved ones: ``--ref-dir`` makes each save also write the full
  (gathered) tensors, and a resume compares every one of them bit for bit and says so;
- the data is the same: each step's global batch comes from a generator seeded by the step,
  split evenly over the ranks, so every world size trains on the same examples;
- the losses are those of a same-world resume **up to float rounding**: with another number
  of ranks the gradient reduce-scatter and the loss all-reduce add the per-rank parts in
  another order, so the sums can differ in their last bits and the difference grows slowly
  over the steps (measured on gloo/CPU, tests/test_fsdp2_example.py, 2 -> 4 ranks: at most
  1.1e-7 relative over 4 steps). A resume on the same number of ranks repeats the
  uninterrupted run's losses bit for bit.

``--loss-log FILE`` (rank 0) appends one JSON line per step (``{"step", "loss", "world"}``)
and one per resume (``{"resumed", "world", "identical"}``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

# deterministic cuBLAS (torch.use_deterministic_algorithms below refuses CUDA matmuls without it)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

if os.environ.get("RANK", "0") == "0":
    # importing torch in several processes at once takes a while on a small machine: say so
    print(
        f"rank 0: importing torch, {os.environ.get('WORLD_SIZE', '1')} rank(s) on {os.cpu_count()} core(s)...",
        file=sys.stderr,
        flush=True,
    )

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from asyncckpt import Checkpointer

BATCH = 16  # the global batch: divisible by 1, 2, 4, 8 and 16 ranks
WIDTH = 48


def build(device: torch.device, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same initial model on every rank and world size, sharded over all ranks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 1)).to(
        device
    )
    mesh = init_device_mesh(device.type, (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def batch(step: int, rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of step ``step``'s global batch (the same examples at any world size)."""
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(BATCH, 24, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    part = BATCH // world
    return x[rank * part : (rank + 1) * part].to(device), y[rank * part : (rank + 1) * part].to(device)


def full(obj: Any) -> Any:
    """``obj`` with every DTensor gathered into its full tensor, on the CPU (collective)."""
    if isinstance(obj, DTensor):
        return obj.full_tensor().cpu()
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: full(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [full(v) for v in obj]
    return obj


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two gathered states differ (tensors bit for bit, dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        return [] if ok and a.shape == b.shape and torch.equal(a, b) else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys differ"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}.{i}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="runs/fsdp2")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--kill-at", type=int, default=None, help="SIGKILL every rank right after this step's save")
    ap.add_argument("--ref-dir", default=None, help="write the gathered state at each save; check it at resume")
    ap.add_argument("--loss-log", default=None, help="rank 0 appends one JSON line per step here")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.use_deterministic_algorithms(True)

    def log(record: dict[str, Any]) -> None:
        if rank == 0:
            print(json.dumps(record), flush=True)
            if args.loss_log:
                with open(args.loss_log, "a") as f:
                    f.write(json.dumps(record) + "\n")

    model, optim = build(device, world)
    start = 0
    with Checkpointer(args.root, keep_last=3, timeout=120) as ckpt:
        if ckpt.latest() is not None:  # collective: every rank gets rank 0's answer
            msd, osd = get_state_dict(model, optim)  # a fresh optimizer's state is created here
            state = ckpt.load(into={"model": msd, "optim": osd})  # each rank: only its chunks
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
            start = state["step"] + 1
            identical = None
            ref_file = args.ref_dir and os.path.join(args.ref_dir, f"step{state['step']}.pt")
            if ref_file and os.path.exists(ref_file):
                now = full(dict(zip(("model", "optim"), get_state_dict(model, optim), strict=True)))
                if rank == 0:
                    differ = differences(torch.load(ref_file, weights_only=True), now)
                    identical = not differ
                    if differ:
                        print(f"NOT bit-identical after the resume: {differ[:5]}", file=sys.stderr)
            log({"resumed": state["step"], "world": world, "identical": identical})
        for step in range(start, args.steps):
            x, y = batch(step, rank, world, device)
            loss = nn.functional.mse_loss(model(x), y)  # FSDP2 averages the gradients over the ranks
            loss.backward()
            optim.step()
            optim.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            log({"step": step, "loss": total.item() / world, "world": world})
            if step % args.save_every == 0:
                msd, osd = get_state_dict(model, optim)
                if args.ref_dir:
                    ref = full({"model": msd, "optim": osd})
                    if rank == 0:
                        os.makedirs(args.ref_dir, exist_ok=True)
                        torch.save(ref, os.path.join(args.ref_dir, f"step{step}.pt"))
                ckpt.save(step, {"model": msd, "optim": osd, "step": step})  # returns once staged
                if step == args.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-save: the write is still going on
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
