"""``asyncckpt export`` A/B between two checkouts, from a local root and from SeaweedFS.

    python benchmarks/export_ab.py --a /path/to/checkout-a --b /path/to/checkout-b \
        --mib 256 --rounds 3 --out benchmarks/results/<dir>

One single-process checkpoint of ``--mib`` MiB (``--tensors`` tensors) is saved once and
pushed to a SeaweedFS started on loopback (``tests/support/s3server.py``). Then, ``--rounds``
times, each checkout (a, b, then b, a: neither side always first) runs ``asyncckpt export``
in a fresh process (``tests/support/_export_rss.py``), from the local root and from the
``s3://`` URL: wall time and the memory it takes beyond its imports (peak RSS less the RSS
before it ran). One more run per checkout goes through the fault proxy
(``tests/support/s3proxy.py``, no rule armed) to count its GETs. Prints a markdown table of
medians and writes ``results.json``.
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
SUPPORT = os.path.join(os.path.dirname(HERE), "tests", "support")
MiB = 1 << 20


def opts(endpoint: str) -> dict[str, str]:
    return {"endpoint": endpoint, "access_key_id": "bench", "secret_access_key": "bench-secret", "region": "us-east-1"}


def export(checkout: str, root: str, out: str, extra: list[str]) -> tuple[float, int]:
    """Wall seconds of one export in a fresh process of ``checkout`` and the memory it took
    beyond the process with everything imported (KiB: ``tests/support/_export_rss.py``, which
    resets the peak RSS once torch and the package are imported)."""
    env = dict(os.environ, PYTHONPATH=checkout)
    if os.path.exists(out):
        os.unlink(out)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, os.path.join(SUPPORT, "_export_rss.py"), root, "--to", out, *extra], env=env,
                       capture_output=True, text=True)  # fmt: skip
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"export by {checkout} failed ({r.returncode}): {r.stderr}")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    return wall, doc["peak_kib"] - doc["base_kib"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, SUPPORT)
    import torch
    from s3proxy import FaultProxy
    from s3server import S3Server

    from asyncckpt import Checkpointer, remote

    work = tempfile.mkdtemp(prefix="export-ab-")
    root = os.path.join(work, "ck")
    per = args.mib * MiB // args.tensors // 4
    g = torch.Generator().manual_seed(0)
    with Checkpointer(root) as ck:
        ck.save(1, {"model": {f"t{i}": torch.randn(per, generator=g) for i in range(args.tensors)}}).result(600)
    server = S3Server()
    server.start()
    server.create_bucket("bench")
    url = "s3://bench/run"
    remote.push(root, url, storage_options=opts(server.endpoint), deadline_s=600)
    proxy = FaultProxy(server.s3_port, max_lifetime=3600).start()
    out = os.path.join(work, "out.safetensors")
    so = [f"--storage-option={k}={v}" for k, v in opts(server.endpoint).items()]
    results: dict[str, list[tuple[float, int]]] = {}
    try:
        for r in range(args.rounds):
            for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
                checkout = getattr(args, side)
                for where, extra in (("local", []), ("s3", so)):
                    results.setdefault(f"{side}/{where}", []).append(
                        export(checkout, root if where == "local" else url, out, extra)
                    )
        gets = {}
        for side in ("a", "b"):
            proxy.clear()
            pso = [f"--storage-option={k}={v}" for k, v in opts(proxy.endpoint).items()]
            export(getattr(args, side), url, out, pso)
            gets[side] = proxy.count("GET")
    finally:
        proxy.stop()
        server.close()
    table = ["| case | wall s (median) | all | peak RSS beyond imports, MiB (median) | GETs |", "|---|---|---|---|---|"]
    doc: dict[str, object] = {"mib": args.mib, "tensors": args.tensors, "a": args.a, "b": args.b, "runs": {}}
    for key, runs in sorted(results.items()):
        walls, rss = [w for w, _ in runs], [m / 1024 for _, m in runs]
        side, where = key.split("/")
        table.append(f"| {key} | {statistics.median(walls):.2f} | {', '.join(f'{w:.2f}' for w in walls)} | "
                     f"{statistics.median(rss):.0f} | {gets[side] if where == 's3' else '-'} |")  # fmt: skip
        doc["runs"][key] = runs  # type: ignore[index]
    doc["gets"] = gets
    print("\n".join(table))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
