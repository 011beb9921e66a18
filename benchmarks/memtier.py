"""The memory tier of node-local roots, measured: 2 simulated nodes x 2 ranks (root, mount namespaces).

    sudo python benchmarks/memtier.py [MiB per rank: 256] [seconds between saves: 2] [direct_io: auto]
    sudo python benchmarks/memtier.py saves [MiB per rank: 256] [seconds between saves: 0] [steps: 6]

The second form measures saves only, one JSON line: steps 1-N saved with the memory tier and
without it (alternating which goes first is the caller's: run it under each code base in turn),
each save's ``save()`` blocking per rank (steps 2-N: the first pays the arena's allocation), its
staging copy (rank 0's log: "staging"), the disk commit's duration, and, per node, how long after
the disk commit node a's memory tier committed the step (rank 0's log's timestamps).

Saves steps 1-4 with ``memory=`` on /dev/shm, every process killed after ``flush()``; resumes
from the memory tier (page cache dropped first: tmpfs pages stay), from the disks with a warm
and a cold (dropped) page cache (memory wiped); then the same saves without a memory tier.
Prints each resume's slowest rank's ``load()`` and ``save()``'s blocking (steps 2-4, every rank)
with and without the tier, and the memory rounds' and commits' durations. Uses the tests'
simulated cluster (``tests/test_node_memory.Cluster``); drops the page cache (needs root).
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(HERE / "tests"), str(HERE / "tests" / "support")]

from test_node_memory import Cluster  # noqa: E402 - after the tests' paths


def drop_caches() -> None:
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def _stamps(log: str, pattern: str) -> dict[int, float]:
    """Step -> the log line's time (ms since the process started) for the lines matching ``pattern``."""
    return {int(m.group(2)): float(m.group(1)) for m in re.finditer(r"^(\d+) .*?" + pattern, log, re.M)}


def saves() -> None:
    """The ``saves`` form (module docstring): one JSON line on stdout."""
    mib = sys.argv[2] if len(sys.argv) > 2 else "256"
    gap = sys.argv[3] if len(sys.argv) > 3 else "0"
    steps = ",".join(str(s) for s in range(1, 1 + int(sys.argv[4] if len(sys.argv) > 4 else "6")))
    tmp = Path(tempfile.mkdtemp(prefix="memtier-bench-"))
    shm = Path("/dev/shm") / f"memtier-bench-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    out: dict[str, object] = {"mib": int(mib), "gap_s": float(gap), "steps": steps}
    try:
        for tier in ("memory", "none"):
            (tmp / tier).mkdir()
            (shm / tier).mkdir()
            c = Cluster(tmp / tier, shm / tier)
            env = {"STATE_MB": mib, "CK_TIMEOUT": "120", "SAVE_GAP_S": gap, "MEMORY_KEEP_LAST": "2"}
            res, logs = c.run(f"saves-{tier}", STEPS=steps, **env, **({} if tier == "memory" else {"MEMORY": ""}))
            assert all(r.get("save_error") is None and r.get("flush_error") is None for r in res.values()), res
            disk = _stamps(logs[0], r"committed step (\d+): ")
            row: dict[str, object] = {
                "block_s": [b for r in res.values() for b in r["block_s"][1:]],
                "staging_s": [float(x) for x in re.findall(r"committed step \d+: .*staging ([0-9.]+)s", logs[0])][1:],
                "commit_s": [float(x) for x in re.findall(r"committed step \d+: .* in ([0-9.]+)s", logs[0])][1:],
            }
            if tier == "memory":
                row["rounds_s"] = [float(x) for x in re.findall(r"committed in the memory tier \S+ in ([0-9.]+)s",
                                                                 logs[0] + logs[2])]  # fmt: skip
                # node a's leader (rank 0) logs both (the other processes' clocks start elsewhere)
                mem = _stamps(logs[0], r"step (\d+) committed in the memory tier")
                row["to_memory_s"] = [(mem[s] - disk[s]) / 1e3 for s in sorted(mem) if s in disk and s > 1]
            out[tier] = row
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out))


def main() -> None:
    mib = sys.argv[1] if len(sys.argv) > 1 else "256"
    gap = sys.argv[2] if len(sys.argv) > 2 else "2"
    tmp = Path(tempfile.mkdtemp(prefix="memtier-bench-"))
    shm = Path("/dev/shm") / f"memtier-bench-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    try:
        c = Cluster(tmp, shm)
        env = {
            "STATE_MB": mib,
            "CK_TIMEOUT": "120",
            "KILL_AFTER_FLUSH": "1",
            "SAVE_GAP_S": gap,
            "DIRECT_IO": sys.argv[3] if len(sys.argv) > 3 else "auto",
        }
        res, logs = c.run("save-mem", STEPS="1,2,3,4", **env)
        blocking = [b for r in res.values() for b in r["block_s"][1:]]
        rounds = re.findall(r"committed in the memory tier \S+ in ([0-9.]+)s", logs[0] + logs[2])
        commits = re.findall(r"committed step \d+: .* in ([0-9.]+)s", logs[0])

        def resume(tag: str) -> float:
            got, _ = c.run(tag, **env)
            assert all(r["loaded"] == 4 and r["equal"] for r in got.values()), got
            return max(r["load_s"] for r in got.values())

        drop_caches()
        t_mem = resume("from-memory")
        for d in (c.ma, c.mb):
            shutil.rmtree(d)
            d.mkdir()
        t_warm = resume("disk-warm")
        drop_caches()
        t_cold = resume("disk-cold")
        for d in (c.a, c.b):
            shutil.rmtree(d)
            d.mkdir()
        res, _ = c.run("save-disk", STEPS="1,2,3,4", MEMORY="", **env)
        plain = [b for r in res.values() for b in r["block_s"][1:]]
        print(f"{mib} MiB/rank, 4 ranks, {gap} s between saves")
        print(f"resume, slowest rank's load(): memory {t_mem:.3f} s, disk warm {t_warm:.3f} s, cold {t_cold:.3f} s")
        print(
            f"save() blocking, median/max: with the memory tier {statistics.median(blocking) * 1e3:.1f}/"
            f"{max(blocking) * 1e3:.1f} ms, without {statistics.median(plain) * 1e3:.1f}/{max(plain) * 1e3:.1f} ms"
        )
        print(f"memory rounds (node a, node b) {rounds} s; commits {commits} s")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    saves() if sys.argv[1:2] == ["saves"] else main()
