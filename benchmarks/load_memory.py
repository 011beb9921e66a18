"""Peak memory and CPU time per tensor of a load of many tensors (issue 32), base vs branch.

    python benchmarks/load_memory.py --base /tmp/base --new . --counts 10k,100k,300k \\
        --repeats 3 --out benchmarks/results/<dir>

**The state**: ``states.py``'s ``small`` family (an Adam-shaped ``{"model", "optim"}`` dict),
``--size`` bytes (256 MiB) in ``N`` tensors, saved once per count (by the base tree when given:
the format is the same) and loaded by every case.

**One case = one process** doing one load: ``load(root, 2, into=state)`` (*into*) or
``load(root, 2)`` (*fresh*), with ``PYTHONPATH`` at the tree under test; base and new run
alternately (base, new, new, base, ...). Each case measures the peak RSS above the RSS at
the start of the load (VmHWM reset: exact, no sampling) and the process's CPU time (user +
system, every thread) of the load, after a first load of a one-tensor checkpoint (the
modules the package imports on its first load, ~7 MB, are a cost of the process, not of a
load of N tensors). For *fresh* the returned tensors' bytes are subtracted
(their objects, the returned containers and everything else of the load count). Memory and
CPU time are what a busy machine does not distort (wall time is not reported). Writes
``results.json`` (every sample) and ``results.md`` (medians) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def run_case(mode: str, count: int, size: int, root: str) -> dict[str, Any]:
    from measure import _reset_peak, _status_kb, cpu_seconds, trim_heap
    from states import StateSpec, build_state, state_nbytes

    import asyncckpt

    spec = StateSpec("small", size, count)
    if mode == "save":
        state = build_state(spec)
        with asyncckpt.Checkpointer(root) as ck:
            ck.save(2, state).result()
        with asyncckpt.Checkpointer(root + "-one") as ck:
            ck.save(1, {"t": state["model"][next(iter(state["model"]))]}).result()
        return {}
    state = build_state(spec) if mode == "into" else None
    # a first load of one tensor: the ~7 MB of modules the package imports on its first load
    # are not this load's
    asyncckpt.load(root + "-one", 1)
    trim_heap()
    base = _status_kb("self", "VmRSS")
    exact = _reset_peak()
    c0 = cpu_seconds()
    got = asyncckpt.load(root, 2, into=state) if mode == "into" else asyncckpt.load(root, 2)
    cpu = cpu_seconds() - c0
    peak = (_status_kb("self", "VmHWM") - base) * 1024
    returned = state_nbytes(got) if mode == "fresh" else 0
    return {
        "mode": mode, "n": count, "exact": exact, "peak_bytes": peak, "returned_bytes": returned,
        "bytes_per_tensor": (peak - returned) / count, "cpu_us_per_tensor": cpu / count * 1e6,
    }  # fmt: skip


def spawn(tree: str, *args: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=f"{os.path.abspath(tree)}:{HERE}")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", *args], env=env, capture_output=True,
                       text=True, timeout=1800, check=False)  # fmt: skip
    if p.returncode != 0:
        raise SystemExit(f"case {args} of {tree} failed:\n{p.stderr[-3000:]}")
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def parse_count(text: str) -> int:
    t = text.strip().lower()
    return int(float(t[:-1]) * 1000) if t.endswith("k") else int(t)


def render(samples: list[dict[str, Any]], trees: list[str]) -> str:
    head = " | ".join(f"{t} B/tensor | {t} CPU us/tensor" for t in trees)
    lines = [f"| tensors | load | {head} |", "|---|---|" + "---|" * (2 * len(trees))]
    for n in sorted({s["n"] for s in samples}):
        for mode in ("into", "fresh"):
            cells = []
            for t in trees:
                xs = [s for s in samples if s["n"] == n and s["mode"] == mode and s["tree"] == t]
                if not xs:
                    cells += ["-", "-"]
                    continue
                cells.append(f"{statistics.median(s['bytes_per_tensor'] for s in xs):.0f}")
                cells.append(f"{statistics.median(s['cpu_us_per_tensor'] for s in xs):.1f}")
            label = "load(into=)" if mode == "into" else "load()"
            lines.append(f"| {n:,} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", nargs=4, metavar=("MODE", "COUNT", "SIZE", "ROOT"), help=argparse.SUPPRESS)
    ap.add_argument("--size", default="256M")
    ap.add_argument("--counts", default="10k,100k,300k")
    ap.add_argument("--base", default=None, help="tree of the baseline; omitted: new only")
    ap.add_argument("--new", default=os.path.dirname(HERE))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scratch", default=None, help="where the checkpoints go")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.case:
        mode, count, size, root = args.case
        print(json.dumps(run_case(mode, int(count), int(size), root)))
        return
    from states import parse_size

    size = parse_size(args.size)
    trees = {"base": args.base, "new": args.new} if args.base else {"new": args.new}
    samples: list[dict[str, Any]] = []
    scratch = args.scratch or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"load-memory-{os.getpid()}")
    for count in [parse_count(c) for c in args.counts.split(",")]:
        root = os.path.join(scratch, f"n{count}")
        if not os.path.exists(root):
            spawn(trees.get("base") or trees["new"], "save", str(count), str(size), root)
        for r in range(args.repeats):
            for mode in ("into", "fresh"):
                for name in list(trees) if r % 2 == 0 else list(reversed(trees)):
                    res = spawn(trees[name], mode, str(count), str(size), root)
                    res.update(tree=name, repeat=r, load_avg=os.getloadavg())
                    samples.append(res)
                    per = f"{res['bytes_per_tensor']:.0f} B, {res['cpu_us_per_tensor']:.1f} us a tensor"
                    print(f"[{time.strftime('%H:%M:%S')}] {count} {mode} {name} #{r}: {per}", flush=True)
    table = render(samples, list(trees))
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"size": size, "trees": trees, "samples": samples}, f, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(f"# load memory, {size / 2**20:g} MiB in N tensors\n\n{table}\n")


if __name__ == "__main__":
    main()
