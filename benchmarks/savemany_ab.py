"""Saves of many tensors (issue 32, problem 3): A/B of two checkouts of asyncckpt, one process
per case, alternating.

    python benchmarks/savemany_ab.py --a /path/to/base --b /path/to/new \
        --counts 100000,300000 --size 1G --rounds 3 --out benchmarks/results/<dir>

Each case is a fresh process importing one checkout (``PYTHONPATH``), building the ``small``
state of ``states.py`` (``--size`` bytes in N tensors, optimizer-shaped), then:

* memory: a new ``Checkpointer(root, keep_last=1)``'s first two saves, each to durable, with
  VmHWM reset before (``/proc/self/clear_refs``); the peak above the RSS before, less the
  staging buffer (the shard's size rounded to pages), per tensor: what the issue's target
  (<= 1 KiB a tensor above the staging buffer) measures;
* then ``--saves`` more saves, each timed around ``save()`` alone: wall (blocking), and the
  process CPU time (``getrusage``: every thread, the writer's streaming included) and the
  caller thread's CPU time (``time.thread_time``), the collector's passes inside ``save()``
  (``gc.callbacks``); and the memcpy limit of the same tensors before each (``copy_`` of each
  into a preallocated one, as ``growth.py``).

Fixed work per tensor = (blocking - memcpy limit) / N, as the growth run computes it. On a
shared machine the wall figures carry the neighbours' noise; memory and the caller's CPU
time are the robust ones. Writes ``results.json`` and ``README.md`` (medians) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import ctypes, gc, json, os, resource, shutil, sys, time
sys.path.insert(0, {here!r})
import torch
import asyncckpt
from states import StateSpec, build_state
n, size, saves, root = {n}, {size}, {saves}, {root!r}
state = build_state(StateSpec("small", size, n))
src = [t for d in (state["model"], *state["optim"]["state"].values()) for t in d.values()]
dst = [torch.empty_like(t) for t in src]

def memcpy():
    t0 = time.perf_counter()
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.copy_(s)
    return time.perf_counter() - t0

def kb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

passes = []
gc.callbacks.append(lambda phase, info: passes.append(time.perf_counter()) if phase == "start" else None)
memcpy()
ctypes.CDLL("libc.so.6").malloc_trim(0)
base = kb("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
ck = asyncckpt.Checkpointer(root, keep_last=1)
t0 = time.perf_counter()
ck.save(1, state).result()
first_s = time.perf_counter() - t0
ck.save(2, state).result()
peak = kb("VmHWM") - base
shard = os.path.getsize(os.path.join(root, "step_00000002", "rank00000.safetensors"))
staging = -(-shard // 4096) * 4096
rows = []
for i in range(saves):
    limit = memcpy()
    r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
    h = ck.save(3 + i, state)
    t1, c1, r1 = time.perf_counter(), time.thread_time(), resource.getrusage(resource.RUSAGE_SELF)
    gcs = sum(1 for p in passes if t0 <= p < t1)
    h.result()
    rows.append(dict(blocking_s=t1 - t0, memcpy_s=limit, caller_cpu_s=c1 - c0,
                     process_cpu_s=(r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime), gc_passes=gcs))
ck.close()
shutil.rmtree(root, ignore_errors=True)
print("RESULT " + json.dumps(dict(n=n, module=asyncckpt.__file__, peak_bytes=peak, staging_bytes=staging,
                                  first_save_s=first_s, bytes_per_tensor=(peak - staging) / n, saves=rows)))
"""


def run_case(checkout: str, n: int, size: int, saves: int, scratch: str) -> dict[str, Any]:
    root = tempfile.mkdtemp(dir=scratch)
    code = CHILD.format(here=HERE, n=n, size=size, saves=saves, root=root)
    env = {**os.environ, "PYTHONPATH": checkout}
    try:
        # cwd: not a checkout (``python -c`` puts the working directory first on sys.path)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=1800, check=False
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            res: dict[str, Any] = json.loads(line[7:])
            assert res["module"].startswith(os.path.abspath(checkout)), (res["module"], checkout)
            return res
    raise RuntimeError(f"case failed ({out.returncode}): {out.stderr[-2000:]}")


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def figures(cases: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over a side's processes of each process's median save (and its memory)."""
    n = cases[0]["n"]

    def per(key: str) -> list[float]:
        return [med([s[key] for s in c["saves"]]) for c in cases]

    fixed = [med([(s["blocking_s"] - s["memcpy_s"]) / n * 1e6 for s in c["saves"]]) for c in cases]
    return {
        "bytes_per_tensor": med([c["bytes_per_tensor"] for c in cases]),
        "first_save_s": med([c["first_save_s"] for c in cases]),
        "blocking_s": med(per("blocking_s")),
        "memcpy_s": med(per("memcpy_s")),
        "fixed_us": med(fixed),
        "caller_cpu_s": med(per("caller_cpu_s")),
        "process_cpu_s": med(per("process_cpu_s")),
        "gc_passes": max(s["gc_passes"] for c in cases for s in c["saves"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="checkout A (the base)")
    p.add_argument("--b", required=True, help="checkout B (the change)")
    p.add_argument("--counts", default="100000,300000")
    p.add_argument("--size", default="1G")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--saves", type=int, default=3, help="timed saves per process, after the two measured for memory")
    p.add_argument("--scratch", default=tempfile.gettempdir())
    p.add_argument("--out", required=True)
    args = p.parse_args()
    sys.path.insert(0, HERE)
    from states import parse_size

    size = parse_size(args.size)
    counts = [int(c) for c in args.counts.split(",")]
    sides = {"a": args.a, "b": args.b}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {str(n): {"a": [], "b": []} for n in counts}
    t0 = time.time()
    for r in range(args.rounds):
        for n in counts:
            for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
                res = run_case(sides[side], n, size, args.saves, args.scratch)
                results[str(n)][side].append(res)
                print(f"round {r} n={n} {side}: {res['bytes_per_tensor']:.0f} B/tensor, "
                      f"blocking {med([s['blocking_s'] for s in res['saves']]):.3f} s, "
                      f"caller CPU {med([s['caller_cpu_s'] for s in res['saves']]):.3f} s", flush=True)  # fmt: skip
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
        "wall_s": time.time() - t0,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "load_average": os.getloadavg(),
        "a": args.a,
        "b": args.b,
        "size": args.size,
        "rounds": args.rounds,
        "saves": args.saves,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    head = ("| tensors | side | B/tensor above staging (first two saves) | first save s | blocking s | memcpy s "
            "| fixed µs/tensor | caller CPU s | process CPU s | GC passes in save() |")  # fmt: skip
    lines = [head, "|" + "---|" * 10]
    for n in counts:
        for side in ("a", "b"):
            f = figures(results[str(n)][side])
            lines.append(
                f"| {n:,} | {side} | {f['bytes_per_tensor']:,.0f} | {f['first_save_s']:.2f} | {f['blocking_s']:.3f} "
                f"| {f['memcpy_s']:.3f} | {f['fixed_us']:.1f} | {f['caller_cpu_s']:.3f} | {f['process_cpu_s']:.3f} "
                f"| {f['gc_passes']} |"
            )
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
