"""Recovery of node-local tiers from each copy, side by side in one run (issue 30).

    sudo python benchmarks/recovery.py [MiB per rank: 256] [rounds: 3] [--out DIR]

2 simulated nodes x 2 ranks (the tests' ``Cluster``: mount namespaces, needs root), a memory
tier on /dev/shm with the peer replica and a persistent tier on a SeaweedFS on loopback.
Steps 1-2 are saved once (every tier, every save), every process killed after ``flush()``; the
four node directories (disks, memories with the replicas) are kept aside and put back before
each case. Then, ``rounds`` times in a rotating order, a resume of step 2 (every rank checks its
state bit-exact) from:

- ``memory``: every tier present (a restart of the training processes on nodes that stayed up);
- ``peer``: node b replaced (its disk and memory wiped): b's ranks fetch from their buddy's memory;
- ``disk-warm`` / ``disk-cold``: both memories wiped; the disks' pages cached / dropped;
- ``store``: memories and disks wiped: every rank reads the store;
- ``raw-tmpfs`` / ``raw-cold-disk``: the physical limits beside them: 4 processes at once, each
  reading its rank's files of the step into touched memory (no checks), from tmpfs / from the
  disk after the page cache was dropped.

A resume's figure is its slowest rank's ``load()`` (each process's construction excluded). Prints
a table (medians, min-max, ratio to the cold disk load) and writes ``results.json`` and
``results.md`` to ``--out`` (default ``bench-results/recovery``).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(HERE / "tests"), str(HERE / "tests" / "support")]

from s3fixtures import opts  # noqa: E402 - after the tests' paths
from s3server import S3Server  # noqa: E402
from test_node_memory import Cluster  # noqa: E402

BUCKET = "recovery-bench"
CASES = ("memory", "peer", "disk-warm", "disk-cold", "store", "raw-tmpfs", "raw-cold-disk")

RAW = r"""
import os, sys, time, torch
files = sys.argv[1:]
bufs = [torch.empty(os.path.getsize(f), dtype=torch.uint8) for f in files]
for b in bufs:
    b.fill_(1)  # touched: the raw read does not pay page faults a load may avoid
t0 = time.monotonic()
for f, b in zip(files, bufs):
    with open(f, "rb", buffering=0) as fh:
        view = memoryview(b.numpy()).cast("B")
        got = 0
        while got < len(view):
            n = fh.readinto(view[got:])
            assert n, f
            got += n
print(time.monotonic() - t0)
"""


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def _put_back(c: Cluster, saved: Path) -> None:
    for d in (c.a, c.b, c.ma, c.mb):
        shutil.rmtree(d)
        shutil.copytree(saved / d.name, d, symlinks=True)


def _wipe(*dirs: Path) -> None:
    for d in dirs:
        shutil.rmtree(d)
        d.mkdir()


def _rank_files(node: Path, step: int, rank: int) -> list[str]:
    d = node / f"step_{step:08d}"
    return [str(p) for p in sorted(d.iterdir()) if p.name.startswith(f"rank{rank:05d}.")]


def _raw(c: Cluster, step: int, memory: bool) -> float:
    """4 processes at once, each reading its rank's files of ``step``: the slowest's seconds."""
    nodes = (c.ma, c.ma, c.mb, c.mb) if memory else (c.a, c.a, c.b, c.b)
    if not memory:
        drop_caches()
    procs = [subprocess.Popen([sys.executable, "-c", RAW, *_rank_files(n, step, r)], stdout=subprocess.PIPE,
                              text=True) for r, n in enumerate(nodes)]  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return max(float(o.split()[-1]) for o in outs)


def _resume(c: Cluster, case: str, env: dict[str, str]) -> tuple[float, dict[int, str]]:
    """One resume of step 2 after the case's wipes: the slowest rank's load() and where each
    rank read from (its log's "loading step 2 from ...")."""
    if case == "peer":
        _wipe(c.b, c.mb)
    elif case in ("disk-warm", "disk-cold"):
        _wipe(c.ma, c.mb)
    elif case == "store":
        _wipe(c.ma, c.mb, c.a, c.b)
    if case == "disk-cold":
        drop_caches()
    res, logs = c.run(f"{case}-{uuid.uuid4().hex[:6]}", **env)
    for r, got in res.items():
        assert got.get("load_error") is None and got.get("loaded") == 2 and got["equal"], (case, r, got)
    where = {r: next((x.split(" from ", 1)[1] for x in logs[r].splitlines() if "loading step 2 from" in x), "?")
             for r in res}  # fmt: skip
    return max(got["load_s"] for got in res.values()), where


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else HERE / "bench-results" / "recovery"
    if "--out" in sys.argv:
        args.remove(str(out))
    mib = int(args[0]) if args else 256
    rounds = int(args[1]) if len(args) > 1 else 3
    tmp = Path(tempfile.mkdtemp(prefix="recovery-bench-", dir="/var/tmp"))
    shm = Path("/dev/shm") / f"recovery-bench-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    server = S3Server()
    times: dict[str, list[float]] = {k: [] for k in CASES}
    sources: dict[str, dict[int, str]] = {}
    try:
        server.start()
        server.create_bucket(BUCKET)
        url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:10]}"
        c = Cluster(tmp, shm)
        env = {"STATE_MB": str(mib), "CK_TIMEOUT": "300", "KEEP_LAST": "2", "MEMORY_KEEP_LAST": "2",
               "REPLICATE": "1", "MIRROR": url, "S3OPTS": json.dumps(opts(server.endpoint))}  # fmt: skip
        res, _ = c.run("save", STEPS="1,2", KILL_AFTER_FLUSH="1", **env)
        for r, got in res.items():
            assert got["saved"] == [1, 2] and got.get("flush_error") is None, (r, got)
        saved = tmp / "saved"
        saved.mkdir()
        for d in (c.a, c.b, c.ma, c.mb):
            shutil.copytree(d, saved / d.name, symlinks=True)
        for k in range(rounds):
            for case in CASES[k % len(CASES):] + CASES[: k % len(CASES)]:
                _put_back(c, saved)
                if case.startswith("raw"):
                    times[case].append(_raw(c, 2, memory=case == "raw-tmpfs"))
                else:
                    t, where = _resume(c, case, env)
                    times[case].append(t)
                    sources[case] = where
                print(f"round {k + 1}: {case} {times[case][-1]:.3f} s", flush=True)
    finally:
        server.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    cold = statistics.median(times["disk-cold"])
    rows = [{"case": k, "median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "runs_s": v,
             "cold_disk_over_this": cold / statistics.median(v), "read_from": sources.get(k)}
            for k, v in times.items()]  # fmt: skip
    load = os.getloadavg()
    lines = [f"# Recovery from each tier: 2 nodes x 2 ranks, {mib} MiB a rank, {rounds} rounds "
             f"(load average {load[0]:.1f} at the end)", "",
             "| resume from | slowest rank's load() median (s) | min-max (s) | cold disk / this |",
             "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['case']} | {r['median_s']:.3f} | {r['min_s']:.3f}-{r['max_s']:.3f} | "
              f"{r['cold_disk_over_this']:.2f}x |" for r in rows]  # fmt: skip
    table = "\n".join(lines)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"mib_per_rank": mib, "rounds": rounds, "load_avg": load,
                                                  "rows": rows, "when": time.time()}, indent=1))  # fmt: skip
    (out / "results.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
