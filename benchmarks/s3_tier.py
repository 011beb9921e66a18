"""Tier mode against a plain local save and against a push after the fact, on a loopback SeaweedFS.

    python benchmarks/s3_tier.py                      # 128 MiB, median of 5
    python benchmarks/s3_tier.py --size-mib 256 --repeats 7 --out benchmarks/results/s3-tier-2026-12-03

In one run, on one server, the same state (4 float32 tensors) saved per repeat by:

- ``local``: ``Checkpointer(root)``: ``save()`` returns (blocking), ``handle.result()`` (local
  durability: fsynced and committed);
- ``tier``: ``Checkpointer(root, mirror=url)``: the same two times, then ``flush()`` (remote
  durability: the step's manifest created on the store);
- ``push``: a plain local save, then ``remote.push(root, url, steps=[step])`` once it is
  durable: remote durability = local durability + the push;
- ``tier, previous upload running``: a tier save taken right after the previous step committed
  locally, so its local commit overlaps that step's upload, and its upload waits for it (the
  worst case of back-to-back saves: remote durability then includes the rest of the previous
  upload).

Each mode has its own Checkpointer, warmed up by one save that is not counted (the first
save allocates the staging buffer; the first upload probes the store). Loopback has no link
limit: the times measure client + server CPU on this machine (the server spends ~15 CPU-s
per GiB written), so compare the rows with each other, not the MiB/s with a real network.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

import torch
from s3server import S3Server

from asyncckpt import Checkpointer, remote

MiB = 1024 * 1024
BUCKET = "tierbench"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="directory for results.json and table.txt")
    args = ap.parse_args()
    size = args.size_mib * MiB
    work = Path(tempfile.mkdtemp(prefix="s3tier-"))
    # SeaweedFS reclaims deleted space only when it vacuums: size it for every step of every mode
    # (at 1 GiB, 64 volumes of 256 MiB filled up and the server answered 500 InternalError)
    server = S3Server(volumes=max(64, 3 * 2 * (args.repeats + 2) * args.size_mib // 256 + 16))
    rows: dict[str, dict[str, list[float]]] = {
        "local": {"blocking": [], "local durable": []},
        "tier": {"blocking": [], "local durable": [], "remote durable": []},
        "push after local": {"blocking": [], "local durable": [], "remote durable": []},
        "tier, previous upload running": {"blocking": [], "local durable": [], "remote durable": []},
    }
    try:
        server.start()
        server.create_bucket(BUCKET)
        opts = server.storage_options()
        g = torch.Generator().manual_seed(0)
        state = {f"t{i}": torch.randn(size // 16, generator=g) for i in range(4)}
        tag = uuid.uuid4().hex[:8]
        tier_url, push_url = f"s3://{BUCKET}/tier-{tag}", f"s3://{BUCKET}/push-{tag}"
        plain = Checkpointer(work / "plain", keep_last=2)
        tier = Checkpointer(work / "tier", keep_last=2, mirror=tier_url, keep_last_remote=2, storage_options=opts,
                            timeout=900)
        pushed = Checkpointer(work / "pushed", keep_last=2)
        overlap = Checkpointer(work / "overlap", keep_last=2, mirror=tier_url + "-overlap", keep_last_remote=2,
                               storage_options=opts, timeout=900)
        try:
            for step in range(args.repeats + 1):
                counted = step > 0  # step 0 warms up every path
                for name in ("local", "tier", "push after local"):
                    ck = {"local": plain, "tier": tier, "push after local": pushed}[name]
                    t0 = time.perf_counter()
                    h = ck.save(step, state)
                    t_block = time.perf_counter() - t0
                    h.result(timeout=900)
                    t_local = time.perf_counter() - t0
                    t_remote = None
                    if name == "tier":
                        ck.flush(timeout=900)
                        t_remote = time.perf_counter() - t0
                    elif name == "push after local":
                        remote.push(ck.root, push_url, steps=[step], keep_last=2, storage_options=opts)
                        t_remote = time.perf_counter() - t0
                    if counted:
                        r = rows[name]
                        r["blocking"].append(t_block)
                        r["local durable"].append(t_local)
                        if t_remote is not None:
                            r["remote durable"].append(t_remote)
                overlap.save(2 * step, state).result(timeout=900)  # its upload starts now
                t0 = time.perf_counter()
                h = overlap.save(2 * step + 1, state)
                t_block = time.perf_counter() - t0
                h.result(timeout=900)
                t_local = time.perf_counter() - t0
                overlap.flush(timeout=900)
                t_remote = time.perf_counter() - t0
                if counted:
                    r = rows["tier, previous upload running"]
                    r["blocking"].append(t_block)
                    r["local durable"].append(t_local)
                    r["remote durable"].append(t_remote)
        finally:
            for ck in (plain, tier, pushed, overlap):
                ck.close()
        assert torch.equal(remote.load(tier_url, storage_options=opts)["t0"], state["t0"])
    finally:
        server.close()
        shutil.rmtree(work, ignore_errors=True)
    med = {m: {k: statistics.median(v) for k, v in r.items()} for m, r in rows.items()}
    lines = [f"{args.size_mib} MiB state (4 tensors), SeaweedFS on loopback, {os.cpu_count()} CPUs, "
             f"median of {args.repeats}",
             f"{'mode':30s} {'blocking':>9s} {'local durable':>14s} {'remote durable':>15s}"]
    for m, r in med.items():
        rd = f"{r['remote durable']:13.2f} s" if "remote durable" in r else f"{'-':>15s}"
        lines.append(f"{m:30s} {r['blocking']:7.3f} s {r['local durable']:12.3f} s {rd}")
    local_ratio = med["tier"]["local durable"] / med["local"]["local durable"]
    remote_ratio = med["tier"]["remote durable"] / med["push after local"]["remote durable"]
    lines.append(f"tier local durable / plain local durable: {local_ratio:.2f}x; "
                 f"tier remote durable / push after local: {remote_ratio:.2f}x")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result: dict[str, Any] = {
            "size_mib": args.size_mib, "repeats": args.repeats, "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "time": time.time(),
            "samples_s": rows, "median_s": med,
        }
        (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "table.txt").write_text(table + "\n")


if __name__ == "__main__":
    main()
