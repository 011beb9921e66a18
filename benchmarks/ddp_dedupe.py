"""DDP-like state on W gloo ranks: bytes written and time to durable with dedupe (the default:
the replicated state written once, writers spread) against the replicated write
(``Checkpointer(dedupe=False)``), side by side in one run.

    python benchmarks/ddp_dedupe.py --world 4 --mb 64 --saves 7 --json out.json

Each rank holds ``--mb`` MB of tensors identical on every rank (the model and optimizer of
DDP) and 5 kB that differ (an RNG state). The two Checkpointers are open at once and saved
alternately (one warm-up save each), so both see the same machine; after every save rank 0
removes the previous step outside the timed region (no retention inside the time). Time to
durable is ``save()`` until rank 0's handle resolves (the commit is on disk), medians of
``--saves``. The phases (rank 0's ``SaveStatistics``) show where the time goes; ``--phases``
also times the writer's steps on every rank (start after ``save()`` was called, duration).
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
from typing import Any

TARGET = 0.4  # issue 10: deduplicated time to durable at 4 ranks <= 0.4 x the replicated write


#: the writer-side steps ``--phases`` times (private functions: a profile, not an API)
PHASES = (
    ("saving._dedupe", "digests", False),
    ("saving._dedupe", "image", False),
    ("format._index", "rank_part", False),
    ("ranks._coordination", "StoreCoordinator.begin", True),
    ("ranks._coordination", "StoreCoordinator.exchange", True),
    ("ranks._coordination", "StoreCoordinator.report", True),
    ("ranks._coordination", "StoreCoordinator.decide", True),
    ("roots.posix._storage", "Storage.write_file", True),
    ("roots.posix._storage", "Storage.write_bytes", True),
    ("roots._backend", "PosixBackend.prepare", True),
    ("roots._backend", "PosixBackend.seal", True),
    ("saving._commit", "commit_attempt", True),
)


def _instrument(log: dict[str, list[tuple[float, float]]]) -> None:
    """Wrap each of :data:`PHASES` so its (start, end) times land in ``log``."""
    import importlib

    for mod_name, path, is_async in PHASES:
        owner: Any = importlib.import_module(f"asyncckpt.{mod_name}")
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        fn = getattr(owner, name)

        def wrap(fn: Any = fn, name: str = name, is_async: bool = is_async) -> Any:
            if is_async:

                async def timed_async(*a: Any, **k: Any) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return await fn(*a, **k)
                    finally:
                        log.setdefault(name, []).append((t0, time.perf_counter()))

                return timed_async

            def timed(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    log.setdefault(name, []).append((t0, time.perf_counter()))

            return timed

        setattr(owner, name, wrap())


def rank_main(args: argparse.Namespace, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from asyncckpt import Checkpointer

    log: dict[str, list[tuple[float, float]]] = {}
    if args.phases:
        _instrument(log)

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=args.world,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    n = args.mb * 1_000_000 // 4 // 8
    state = {
        "model": {f"w{i}": torch.randn(n, generator=g) for i in range(8)},
        "rng": torch.full((5056,), rank, dtype=torch.uint8),
    }
    variants = {"replicated (dedupe=False)": False, "dedupe (default)": True}
    cks = {name: Checkpointer(os.path.join(args.root, str(d)), dedupe=d) for name, d in variants.items()}
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    phases: dict[str, list[dict[str, list[float]]]] = {name: [] for name in variants}
    nbytes: dict[str, int] = {}
    for step in range(args.saves + 1):
        for name, ck in cks.items():
            dist.barrier()
            log.clear()
            t0 = time.perf_counter()
            h = ck.save(step, state)
            blocking = time.perf_counter() - t0
            info = h.result(timeout=300)
            durable = time.perf_counter() - t0
            if step > 0 and args.phases:  # [start, duration] after save() was called
                p = {k: [v[0][0] - t0, sum(b - a for a, b in v)] for k, v in log.items()}
                p["save() returned"] = [blocking, 0.0]
                p["handle resolved"] = [durable, 0.0]
                got: list[Any] = [None] * args.world
                dist.all_gather_object(got, p)
                phases[name].append(got)  # type: ignore[arg-type]
            dist.barrier()
            if rank == 0 and step > 0:
                shutil.rmtree(os.path.join(ck.root, f"step_{step - 1:08d}"))
            if step == 0:
                continue  # warm-up: arenas, store connections
            s = info.statistics
            samples[name].append(
                {"durable_s": durable, "staging_s": s.staging_s, "write_s": s.write_s, "fsync_s": s.fsync_s,
                 "commit_s": s.commit_s}
            )  # fmt: skip
            nbytes[name] = info.nbytes
    for ck in cks.values():
        ck.close()
    if rank == 0:
        out = {
            name: {
                "nbytes": nbytes[name],
                **{k: statistics.median(x[k] for x in xs) for k in xs[0]},
                "durable_all_s": [round(x["durable_s"], 4) for x in xs],
            }
            for name, xs in samples.items()
        }
        if args.phases:
            for name in variants:
                runs = phases[name]  # per save: per rank: phase -> [start, duration]
                out[name]["phases"] = {
                    str(r): {
                        k: [round(statistics.median(run[r][k][i] for run in runs if k in run[r]), 4) for i in (0, 1)]
                        for k in sorted(set().union(*(run[r] for run in runs)), key=lambda k: runs[0][r].get(k, [9])[0])
                    }
                    for r in range(args.world)
                }
        print("RESULT " + json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--mb", type=int, default=64, help="replicated MB per rank")
    p.add_argument("--saves", type=int, default=7, help="timed saves per variant (medians; >= 5)")
    p.add_argument("--root", default="/tmp/asyncckpt-bench-dedupe")
    p.add_argument("--port", type=int, default=29511)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--phases", action="store_true", help="also time the writer's steps on every rank (a profile)")
    p.add_argument("--rank", type=int, default=None)
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args, args.rank)
        return
    shutil.rmtree(args.root, ignore_errors=True)
    argv = [sys.executable, __file__, *sys.argv[1:]]
    procs = [subprocess.Popen([*argv, "--rank", str(r)], stdout=subprocess.PIPE, text=True) for r in range(args.world)]
    outs = [pr.communicate(timeout=1800)[0] for pr in procs]
    res: dict[str, Any] = json.loads(next(x for x in outs[0].splitlines() if x.startswith("RESULT "))[7:])
    print(f"DDP on {args.world} gloo ranks, {args.mb} MB replicated per rank, medians of {args.saves} saves")
    print(f"{'':28}{'written':>10}{'durable':>10}{'staging':>10}{'write':>9}{'fsync':>9}{'commit':>9}")
    for k, v in res.items():
        print(
            f"{k:28}{v['nbytes'] / 1e6:8.1f}MB{v['durable_s']:9.3f}s{v['staging_s']:9.3f}s"
            f"{v['write_s']:8.3f}s{v['fsync_s']:8.3f}s{v['commit_s']:8.3f}s"
        )
    for k, v in res.items():
        for r, ph in v.get("phases", {}).items():
            print(f"{k}, rank {r}: " + ", ".join(f"{n} @{a:.3f}s +{d:.3f}s" for n, (a, d) in ph.items()))
    base, dd = res["replicated (dedupe=False)"], res["dedupe (default)"]
    ratio = dd["durable_s"] / base["durable_s"]
    verdict = "met" if ratio <= TARGET else "NOT met"
    print(f"dedupe / replicated time to durable: {ratio:.2f}x (target <= {TARGET}x: {verdict})")
    doc = {"world": args.world, "mb_per_rank": args.mb, "saves": args.saves, "results": res, "ratio": ratio,
           "target": TARGET, "met": ratio <= TARGET}  # fmt: skip
    print(json.dumps(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
