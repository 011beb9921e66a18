"""A rank of the tied-DTensor test: a GPT-2-like FSDP2 model whose ``lm_head.weight`` is
``wte.weight``, saved by asyncckpt on one world size and loaded on another.

Run as ``python _tied_worker.py save|load RANK WORLD PORT ROOT OUT``; writes ``OUT.RANK.json``
and, for ``save`` on rank 0, ``OUT.ref.pt`` (the full tensors saved).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(__file__))
from _global_worker import full, same
from _ranks import run_scenario

from asyncckpt import Checkpointer

#: 3 rows: on 4 ranks FSDP2 gives the last rank an empty shard of the tied weight
VOCAB, DIM = 3, 8


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # GPT-2's tying

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.mid(self.wte(ids))))


def build(world: int, seed: int) -> tuple[TiedLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TiedLM()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.mid, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def save(rank: int, world: int, root: str, out: str, res: dict[str, Any]) -> None:
    model, optim = build(world, seed=1)
    model(torch.tensor([0, 1, 2, 1])).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    local = msd["wte.weight"].to_local()
    res["local_rows"] = int(local.shape[0])
    res["local_storage_bytes"] = int(local.untyped_storage().nbytes())
    state = {"model": msd, "optim": osd}
    with Checkpointer(root) as ck:
        ck.save(1, state).result(timeout=120)
    ref = full(state)  # collective
    if rank == 0:
        torch.save(ref, out + ".ref.pt")
    dist.barrier()


def load(rank: int, world: int, root: str, out: str, res: dict[str, Any]) -> None:
    model, optim = build(world, seed=99)  # other values than saved
    msd, osd = get_state_dict(model, optim)
    target = {"model": msd, "optim": osd}
    with Checkpointer(root) as ck:
        ck.load(into=target)
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    res["still_tied"] = model.lm_head.weight is model.wte.weight
    msd2, osd2 = get_state_dict(model, optim)
    got = full({"model": msd2, "optim": osd2})
    if rank == 0:
        ref = torch.load(out + ".ref.pt")
        res["diff"] = same(got, ref)


def main() -> None:
    scenario, rank, world, port, root, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]
    run = save if scenario == "save" else load
    run_scenario(rank, world, port, out, lambda res: run(rank, world, root, out, res))


if __name__ == "__main__":
    main()
