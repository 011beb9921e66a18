"""The memory tier of node-local roots, measured: 2 simulated nodes x 2 ranks (root, mount namespaces).

    sudo python benchmarks/memtier.py [MiB per rank: 256] [seconds between saves: 2] [direct_io: auto]

Saves steps 1-4 with ``memory=`` on /dev/shm, every process killed after ``flush()``; resumes
from the memory tier (page cache dropped first: tmpfs pages stay), from the disks with a warm
and a cold (dropped) page cache (memory wiped); then the same saves without a memory tier.
Prints each resume's slowest rank's ``load()`` and ``save()``'s blocking (steps 2-4, every rank)
with and without the tier, and the memory rounds' and commits' durations. Uses the tests'
simulated cluster (``tests/test_node_memory.Cluster``); drops the page cache (needs root).
"""

from __future__ import annotations

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
    main()
