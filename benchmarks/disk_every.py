"""``disk_every``, measured: 2 simulated nodes x 2 ranks (root, mount namespaces), a memory tier on /dev/shm.

    sudo python benchmarks/disk_every.py [MiB per rank: 64] [runs: 2]

Each run saves steps 1-8 with ``disk_every=2`` (odd saves to the disks with their memory copy,
even saves to the memory tier only), 1 s between saves, each ``save()`` waiting for the previous
save's result. Prints, for disk saves and memory-only saves apart (steps 3-8: the first of each
kind pays its arena and directories), ``save()``'s blocking and the time from ``save()`` to the
commit, over every rank. Uses the tests' simulated cluster (``tests/test_node_memory.Cluster``).
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(HERE / "tests"), str(HERE / "tests" / "support")]

from test_node_memory import Cluster  # noqa: E402 - after the tests' paths


def main() -> None:
    mib = sys.argv[1] if len(sys.argv) > 1 else "64"
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    got: dict[str, dict[str, list[float]]] = {k: {"block": [], "commit": []} for k in ("disk", "memory")}
    for k in range(runs):
        tmp = Path(tempfile.mkdtemp(prefix="disk-every-bench-"))
        shm = Path("/dev/shm") / f"disk-every-bench-{uuid.uuid4().hex[:8]}"
        shm.mkdir()
        try:
            res, _ = Cluster(tmp, shm).save(f"r{k}", list(range(1, 9)), DISK_EVERY="2", STATE_MB=mib,
                                            SAVE_GAP_S="1", CK_TIMEOUT="120")  # fmt: skip
            for rank in res.values():
                for i, (block, commit) in enumerate(zip(rank["block_s"], rank["commit_s"], strict=True)):
                    if i >= 2:
                        kind = got["disk" if i % 2 == 0 else "memory"]
                        kind["block"].append(block)
                        kind["commit"].append(commit)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
    for name, d in got.items():
        b, c = d["block"], d["commit"]
        print(f"{name}: n={len(b)} save() blocking median {statistics.median(b):.3f} s ({min(b):.3f}-{max(b):.3f}), "
              f"save() to commit median {statistics.median(c):.3f} s ({min(c):.3f}-{max(c):.3f})")


if __name__ == "__main__":
    main()
