"""DDP-like state on W gloo ranks: bytes written and time to durable with and without
``Checkpointer(dedupe=True)`` (the replicated state written once, writers spread).

    python benchmarks/ddp_dedupe.py --world 4 --mb 64 --root /tmp/bench-dd

Each rank holds ``--mb`` MB of tensors identical on every rank (the model and optimizer of
DDP) and 5 kB that differ (an RNG state). Reports the median of ``--saves`` saves (after one
warm-up save) on rank 0, as a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import timedelta


def rank_main(args: argparse.Namespace, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from asyncckpt import Checkpointer

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=args.world,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    n = args.mb * 1_000_000 // 4 // 8
    state = {
        "model": {f"w{i}": torch.randn(n, generator=g) for i in range(8)},
        "rng": torch.full((5056,), rank, dtype=torch.uint8),
    }
    out = {}
    for dedupe in (False, True):
        root = os.path.join(args.root, f"dedupe-{dedupe}")
        times = []
        with Checkpointer(root, dedupe=dedupe, keep_last=1) as ck:
            ck.save(0, state).result(timeout=300)  # warm-up: arenas, store connections
            for step in range(1, args.saves + 1):
                dist.barrier()
                t0 = time.perf_counter()
                info = ck.save(step, state).result(timeout=300)
                times.append(time.perf_counter() - t0)
        out[f"dedupe={dedupe}"] = {"durable_s": statistics.median(times), "nbytes": info.nbytes}
        dist.barrier()
    if rank == 0:
        print(json.dumps({"world": args.world, "mb_per_rank": args.mb, **out}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--root", default="/tmp/asyncckpt-bench-dedupe")
    p.add_argument("--port", type=int, default=29511)
    p.add_argument("--rank", type=int, default=None)
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args, args.rank)
        return
    shutil.rmtree(args.root, ignore_errors=True)
    argv = [sys.executable, __file__, *sys.argv[1:]]
    procs = [subprocess.Popen([*argv, "--rank", str(r)], stdout=subprocess.PIPE, text=True) for r in range(args.world)]
    outs = [pr.communicate(timeout=900)[0] for pr in procs]
    line = outs[0].strip().splitlines()[-1]
    res = json.loads(line)
    for k in ("dedupe=False", "dedupe=True"):
        print(f"{k:14} {res[k]['nbytes'] / 1e6:9.1f} MB written  durable {res[k]['durable_s']:.3f} s")
    print(line)
    shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
