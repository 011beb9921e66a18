"""Node-local roots: the ranks of one job see the same path, but different disks behind it.

Two "nodes" on one machine: every rank runs in a private mount namespace of its own with a
directory bind-mounted at the root's path (``_rank_worker.enter_node``); ranks 0-1 get node
A's, ranks 2-3 node B's; gloo over loopback. Construction must refuse such a root on every
rank with a ``CheckpointError`` naming the ranks, before anything is written; ranks that do
share one directory (the normal case) construct, save and load as before.

Needs root (mount namespaces): skips with a reason starting ``needs root/``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from _ranks import free_port, rank_results, run_ranks

WORKER = str(Path(__file__).parent / "support" / "_rank_worker.py")
T = 5.0  # the Checkpointer's timeout: how long a rank looks for rank 0's token


@pytest.fixture(autouse=True)
def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip(f"needs root/mount namespaces: bind mounts in a private mount namespace (euid {os.geteuid()})")


def _tree(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.is_file() else "/"
        for p in sorted(d.rglob("*"))
    }


def _run(tmp_path: Path, tag: str, nodes: list[Path], timeout: float = T) -> dict[int, dict[str, Any]]:
    """Run the ``nodes`` scenario on 4 ranks, rank r's root being ``nodes[r]`` mounted at one path."""
    mount = tmp_path / "ck"  # the one path every rank uses; empty on the host
    mount.mkdir(exist_ok=True)
    out, logs = tmp_path / f"{tag}-result", tmp_path / tag
    logs.mkdir()
    port = free_port()
    hung = run_ranks(
        lambda r: [WORKER, "nodes", str(r), "4", str(port), str(mount), str(out)], 4, logs, 120,
        extra_env={"NODE_DIRS": ":".join(map(str, nodes)), "CK_TIMEOUT": str(timeout), "HOST_STORE_S": "30"},
    )  # fmt: skip
    res = rank_results(out, logs, hung, 4)
    assert os.listdir(mount) == []  # every bind mount stayed in its rank's namespace
    return res


@pytest.mark.slow  # > 15 s in make test's parallel phase: make test-slow (and CI) runs it
@pytest.mark.needs_root
@pytest.mark.timeout(200)
def test_node_local_roots_are_refused_on_every_rank_and_a_shared_root_still_works(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    # the normal case, through the same namespaces: every rank has the same directory
    res = _run(tmp_path, "one-dir", [shared] * 4, timeout=60)  # a save's timeout: ample on a busy box
    for got in res.values():
        assert got.get("ctor_error") is None, got["ctor_error"]
        assert got["equal"] and got["steps"] == [2], got
    # node-local: that complete run's files now lie on node B's disk at the job's path (ranks 2-3
    # used to load them), node A's is empty; construction refuses, writing nothing anywhere
    a, b = tmp_path / "nodeA", tmp_path / "nodeB"
    a.mkdir()
    shutil.copytree(shared, b)
    before = {"A": _tree(a), "B": _tree(b)}
    assert any(k.startswith("step_00000002/") for k in before["B"])
    res = _run(tmp_path, "local", [a, a, b, b])
    for r, got in res.items():
        err = got.get("ctor_error")
        assert err is not None, f"rank {r} built a Checkpointer on a node-local root"
        assert err["type"] == "CheckpointError", err
        assert "rank(s) [2, 3] did not see" in err["msg"] and "node-local" in err["msg"], err
        assert "shared file system" in err["msg"], err
        assert got["ctor_s"] < T + 5 + 10, got["ctor_s"]  # the look's window, rank 0's grace, slack
        assert got["after"] == got["before"], (r, got["before"], got["after"])  # this rank's view untouched
        assert "equal" not in got  # no rank got as far as loading anything
    assert {"A": _tree(a), "B": _tree(b)} == before  # nothing written, on either node
    print(f"\nnode-local root refused after {max(g['ctor_s'] for g in res.values()):.2f} s (timeout {T} s)")
