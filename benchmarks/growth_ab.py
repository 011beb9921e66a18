"""The growth run's tensor counts, A/B: two checkouts of asyncckpt, alternating state by state.

    python benchmarks/growth_ab.py --base /path/to/base --out DIR [--counts 1000,...] [--rounds 2]
    python benchmarks/growth_ab.py --merge DIR                      # (re)write DIR's tables only

Each (round, count, side) is one ``growth.py --sizes none --counts N`` run (every state in its own
process, the side's asyncckpt imported through ``growth.py --asyncckpt``) into
``DIR/runs/<side>-<N>-r<round>/``; the two sides alternate which goes first from one state to the
next, so a neighbour's load lands on both alike. ``new`` is this checkout. Then each side's
rounds are merged into ``DIR/<side>-r<round>/`` (``results.json``, ``results.md``, ``growth.png``
as ``growth.py`` writes them: the marginal figures need every count of one round) and
``DIR/table.md`` sets the two sides side by side: each figure's value in every round (a median of
``--repeats`` inside its run), their median and their spread.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
SIDES = ("base", "new")
#: (figure key of growth_report.figures_of, label, format)
FIGURES = (
    ("blocking", "save() blocking s", "{:.3f}"),
    ("memcpy", "memcpy limit s", "{:.3f}"),
    ("save_fixed_us", "save fixed µs/tensor (blocking − memcpy)", "{:.2f}"),
    ("save_prepare_us", "save walk+plan+JSON µs/tensor, timed in save()", "{:.2f}"),
    ("save_prepare_cpu_us", "the same, caller CPU µs/tensor", "{:.2f}"),
    ("blocking_cpu_us", "save() caller CPU µs/tensor", "{:.2f}"),
    ("load_cold", "cold load(into=) s", "{:.3f}"),
    ("load_marginal_us", "load µs per extra tensor", "{:.1f}"),
    ("save_bytes_per_tensor", "save B/tensor above staging", "{:,.0f}"),
    ("load_bytes_per_tensor", "load B/tensor", "{:,.0f}"),
)


def run(args: argparse.Namespace) -> None:
    counts = [int(c) for c in args.counts.split(",")]
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    for r in range(1, args.rounds + 1):
        for i, n in enumerate(counts):
            for side in SIDES if (r + i) % 2 == 0 else SIDES[::-1]:
                name = f"{side}-{n}-r{r}"
                print(f"[{time.strftime('%H:%M:%S')}] {name}", flush=True)
                cmd = [sys.executable, os.path.join(HERE, "growth.py"), "--sizes", "none", "--counts", str(n),
                       "--count-size", args.count_size, "--repeats", str(args.repeats), "--noise", "none",
                       "--out", os.path.join(args.out, "runs", name)]  # fmt: skip
                if side == "base":
                    cmd += ["--asyncckpt", args.base]
                with open(os.path.join(args.out, "runs", name + ".log"), "w") as log:
                    subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    merge(args.out)


def merge(out: str) -> None:
    """Each side's rounds as one growth run each, and the side-by-side table."""
    sys.path.insert(0, HERE)
    from growth import write_outputs

    figs: dict[str, dict[int, list[dict[str, Any]]]] = {s: {} for s in SIDES}
    for side in SIDES:
        rounds = sorted({p.rsplit("-r", 1)[1] for p in glob.glob(os.path.join(out, "runs", f"{side}-*-r*[0-9]"))})
        for r in rounds:
            paths = sorted(glob.glob(os.path.join(out, "runs", f"{side}-*-r{r}", "results.json")),
                           key=lambda p: int(p.split(os.sep)[-2].split("-")[1]))  # fmt: skip
            runs = [json.load(open(p)) for p in paths]
            if not runs:
                continue
            data = {"meta": runs[0]["meta"], "config": runs[0]["config"], "noise": [],
                    "results": [c for d in runs for c in d["results"]]}  # fmt: skip
            data["meta"]["loadavg_end"] = runs[-1]["meta"].get("loadavg_end")
            data["meta"]["wall_s"] = sum(d["meta"].get("wall_s", 0) for d in runs)
            write_outputs(data, os.path.join(out, f"{side}-r{r}"))
            for f in data["figures"]["counts"]:
                case = next(c for c in data["results"] if c["state"] == f["state"])
                cpu = case.get("blocking_cpu", {}).get("median")
                f["blocking_cpu_us"] = cpu / f["n_tensors"] * 1e6 if cpu is not None else None
                figs[side].setdefault(f["n_tensors"], []).append(f)
    lines = [
        "# Growth run, tensor counts: base against new, alternating state by state",
        "",
        "Each cell: the value of every round (each a median of the repeats inside its run), then",
        "the median over rounds; `-`: not measured (an asyncckpt without `SaveStatistics.prepare_s`).",
        "",
        "| tensors | figure | base | new | new / base (medians) |",
        "|---|---|---|---|---|",
    ]
    table: dict[str, Any] = {}
    for n in sorted(set(figs["base"]) | set(figs["new"])):
        for key, label, fmt in FIGURES:
            cells, meds = [], []
            for side in SIDES:
                vals = [f.get(key) for f in figs[side].get(n, []) if f.get("ok") and f.get(key) is not None]
                med = statistics.median(vals) if vals else None
                meds.append(med)
                table.setdefault(str(n), {}).setdefault(key, {})[side] = {"rounds": vals, "median": med}
                cells.append(", ".join(fmt.format(v) for v in vals) + f" → **{fmt.format(med)}**" if vals else "-")
            ratio = f"{meds[1] / meds[0]:.2f}" if meds[0] and meds[1] is not None else "-"
            lines.append(f"| {n:,} | {label} | {cells[0]} | {cells[1]} | {ratio} |")
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "compare.json"), "w") as f:
        json.dump(table, f, indent=1)
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="checkout A, the base (its asyncckpt/ is imported)")
    p.add_argument("--out", help="output directory")
    p.add_argument("--counts", default="1000,10000,100000,300000")
    p.add_argument("--count-size", default="1G")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--merge", default=None, metavar="DIR", help="only merge DIR/runs and write the tables")
    args = p.parse_args()
    if args.merge:
        merge(args.merge)
    elif args.base and args.out:
        run(args)
    else:
        p.error("--base and --out, or --merge DIR")


if __name__ == "__main__":
    main()
