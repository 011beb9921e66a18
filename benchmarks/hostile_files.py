"""Hostile checkpoint files: how much time and memory does reading each one cost?

Builds one root per case (a real checkpoint whose step 2 is replaced by a hostile file,
re-sealed so the manifest's CRCs let it through), then runs each reader operation in its own
subprocess and records wall time, peak RSS (the child's ``VmHWM``) and what it raised.
Prints a markdown table and writes JSON.

    python benchmarks/hostile_files.py                    # the sizes measured in issue 9
    python benchmarks/hostile_files.py --scale 0.1        # smaller files, same shapes
    python benchmarks/hostile_files.py --out results.json --timeout 120 --as-limit-gib 4

Every case runs under ``--timeout`` seconds and an address-space limit (``--as-limit-gib``)
so a regression cannot take the machine down: a case that hits them reports ``timeout`` or
the error it died with.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from asyncckpt.format._checksum import crc32c  # noqa: E402
from asyncckpt.format._manifest import MANIFEST, FileEntry, decode, encode  # noqa: E402

STEP2 = "step_00000002"
SHARD, TREE = "rank00000.safetensors", "rank00000.json"

# child: run one reader operation, print one JSON line with the outcome
CHILD = r"""
import json, os, resource, sys, time
root, op, as_limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
if as_limit:
    resource.setrlimit(resource.RLIMIT_AS, (as_limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
import asyncckpt
if op.startswith("load"):
    import asyncckpt.checkpointer._facade  # torch: its import time is not the file's cost
t0 = time.perf_counter()
err = result = None
try:
    if op == "load":
        asyncckpt.load(root, 2)
    elif op == "load-latest":
        asyncckpt.load(root)
    elif op == "find_latest":
        info = asyncckpt.find_latest(root)
        result = f"step {info.step}" if info is not None else "None"
    elif op == "verify":
        from asyncckpt.cli import main
        rc = main(["verify", root, "--step", "2"])
        err = None if rc == 0 else f"exit {rc}"
except BaseException as e:
    err = f"{type(e).__name__}: {str(e)[:160]}"
dt = time.perf_counter() - t0
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork + exec
with open("/proc/self/status") as f:
    hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(json.dumps({"time_s": dt, "peak_rss_mib": hwm / 1024, "error": err, "result": result}))
"""


def reseal(step_dir: Path, replace: dict[str, bytes], **fields: Any) -> None:
    """Write ``replace`` into ``step_dir`` and re-seal its manifest (sizes, CRCs, ``fields``)."""
    m = decode((step_dir / MANIFEST).read_bytes(), "")
    files = {f.name: f for f in m.files}
    for name, data in replace.items():
        (step_dir / name).write_bytes(data)
        files[name] = FileEntry(name, len(data), crc32c(data), 0)
    body = dict(step=m.step, attempt=m.attempt, world_size=m.world_size, nbytes=m.nbytes, created=m.created)
    body.update(fields)
    extra_files = body.pop("extra_files", [])
    blob = encode(
        body["step"], body["attempt"], body["world_size"], body["nbytes"], body["created"],
        [*files.values(), *extra_files], m.extra,
    )  # fmt: skip
    (step_dir / MANIFEST).write_bytes(blob)


def shard_bytes(header: dict[str, Any], data: bytes = b"") -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data


def tree_for(names: list[str]) -> bytes:
    return json.dumps({"$dict": [[n, {"$tensor": n}] for n in names]}, separators=(",", ":")).encode()


# ---------------------------------------------------------------------------- the cases


def case_world_size(sd: Path, scale: float) -> None:
    reseal(sd, {}, world_size=10**12)


def case_nested_lists(sd: Path, scale: float) -> None:
    n = int(286 * 2**20 * scale) // 3
    reseal(sd, {TREE: b"[" + b"[]," * (n - 1) + b"[]]"})


def case_sparse_tib(sd: Path, scale: float) -> None:
    n = 2**40
    header = {"t": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}
    blob = shard_bytes(header)
    path = sd / SHARD
    path.write_bytes(blob)
    with open(path, "r+b") as f:
        f.truncate(len(blob) + n)  # sparse: no blocks on disk
    m = decode((sd / MANIFEST).read_bytes(), "")
    # the CRC of a TiB of zeros is not worth computing: readers must refuse before reading it
    files = [f for f in m.files if f.name not in (SHARD, TREE)]
    tree = tree_for(["t"])
    (sd / TREE).write_bytes(tree)
    files += [FileEntry(SHARD, len(blob) + n, 0, 0), FileEntry(TREE, len(tree), crc32c(tree), 0)]
    (sd / MANIFEST).write_bytes(encode(m.step, m.attempt, m.world_size, n, m.created, files, m.extra))


def case_many_entries(sd: Path, scale: float) -> None:
    n = int(850_000 * scale)
    reseal(sd, {}, extra_files=[FileEntry(f"f{i:07d}", 0, 0, 0) for i in range(n)])


def case_many_tensors(sd: Path, scale: float) -> None:
    n = int(1_400_000 * scale)
    names = [f"t{i:07d}" for i in range(n)]
    header = {k: {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for k in names}
    reseal(sd, {SHARD: shard_bytes(header), TREE: tree_for(names)})


CASES: dict[str, tuple[str, Callable[[Path, float], None], list[str]]] = {
    "world_size": ("manifest declares world_size=10**12", case_world_size, ["load", "verify"]),
    "nested_lists": ("286 MiB structure file of nested empty lists", case_nested_lists, ["load"]),
    "sparse_tib": ("sparse 1 TiB shard declaring [2**40]", case_sparse_tib, ["load"]),
    "many_entries": ("manifest of 850k entries", case_many_entries, ["find_latest", "load"]),
    "many_tensors": ("valid 78 MB header of 1.4M empty tensors", case_many_tensors, ["load"]),
}


def build_base(base: Path) -> Path:
    import torch

    from asyncckpt import Checkpointer

    root = base / "pristine"
    with Checkpointer(root) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.arange(16, dtype=torch.float32) + step, "step": step}).result(timeout=60)
    return root


def run_case(root: Path, op: str, timeout: float, as_limit: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    t0 = time.perf_counter()
    try:
        r = subprocess.run(
            [sys.executable, "-c", CHILD, str(root), op, str(as_limit)],
            capture_output=True, timeout=timeout, env=env, text=True,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"time_s": time.perf_counter() - t0, "peak_rss_mib": None, "error": f"timeout after {timeout:.0f}s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"time_s": time.perf_counter() - t0, "peak_rss_mib": None, "error": f"died: {r.stderr[-300:]}"}
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="file sizes relative to those of issue 9")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per operation")
    ap.add_argument("--as-limit-gib", type=float, default=8.0, help="address-space limit per operation (0: none)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--scratch", default=None, help="directory for the hostile roots (default: $TMPDIR)")
    args = ap.parse_args()
    as_limit = int(args.as_limit_gib * 2**30)
    base = Path(tempfile.mkdtemp(prefix="hostile-", dir=args.scratch))
    results = []
    try:
        pristine = build_base(base)
        for key in args.cases.split(","):
            label, build, ops = CASES[key]
            root = base / key
            shutil.copytree(pristine, root)
            build(root / STEP2, args.scale)
            files = {p.name: p.stat().st_size for p in (root / STEP2).iterdir()}
            for op in ops:
                res = run_case(root, op, args.timeout, as_limit)
                res.update(case=key, label=label, op=op, files=files)
                results.append(res)
                print(f"{key:13s} {op:12s} {res['time_s']:7.2f}s  {res['error']}", file=sys.stderr, flush=True)
            shutil.rmtree(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("| case | operation | time | peak RSS | outcome |")
    print("|---|---|---|---|---|")
    for r in results:
        rss = "?" if r["peak_rss_mib"] is None else f"{r['peak_rss_mib']:.0f} MiB"
        outcome = r["error"] or (f"returned {r['result']}" if r.get("result") else "loaded")
        print(f"| {r['label']} | `{r['op']}` | {r['time_s']:.2f} s | {rss} | {outcome} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"scale": args.scale, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
