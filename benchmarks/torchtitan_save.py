"""torchtitan's own async DCP save against AsyncckptCheckpointManager, same run side by side.

    python benchmarks/torchtitan_save.py                        # 4 ranks, 6 steps, a save every step
    python benchmarks/torchtitan_save.py --world 2 --steps 8 --json out.json

Both runs are the same training (torchtitan 0.3.0's Llama3 ``debugmodel`` through its own
``parallelize_llama``, FSDP2 over gloo ranks on the CPU, the loop of ``tests/support/_torchtitan_worker.py``)
with a save after every step: torchtitan's ``CheckpointManager`` with ``async_mode="async"``
(``dcp.async_save`` on its own gloo group) and ``AsyncckptCheckpointManager``. For every save it
records the time rank 0's training loop spent in ``checkpointer.save()`` (the time a save
blocks training). The first save (asyncckpt allocates its staging buffer then; DCP plans) and
the last (model-only, synchronous in both) are left out of the medians. For asyncckpt it also
reports the mean time from ``save()`` to a durable commit. Prints a table, writes JSON
(``--json``). torchtitan comes from ``ASYNCCKPT_TORCHTITAN_PATH`` or ``.venv/torchtitan``
(``make`` installs it there), as in the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support")]

import _torchtitan  # noqa: E402
from _ranks import free_port, log_tail, run_ranks  # noqa: E402

WORKER = str(REPO / "tests" / "support" / "_torchtitan_worker.py")


def run(manager: str, world: int, steps: int, tmp: Path) -> dict[str, Any]:
    base = _torchtitan.path()
    if base is None:
        sys.exit(_torchtitan.SKIP)
    dump = tmp / manager
    (dump / "out").mkdir(parents=True)
    job = {"manager": manager, "dump": str(dump), "out": str(dump / "out"), "steps": steps, "interval": 1,
           "keep": 3, "export_dtype": "bfloat16"}  # fmt: skip
    (dump / "job.json").write_text(json.dumps(job))
    port = free_port()
    hung = run_ranks(
        lambda r: [WORKER, str(r), str(world), str(port), str(dump / "job.json")], world, dump, 600,
        extra_env={"ASYNCCKPT_TORCHTITAN_PATH": base} if base else None,
    )  # fmt: skip
    if hung or not (dump / "out" / "result.json").exists():
        sys.exit(f"{manager}: the run failed: {log_tail(dump, 0)}")
    result: dict[str, Any] = json.loads((dump / "out" / "result.json").read_text())
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="training steps, one save after each (>= 3)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error("--steps must be >= 3 (the first and the last save are left out of the medians)")
    with tempfile.TemporaryDirectory() as d:
        runs = {m: run(m, args.world, args.steps, Path(d)) for m in ("dcp", "asyncckpt")}
    rows: dict[str, Any] = {}
    for m, r in runs.items():
        b = r["blocking_s"]
        rows[m] = {"first_s": b[0], "median_s": statistics.median(b[1:-1]), "last_s": b[-1], "all_s": b}
    rows["asyncckpt"]["durable_s_mean"] = runs["asyncckpt"].get("durable_s_mean")
    same = runs["dcp"]["losses"] == runs["asyncckpt"]["losses"]
    print(f"torchtitan debugmodel, FSDP2 on {args.world} gloo ranks (CPU), {args.steps} saves; "
          f"load average {os.getloadavg()[0]:.1f}; losses identical: {same}")  # fmt: skip
    print(f"{'save() blocks training':<34}{'first':>9}{'median':>9}{'last':>9}")
    for name, m in (("torchtitan CheckpointManager (async)", "dcp"), ("AsyncckptCheckpointManager", "asyncckpt")):
        r = rows[m]
        print(f"{name:<34}{r['first_s']:>8.3f}s{r['median_s']:>8.3f}s{r['last_s']:>8.3f}s")
    ratio = rows["asyncckpt"]["median_s"] / rows["dcp"]["median_s"]
    print(f"asyncckpt / DCP (median): {ratio:.2f}x; asyncckpt durable {rows['asyncckpt']['durable_s_mean']:.3f}s "
          "after save() on average (rank 0)")  # fmt: skip
    if args.json:
        doc = {"world": args.world, "steps": args.steps, "losses_identical": same, "ratio_median": ratio,
               "machine": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg()[0],
               **rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
