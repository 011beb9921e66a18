"""A rank that saves sharded state for the export tests (tests/test_export_sharded.py).

Run as ``python _export_worker.py SCENARIO RANK WORLD PORT ROOT OUT``:

- ``layouts`` (4 ranks): FSDP2 (uneven and empty shards), TP Shard(0)/Shard(1)/Replicate,
  FSDP x TP on a 2 x 2 mesh (strided), a bf16 DTensor, a tied plain tensor, a per-rank RNG
  value; rank 0 writes ``OUT.ref.pt``, the full tensors saved, by dotted name;
- ``two`` (2 ranks), into ``ROOT/gpt2``, ``ROOT/ddp``, ``ROOT/ddp_dedupe`` and ``ROOT/big``:
  a tiny GPT-2 (tied lm_head / wte) under FSDP2, its state dict saved with ``get_state_dict``
  (rank 0 writes ``OUT.ref.pt``: config, input ids, logits); a DDP-like state (the same model
  on both ranks, a per-rank value) without and with dedupe, each loaded back collectively
  with ``mmap=True`` (mapped per rank; refused with ``ValueError`` for the deduplicated
  one); 200 MiB of DTensors (Shard(1) 128 MiB, Shard(0) 64 MiB) plus 4 MiB of plain tensors
  per rank, values from :func:`big_value` so the test can recompute them.

Each rank writes ``OUT.RANK.json`` (``{"ok": true}`` or ``{"crash": traceback}``).
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

BIG = {"w1": ((8192, 4096), 1), "w0": ((4096, 4096), 0)}  # name: (global shape, sharded dim)


def big_value(name: str, rows: slice, cols: slice, shape: tuple[int, int]) -> torch.Tensor:
    """The saved values of the ``big`` scenario's tensor ``name`` for a block (cheap to recompute)."""
    r = torch.arange(shape[0])[rows].to(torch.float32)
    c = torch.arange(shape[1])[cols].to(torch.float32)
    seed = 1.0 if name == "w1" else 2.0
    return r[:, None] * seed + c[None, :] * 1e-3


def dotted(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state by dotted key path (DTensors gathered: collective)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, DTensor):
        out[prefix] = obj.full_tensor().detach().clone()
    elif isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().clone()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(dotted(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(dotted(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


class Net(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(6, hidden)
        self.down = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Pair(nn.Module):
    """Two nets side by side: hidden 5 (uneven shards on 4 ranks) and 3 (an empty shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Net(5)
        self.b = Net(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def layouts(rank: int, world: int, root: str, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from asyncckpt import Checkpointer

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1)
    model = Pair()
    for m in (model.a, model.b):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(8, 6)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    torch.manual_seed(7)
    base = torch.randn(5, 7)
    tp = {
        "s1": distribute_tensor(base, mesh, [Shard(1)]),
        "s0": distribute_tensor(base.t().contiguous(), mesh, [Shard(0)]),
        "rep": distribute_tensor(base[0].clone(), mesh, [Replicate()]),
        "bf16": distribute_tensor(torch.randn(9, 3).to(torch.bfloat16), mesh, [Shard(0)]),
        "scalar": distribute_tensor(torch.tensor(3.5), mesh, [Replicate()]),
    }
    torch.manual_seed(2)
    two_d = Net(8)
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(two_d, mesh2["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(two_d, mesh=mesh2["dp"])
    shared = torch.arange(6.0)
    state = {
        "model": msd,
        "optim": osd,
        "tp": tp,
        "tp2d": two_d.state_dict(),
        "tied": {"a": shared, "b": shared},  # one storage under two keys: stored once
        "rng": torch.full((3,), float(rank)),  # per rank
        "step": 7,
    }
    with Checkpointer(root) as ck:
        ck.save(1, state)
    ref = dotted(state)
    if rank == 0:
        torch.save(ref, out + ".ref.pt")


def gpt2(rank: int, world: int, root: str, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    from asyncckpt import Checkpointer

    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=16, vocab_size=50, tie_word_embeddings=True)
    torch.manual_seed(3)
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 50, (2, 10))
    with torch.no_grad():
        logits = model(ids).logits
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    msd, _ = get_state_dict(model, [])
    with Checkpointer(root) as ck:
        ck.save(1, {"model": msd, "step": 1})
    if rank == 0:
        torch.save({"config": config.to_dict(), "ids": ids, "logits": logits}, out + ".ref.pt")


def big(rank: int, world: int, root: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from asyncckpt import Checkpointer

    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {}
    for name, (shape, dim) in BIG.items():
        part = shape[dim] // world
        own = slice(rank * part, (rank + 1) * part)
        rows, cols = (own, slice(None)) if dim == 0 else (slice(None), own)
        local = big_value(name, rows, cols, shape)
        stride = torch.Size((shape[1], 1))
        state[name] = DTensor.from_local(
            local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape), stride=stride
        )
    state["plain"] = torch.full((1 << 20,), float(rank))  # 4 MiB, per rank
    with Checkpointer(root) as ck:
        ck.save(1, state)


def ddp_state(rank: int) -> dict[str, Any]:
    """What a DDP rank saves: the same model everywhere, a per-rank value."""
    torch.manual_seed(5)
    return {"model": Net(4).state_dict(), "rng": torch.full((3,), float(rank)), "epoch": 2}


def two(rank: int, world: int, root: str, out: str) -> None:
    from asyncckpt import Checkpointer

    try:
        import transformers  # noqa: F401
    except ImportError:
        pass  # the from_pretrained test skips; the others still run
    else:
        gpt2(rank, world, os.path.join(root, "gpt2"), out)
    for name, dedupe in (("ddp", False), ("ddp_dedupe", True)):
        with Checkpointer(os.path.join(root, name), dedupe=dedupe) as ck:
            ck.save(1, ddp_state(rank))
            ck.flush()
            # the collective load with mmap=True: each rank maps its own shard
            if dedupe:
                try:
                    ck.load(mmap=True)
                    raise AssertionError("an indexed step was mapped")
                except ValueError as e:
                    assert "global index" in str(e), e
            else:
                got, want = ck.load(mmap=True), ddp_state(rank)
                assert torch.equal(got["rng"], want["rng"]) and got["epoch"] == 2
                assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
                with open("/proc/self/maps") as f:
                    assert f"rank{rank:05d}.safetensors" in f.read()
    big(rank, world, os.path.join(root, "big"), out)


def main() -> None:
    scenario, rank_s, world_s, port, root, out = sys.argv[1:7]
    rank, world = int(rank_s), int(world_s)
    res: dict[str, Any] = {}
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        {"layouts": layouts, "two": two}[scenario](rank, world, root, out)
        dist.barrier()
        res["ok"] = True
    except BaseException:  # noqa: BLE001 - reported to the test
        res["crash"] = traceback.format_exc()
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(res, f)
    os._exit(0)


if __name__ == "__main__":
    main()
