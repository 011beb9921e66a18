"""Restore, side by side: asyncckpt ``load(into=)`` against the raw read of the same bytes and torch.load.

    python benchmarks/restore.py --size 1G --repeats 7 --out benchmarks/results/<dir>

One process, one state (the transformer-like state of ``states.py``: model + Adam state, fp32),
saved once by asyncckpt and once by ``torch.save``; then, round-robin so that a noisy
neighbour hits every variant alike, each variant cold (the file's pages evicted with
``posix_fadvise(DONTNEED)`` after an fsync) and warm (right after a read of the same file):

* ``raw read``: ``preadv`` of the bytes (one file, 16 MiB calls, one thread) into a
  preallocated buffer (``limits.py``), the harness's limit;
* ``raw read x4``: the same from 4 threads, one contiguous quarter each;
* ``asyncckpt.load(into=)``: verified (the default), into the live state in one pass, the
  CRC computed on each piece as it lands;
* ``asyncckpt.load(into=, verify=False)``: one pass, no checksum;
* ``asyncckpt.load(into=, verify_first=True)``: two passes, the whole file checksummed
  through the bounce buffers before any target is written (a corrupt file leaves the
  targets untouched);
* ``asyncckpt checksum pass alone``: the whole-file checksum through the bounce buffers,
  i.e. the first pass of ``verify_first=True``;
* ``asyncckpt.load()``: no target, fresh tensors (checksummed as they land);
* ``torch.load + copy``: ``torch.load(weights_only=True)`` and ``copy_`` into the live state.

Peak extra RSS (VmHWM after a reset) of one verified ``load(into=)`` and of ``torch.load +
copy``. Prints a markdown table and writes ``results.json`` and ``results.md`` to ``--out``.
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
import threading
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (HERE, REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
from limits import CHUNK, Limits  # noqa: E402
from measure import PeakMemory, drop_cache, summary, trim_heap  # noqa: E402
from states import StateSpec, build_state, checksums, copy_into, format_size, mutate, parse_size  # noqa: E402

import asyncckpt  # noqa: E402
from asyncckpt.loading import _readinto  # noqa: E402
from asyncckpt.roots.posix._discovery import read_manifest  # noqa: E402


def _parallel_read(path: str, view: memoryview, nbytes: int, threads: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    cut = -(-nbytes // threads)

    def one(i: int) -> None:
        pos, end = i * cut, min(nbytes, (i + 1) * cut)
        while pos < end:
            n = os.preadv(fd, [view[pos : min(end, pos + CHUNK)]], pos)
            if n <= 0:
                raise OSError("short read")
            pos += n

    ts = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    try:
        for t in ts:
            t.start()
    finally:
        for t in ts:
            t.join()
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1G")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(REPO, "bench-results", "restore"))
    ap.add_argument("--scratch", default=None)
    ap.add_argument("--report-only", default=None, help="re-render results.md from an earlier results.json")
    args = ap.parse_args(argv)
    if args.report_only:
        with open(args.report_only) as f:
            md = report(json.load(f))
        print(md)
        with open(os.path.join(os.path.dirname(args.report_only), "results.md"), "w") as f:
            f.write(md)
        return 0
    if args.repeats < 5:
        ap.error("--repeats must be >= 5")
    scratch = args.scratch or tempfile.mkdtemp(prefix="asyncckpt-restore-")
    os.makedirs(args.out, exist_ok=True)
    try:
        result = run(parse_size(args.size), args.repeats, scratch)
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    md = report(result)
    print(md)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    return 0


def run(size: int, repeats: int, scratch: str) -> dict[str, Any]:
    spec = StateSpec("transformer", size)
    state = build_state(spec)
    want = checksums(state)
    root = os.path.join(scratch, "ack")
    with asyncckpt.Checkpointer(root) as ck:
        info = ck.save(1, state).result()
    step_dir = str(info.path)
    shard = os.path.join(step_dir, "rank00000.safetensors")
    pt = os.path.join(scratch, "state.pt")
    with open(pt, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    lim = Limits(state, os.path.join(scratch, "raw"))
    lim.write()
    assert lim.last_file is not None
    raw_file = lim.last_file
    shard_size = os.path.getsize(shard)
    crc = read_manifest(step_dir).file("rank00000.safetensors").crc32c

    def verify_pass() -> None:
        fd = os.open(shard, os.O_RDONLY)
        try:
            _readinto.verify_file(fd, shard, shard_size, crc)
        finally:
            os.close(fd)

    def torch_load() -> None:
        copy_into(state, torch.load(pt, map_location="cpu", weights_only=True))

    variants: dict[str, tuple[list[str], Callable[[], None]]] = {
        "raw read": ([raw_file], lambda: lim.read(cold=False)),
        "raw read x4": ([raw_file], lambda: _parallel_read(raw_file, lim.read_view, lim.nbytes, 4)),
        "asyncckpt.load(into=)": ([step_dir], lambda: asyncckpt.load(root, 1, into=state)),
        "asyncckpt.load(into=, verify=False)": ([step_dir], lambda: asyncckpt.load(root, 1, into=state, verify=False)),
        "asyncckpt.load(into=, verify_first=True)": (
            [step_dir], lambda: asyncckpt.load(root, 1, into=state, verify_first=True)
        ),
        "asyncckpt checksum pass alone": ([step_dir], verify_pass),
        "asyncckpt.load() fresh": ([step_dir], lambda: asyncckpt.load(root, 1)),
        "torch.load + copy": ([pt], torch_load),
    }
    times: dict[str, dict[str, list[float]]] = {v: {"cold": [], "warm": []} for v in variants}
    for fn in (v[1] for v in variants.values()):
        fn()  # warm-up: imports, allocator
    for mode in ("cold", "warm"):
        for _ in range(repeats):
            for name, (files, fn) in variants.items():
                if mode == "cold":
                    drop_cache(files)
                else:
                    fn()
                trim_heap()
                t0 = time.perf_counter()
                fn()
                times[name][mode].append(time.perf_counter() - t0)
                print(f"{mode} {name}: {times[name][mode][-1]:.3f} s", file=sys.stderr, flush=True)
    # correctness: the live state holds the checkpoint after a load(into=) over changed values
    mutate(state)
    asyncckpt.load(root, 1, into=state)
    verified = checksums(state) == want
    rss: dict[str, Any] = {}
    for name in ("asyncckpt.load(into=)", "torch.load + copy"):
        files, fn = variants[name]
        drop_cache(files)
        with PeakMemory() as pm:
            fn()
        rss[name] = pm.to_json()
    return {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "state": {"spec": spec.to_json(), "name": spec.name, "nbytes": lim.nbytes, "shard_bytes": shard_size},
        "repeats": repeats,
        "threads": _readinto.THREADS,
        "bounce_bytes": _readinto.BOUNCE,
        "times": {n: {m: summary(xs) for m, xs in d.items()} for n, d in times.items()},
        "peak_extra_rss": rss,
        "verified": verified,
    }


def report(r: dict[str, Any]) -> str:
    t = r["times"]
    nbytes = r["state"]["nbytes"]

    def med(name: str, mode: str) -> float:
        return float(t[name][mode]["median"])

    lines = [
        f"# Restore, {r['state']['name']} ({format_size(nbytes)} of tensors), median of {r['repeats']}",
        "",
        f"{r['machine']['platform']}, {r['machine']['cpus']} CPUs, torch {r['machine']['torch']}, "
        f"{r['machine']['when']}; asyncckpt: {r['threads']} I/O threads, "
        f"{format_size(r['bounce_bytes'])} bounce buffers; state restored correctly: {r['verified']}",
        "",
        "The limit is the faster of the two raw reads (by median), per column.",
        "",
        "| variant | cold s | cold GB/s | cold vs limit | warm s | warm GB/s | warm vs limit |",
        "|---|---|---|---|---|---|---|",
    ]
    limit = {m: min(med("raw read", m), med("raw read x4", m)) for m in ("cold", "warm")}
    for name in t:
        c, w = med(name, "cold"), med(name, "warm")
        lines.append(
            f"| {name} | {c:.3f} | {nbytes / c / 1e9:.2f} | {limit['cold'] / c:.2f}x | "
            f"{w:.3f} | {nbytes / w / 1e9:.2f} | {limit['warm'] / w:.2f}x |"
        )
    a, tl = "asyncckpt.load(into=)", "torch.load + copy"
    lines += [
        "",
        f"verified `load(into=)` vs torch.load + copy: {med(tl, 'cold') / med(a, 'cold'):.2f}x faster cold, "
        f"{med(tl, 'warm') / med(a, 'warm'):.2f}x warm; against the limit: "
        f"{limit['cold'] / med(a, 'cold'):.2f}x cold (target >= 0.9x), "
        f"{limit['warm'] / med(a, 'warm'):.2f}x warm (target >= 0.8x)",
        "",
        "| peak extra RSS (cold) | MiB |",
        "|---|---|",
    ]
    for name, m in r["peak_extra_rss"].items():
        lines.append(f"| {name} | {m['extra_bytes'] / 2**20:.1f} |")
    spread = {n: statistics.pstdev(d["cold"]["samples"]) for n, d in t.items()}
    lines += ["", "cold spread (stdev, s): " + ", ".join(f"{n} {s:.3f}" for n, s in spread.items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
