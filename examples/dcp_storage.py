"""DCP (``torch.distributed.checkpoint``) saving and loading through asyncckpt's storage layer.

    # 2 ranks: train, dcp.async_save every 2 steps into runs/dcp/step_0000000N
    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/dcp_storage.py --root runs/dcp --steps 6
    # resume on 3 ranks from the newest complete step (DCP reshards), train to step 10
    .venv/bin/torchrun --standalone --nproc_per_node=3 examples/dcp_storage.py --root runs/dcp --steps 10
    .venv/bin/asyncckpt ls runs/dcp && .venv/bin/asyncckpt verify runs/dcp --all

    # or one process, no torchrun
    .venv/bin/python examples/dcp_storage.py --root runs/dcp1 --steps 4

The training code stays DCP code: ``get_state_dict`` / ``dcp.async_save`` / ``dcp.load`` /
``set_state_dict``. Only the storage changes: ``StorageWriter(root, step=N)`` and
``StorageReader(root, step=N)`` from ``asyncckpt.integrations.dcp``. Each save becomes a
committed asyncckpt step (CRC-32C'd, fsynced, renamed into place once complete), so the
newest complete one is found with ``asyncckpt.find_latest`` (a save killed midway is never
picked), and each read is checked against its CRC-32C. The model is sharded with FSDP2
(``fully_shard``) over gloo on CPU.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import asyncckpt
from asyncckpt.integrations.dcp import StorageReader, StorageWriter


def build(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="the asyncckpt root (one step_N directory per save)")
    ap.add_argument("--steps", type=int, default=6, help="train up to this step")
    ap.add_argument("--save-every", type=int, default=2)
    args = ap.parse_args()

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    # dcp.async_save runs its collectives on a background thread: give it a group of its own,
    # or they interleave with the training collectives differently on each rank (a hang)
    save_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    model, optim = build(world)

    start = 0
    latest = asyncckpt.find_latest(args.root)  # the newest *complete* step; torch-free scan
    if latest is not None:
        msd, osd = get_state_dict(model, optim)  # the target layout on this world size
        state = {"model": msd, "optim": osd, "trainer": {"step": 0}}
        dcp.load(state, storage_reader=StorageReader(args.root, step=latest.step))
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = state["trainer"]["step"]
        if rank == 0:
            print(f"resumed from step {start} (saved by {latest.world_size} rank(s), now {world})", flush=True)

    pending = None
    for step in range(start + 1, args.steps + 1):
        g = torch.Generator().manual_seed(step)  # the same global batch at any world size
        x = torch.randn(8 * world, 16, generator=g).chunk(world)[rank]
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        if step % args.save_every == 0:
            if pending is not None:
                pending.result()  # one save in flight at a time: the next waits for the last
            msd, osd = get_state_dict(model, optim)
            state = {"model": msd, "optim": osd, "trainer": {"step": step}}
            pending = dcp.async_save(
                state, storage_writer=StorageWriter(args.root, step=step), process_group=save_group
            )
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}, saving in the background", flush=True)
    if pending is not None:
        pending.result()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
