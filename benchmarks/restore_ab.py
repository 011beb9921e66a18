"""Cold ``load(into=)`` A/B between two checkouts of asyncckpt, alternating processes.

    python benchmarks/restore_ab.py --a /path/to/checkout-a --b /path/to/checkout-b \
        --size 1G --rounds 8 --per-round 3 --out benchmarks/results/<dir>

One checkpoint of the transformer-like state (``states.py``) is written once, by checkout ``b``;
then, ``--rounds`` times, one fresh process per checkout (a, b, then b, a in the next round, so
neither side always runs first) evicts the files' pages and times ``--per-round`` cold verified
``asyncckpt.load(root, into=state)`` calls, each preceded by a cold raw ``preadv`` of the same
shard bytes (the disk's figure at that moment). Both sides read the same files, so only the
code differs. Prints a markdown table of medians and ratios and writes ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {here!r})
import torch
import asyncckpt
from measure import drop_cache
from states import StateSpec, build_state, parse_size
torch.set_num_threads(1)
root, size, per_round, mode = {root!r}, {size!r}, {per_round}, {mode!r}
state = build_state(StateSpec("transformer", parse_size(size)))
if mode == "write":
    with asyncckpt.Checkpointer(root) as ck:
        ck.save(1, state)
        ck.flush()
    print(json.dumps({{}}))
    sys.exit(0)
files = []
for d, _, names in os.walk(root):
    files += [os.path.join(d, n) for n in names if n.endswith(".safetensors")]
buf = bytearray(16 << 20)
def raw():
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            while os.readv(fd, [buf]) > 0:
                pass
        finally:
            os.close(fd)
out = {{"raw": [], "load": []}}
for _ in range(per_round):
    drop_cache([root]); t = time.perf_counter(); raw(); out["raw"].append(time.perf_counter() - t)
    drop_cache([root]); t = time.perf_counter(); asyncckpt.load(root, into=state)
    out["load"].append(time.perf_counter() - t)
print(json.dumps(out))
"""


def run(checkout: str, root: str, size: str, per_round: int, mode: str) -> dict[str, list[float]]:
    code = CHILD.format(here=HERE, root=root, size=size, per_round=per_round, mode=mode)
    env = dict(os.environ, PYTHONPATH=checkout)
    res = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True, timeout=900)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="checkout A (the baseline)")
    ap.add_argument("--b", required=True, help="checkout B (the change)")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per-round", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="restore-ab-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    root = os.path.join(scratch, "ckpt")
    run(args.b, root, args.size, 0, "write")
    got: dict[str, dict[str, list[float]]] = {"a": {"raw": [], "load": []}, "b": {"raw": [], "load": []}}
    for r in range(args.rounds):
        order = ("a", "b") if r % 2 == 0 else ("b", "a")
        for side in order:
            res = run(getattr(args, side), root, args.size, args.per_round, "read")
            for k in ("raw", "load"):
                got[side][k] += res[k]
            load_s, raw_s = statistics.median(res["load"]), statistics.median(res["raw"])
            print(f"round {r} {side}: load {load_s:.3f} s raw {raw_s:.3f} s", flush=True)
    rows = []
    for side in ("a", "b"):
        load, raw = got[side]["load"], got[side]["raw"]
        ratios = [x / y for x, y in zip(load, raw, strict=True)]
        med, raw_med = statistics.median(load), statistics.median(raw)
        rows.append((side, med, min(load), max(load), raw_med, statistics.median(ratios)))
    print("\n| side | cold load(into=) median | min | max | raw read median | load/raw (pairwise median) |")
    print("|---|---|---|---|---|---|")
    for side, med, lo, hi, raw_med, ratio in rows:
        name = f"{side} ({getattr(args, side)})"
        print(f"| {name} | {med:.3f} s | {lo:.3f} s | {hi:.3f} s | {raw_med:.3f} s | {ratio:.2f}× |")
    print(f"\nb/a median cold load: {rows[1][1] / rows[0][1]:.3f}×")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"args": vars(args), "samples": got, "time": time.time()}, f, indent=1)
    import shutil

    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
