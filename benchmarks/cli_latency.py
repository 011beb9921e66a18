"""Wall time of the ``asyncckpt`` command, per subcommand, against a small real root.

Each command runs as a fresh process (what a user's shell does), ``--repeats`` times after
one warm-up; the table shows min / median / max seconds and whether torch was imported
(``-X importtime``). The baseline row is a bare ``python -c pass`` and ``import torch`` so the
figures can be read against this machine. Prints a table, then one JSON document.

    .venv/bin/python benchmarks/cli_latency.py [--repeats 10] [--json-out FILE]
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def make_root(path: Path) -> None:
    import torch

    from asyncckpt import Checkpointer

    with Checkpointer(path) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"model": {f"l{i}": torch.randn(256, 256) for i in range(8)}, "epoch": step}).result(60)


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, bool, int]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    wall = time.perf_counter() - t0
    torch_loaded = any(
        line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() in ("torch", "torch._C")
        for line in r.stderr.splitlines()
    )
    return wall, torch_loaded, r.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ck"
        make_root(root)
        out = Path(tmp) / "x.safetensors"
        py = [sys.executable, "-X", "importtime"]
        cases = {
            "python -c pass": [*py, "-c", "pass"],
            "python -c 'import torch'": [*py, "-c", "import torch"],
            "asyncckpt ls": [*py, "-m", "asyncckpt", "ls", str(root)],
            "asyncckpt ls --json": [*py, "-m", "asyncckpt", "ls", str(root), "--json"],
            "asyncckpt info": [*py, "-m", "asyncckpt", "info", str(root)],
            "asyncckpt verify": [*py, "-m", "asyncckpt", "verify", str(root)],
            "asyncckpt verify --all": [*py, "-m", "asyncckpt", "verify", str(root), "--all"],
            "asyncckpt gc --dry-run": [*py, "-m", "asyncckpt", "gc", str(root), "--dry-run"],
            "asyncckpt export": [*py, "-m", "asyncckpt", "export", str(root), "--to", str(out), "--force"],
        }
        results = []
        for name, cmd in cases.items():
            timed(cmd, env)  # warm the page cache and the bytecode cache
            runs = [timed(cmd, env) for _ in range(args.repeats)]
            walls = [w for w, _, _ in runs]
            results.append(
                {
                    "case": name,
                    "min_s": round(min(walls), 4),
                    "median_s": round(statistics.median(walls), 4),
                    "max_s": round(max(walls), 4),
                    "imports_torch": any(t for _, t, _ in runs),
                    "exit_codes": sorted({c for _, _, c in runs}),
                }
            )
    print(f"{'case':<28} {'min s':>7} {'median s':>9} {'max s':>7}  torch")
    for r in results:
        print(f"{r['case']:<28} {r['min_s']:>7.3f} {r['median_s']:>9.3f} {r['max_s']:>7.3f}  {r['imports_torch']}")
    doc = {"repeats": args.repeats, "python": sys.version.split()[0], "cpus": os.cpu_count(), "results": results}
    print(json.dumps(doc, indent=2))
    if args.json_out:
        args.json_out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
