"""Data-parallel training on CPU (gloo) that checkpoints asynchronously and resumes.

    .venv/bin/torchrun --nproc_per_node=4 examples/distributed_train.py --root runs/ddp --steps 60

Every rank saves its state (model replica, optimizer state, its data position); the model and
optimizer, identical on every rank, are written once in total, spread over the ranks, and each
rank's data position stays its own; rank 0 commits once all ranks reported success. Kill it at
any point (Ctrl-C, kill -9 one rank) and run the same command again: every rank resumes from
the same newest complete step.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

if os.environ.get("RANK", "0") == "0":
    # importing torch in several processes at once takes a while on a small machine: say so
    print(f"rank 0: importing torch and joining the gloo group of {os.environ.get('WORLD_SIZE', '1')} "
          f"rank(s) on {os.cpu_count()} core(s)...", file=sys.stderr, flush=True)

import torch
import torch.distributed as dist

from asyncckpt import Checkpointer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="runs/ddp")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-every", type=int, default=10)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(name)s %(message)s")
    torch.manual_seed(0)  # identical initial replicas
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own data stream

    start = 0
    with Checkpointer(args.root, keep_last=3, timeout=120) as ckpt:
        if ckpt.latest() is not None:  # collective: every rank gets rank 0's answer
            state = ckpt.load(into={"model": model, "optim": optim})
            data.set_state(state["data"])
            start = state["step"] + 1
            if rank == 0:
                print(f"resumed from step {state['step']}")
        for step in range(start, args.steps):
            x = torch.randn(32, 64, generator=data)
            y = x.sum(dim=1, keepdim=True)
            t0 = time.perf_counter()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            optim.zero_grad()
            loss.backward()  # gradient all-reduce on the training group
            optim.step()
            stall = 0.0
            if step % args.save_every == 0:
                s0 = time.perf_counter()
                ckpt.save(step, {"model": model, "optim": optim, "data": data.get_state(), "step": step})
                stall = time.perf_counter() - s0
            if rank == 0:
                print(f"step {step:4d} loss {loss.item():.4f} step {1e3 * (time.perf_counter() - t0):6.1f} ms"
                      + (f"  save stall {1e3 * stall:.1f} ms" if stall else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
