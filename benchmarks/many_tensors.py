"""Many small tensors (issue 32, problems 2 and 3): save and load cost per tensor, baseline vs branch.

    python benchmarks/many_tensors.py --base /work/main --new . --counts 1k,10k,100k,300k \\
        --size 1G --repeats 3 --out benchmarks/results/<dir>

**The state**: ``states.py``'s ``small`` family (an Adam-shaped ``{"model", "optim"}`` dict:
per parameter a weight, ``exp_avg``, ``exp_avg_sq`` and a 0-d ``step``), ``--size`` bytes in
``N`` tensors.

**One case = one process** (``--case``), with ``PYTHONPATH`` at the tree under test, so the
baseline (``--base``) and the branch (``--new``) import their own ``asyncckpt``; the two are
run alternately (base, new, new, base, ...) so that a noisy neighbour slows both alike.
Each case process:

- builds the state; ``Checkpointer(root)``; a warm-up save (allocates the staging buffer),
  then a timed save of the same state: *blocking* = until ``save()`` returns, *durable* =
  until ``handle.result()``; the *peak RSS above the baseline* of that second save (the
  staging buffer is already allocated, so this is what the save costs per tensor); the
  phases of ``save()`` (the structure walk, the tree JSON, the layout plan) by wrapping the
  functions ``checkpointer._pipeline`` calls (a wrapper adds ~1 us per phase, not per tensor);
- ``close()``, every tensor of the live state changed, then ``load(root, step, into=state)``
  cold (the step's files evicted from the page cache) and warm, then ``load(root, step)``
  cold and warm; each under a peak-RSS meter (``load()``: above the state's bytes, the fresh
  tensors it returns); the first of each checked bit-exact (CRC-32C of every tensor);
- the cyclic GC's passes through ``gc.callbacks``: count, total and longest, per window.

*us/tensor* divides a time by the tensor count (so at 1 k tensors it is dominated by the
bytes, at 300 k by the per-tensor work). Prints a table of medians and new/base ratios and
writes ``results.json`` (every sample) and ``results.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------- one case (own process)
def _phase_stamps() -> dict[str, float]:
    """Wrap what ``save()`` calls for its fixed work; the dict accumulates seconds per phase."""
    from asyncckpt.checkpointer import _pipeline as ck
    from asyncckpt.checkpointer._plan import Planner

    acc: dict[str, float] = {}

    def wrap(owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[label] = acc.get(label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)

    wrap(ck, "flatten_parts", "walk_s")  # save()'s walk (flatten: reserve_buffers only)
    wrap(ck, "tree_json", "json_s")
    wrap(Planner, "plan", "plan_s")
    return acc


def run_case(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from measure import GcPasses, PeakMemory, drop_cache, trim_heap
    from states import StateSpec, build_state, checksums, mutate, n_tensors, state_nbytes

    import asyncckpt

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    spec = StateSpec("small", args.size, args.count)
    state = build_state(spec)
    n, nbytes = n_tensors(state), state_nbytes(state)
    out: dict[str, Any] = {"tree": asyncckpt.__file__, "n_tensors": n, "nbytes": nbytes}
    root = tempfile.mkdtemp(prefix="many-", dir=args.scratch)
    gcp = GcPasses().__enter__()
    try:
        stamps = _phase_stamps()
        ck = asyncckpt.Checkpointer(root)
        ck.save(1, state).result()  # warm-up: allocates the staging buffer
        trim_heap()
        stamps.clear()
        with PeakMemory() as mem:
            t0 = time.perf_counter()
            h = ck.save(2, state)
            t1 = time.perf_counter()
            h.result()
            t2 = time.perf_counter()
        out["save"] = {
            "blocking_s": t1 - t0, "durable_s": t2 - t0, "extra_bytes": mem.extra_bytes,
            "gc": gcp.window(t0, t1), "gc_until_durable": gcp.window(t1, t2), **dict(stamps),
        }  # fmt: skip
        ck.close()
        want = checksums(state)
        mutate(state)
        for what, into in (("into", True), ("fresh", False)):
            for temp in ("cold", "warm"):
                if temp == "cold":
                    drop_cache([root])
                trim_heap()
                with PeakMemory() as mem:
                    t0 = time.perf_counter()
                    got = asyncckpt.load(root, 2, into=state) if into else asyncckpt.load(root, 2)
                    t1 = time.perf_counter()
                extra = mem.extra_bytes - (0 if into else nbytes)
                out[f"load_{what}_{temp}"] = {"s": t1 - t0, "extra_bytes": extra, "gc": gcp.window(t0, t1)}
                if temp == "cold":
                    ok = checksums(got) == want
                    out[f"load_{what}_{temp}"]["bit_exact"] = ok
                    if not ok:
                        raise SystemExit(f"load_{what} is not bit-exact")
                del got
                if into:
                    mutate(state)
    finally:
        gcp.__exit__()
        shutil.rmtree(root, ignore_errors=True)
    return out


# ---------------------------------------------------------------------- the driver
FIGURES = [
    ("save blocking", ("save", "blocking_s")),
    ("save walk", ("save", "walk_s")),
    ("save plan", ("save", "plan_s")),
    ("save json", ("save", "json_s")),
    ("save gc", ("save", "gc", "total_s")),
    ("save durable", ("save", "durable_s")),
    ("load into cold", ("load_into_cold", "s")),
    ("load into warm", ("load_into_warm", "s")),
    ("load into gc", ("load_into_cold", "gc", "total_s")),
    ("load cold", ("load_fresh_cold", "s")),
    ("load warm", ("load_fresh_warm", "s")),
]
MEMORY = [
    ("save mem", ("save", "extra_bytes")),
    ("load into mem", ("load_into_cold", "extra_bytes")),
    ("load mem", ("load_fresh_cold", "extra_bytes")),
]


def _get(d: dict[str, Any], path: tuple[str, ...]) -> float | None:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return float(d) if isinstance(d, (int, float)) else None


def _median(xs: list[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return statistics.median(v) if v else None


def parse_count(text: str) -> int:
    t = text.strip().lower()
    return int(float(t[:-1]) * 1000) if t.endswith("k") else int(t)


def spawn(tree: str, count: int, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=f"{os.path.abspath(tree)}:{HERE}")
    cmd = [sys.executable, os.path.abspath(__file__), "--case", "--count", str(count), "--size", str(args.size)]
    if args.scratch:
        cmd += ["--scratch", args.scratch]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.case_timeout)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def render(results: dict[str, Any]) -> str:
    lines = [
        "| tensors | figure | base | new | new/base | base per tensor | new per tensor |",
        "|---|---|---|---|---|---|---|",
    ]
    for count, runs in results["cases"].items():
        n = int(count)
        for label, path in FIGURES + MEMORY:
            b = _median([_get(r, path) for r in runs.get("base", [])])
            w = _median([_get(r, path) for r in runs["new"]])
            if b is None and w is None:
                continue
            mem = label.endswith("mem")
            ratio = f"{w / b:.2f}" if b and w is not None else "-"
            cells = [_fmt(b, mem), _fmt(w, mem), ratio, _fmt(b, mem, n), _fmt(w, mem, n)]
            lines.append(f"| {n:,} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(x: float | None, mem: bool, per: int = 0) -> str:
    if x is None:
        return "-"
    if per:
        return f"{x / per:.0f} B" if mem else f"{x / per * 1e6:.1f} us"
    return f"{x / 2**20:.1f} MiB" if mem else f"{x * 1000:.0f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=1000, help=argparse.SUPPRESS)
    ap.add_argument("--size", default="1G")
    ap.add_argument("--counts", default="1k,10k,100k,300k")
    ap.add_argument("--base", default=None, help="tree of the baseline (e.g. /work/main); omitted: new only")
    ap.add_argument("--new", default=os.path.dirname(HERE))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scratch", default=None, help="where checkpoints go (a real disk: cold loads evict pages)")
    ap.add_argument("--case-timeout", type=float, default=900.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.case:
        from states import parse_size

        args.size = parse_size(args.size) if not str(args.size).isdigit() else int(args.size)
        print(json.dumps(run_case(args)))
        return
    from states import parse_size

    args.size = parse_size(args.size)
    trees = {"base": args.base, "new": args.new} if args.base else {"new": args.new}
    results: dict[str, Any] = {"size": args.size, "trees": trees, "load_before": os.getloadavg(), "cases": {}}
    for count in [parse_count(c) for c in args.counts.split(",")]:
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in trees}
        for r in range(args.repeats):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                t0 = time.time()
                res = spawn(trees[name], count, args)
                res["load_avg"] = os.getloadavg()
                runs[name].append(res)
                print(f"[{time.strftime('%H:%M:%S')}] {count} {name} #{r}: {time.time() - t0:.0f} s"
                      f" {'ERROR ' + res['error'][-300:] if 'error' in res else ''}", flush=True)  # fmt: skip
        results["cases"][str(count)] = runs
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(results, f, indent=1)
    results["load_after"] = os.getloadavg()
    table = render(results)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(f"# many tensors, {args.size / 2**30:g} GiB\n\nload avg before {results['load_before']}, "
                    f"after {results['load_after']}\n\n{table}\n")  # fmt: skip


if __name__ == "__main__":
    main()
