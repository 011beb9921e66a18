"""Deferred staging with real processes: DDP and FSDP2 on gloo (every rank saves exactly the
state at save(); a write on one rank fails the save on every rank, named there), and a process
killed with SIGKILL while its deferred save is in flight (nothing of it commits, the previous
checkpoint loads, the root takes new saves)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import free_port, log_tail, run_ranks

import asyncckpt

WORKER = str(Path(__file__).parent / "support" / "_deferred_worker.py")


def spawn(tmp: Path, scenario: str, world: int) -> dict[int, dict[str, Any]]:
    logs = tmp / f"logs-{scenario}"
    logs.mkdir()
    port, root, out = free_port(), tmp / "root", tmp / "out"
    hung = run_ranks(
        lambda r: [WORKER, scenario, str(r), str(world), str(port), str(root), str(out)], world, logs, 150.0, warm=True
    )
    assert not hung, f"ranks {hung} still running at the deadline"
    res = {}
    for r in range(world):
        f = Path(f"{out}.{r}.json")
        assert f.exists(), f"rank {r} wrote no result:\n{log_tail(logs, r)}"
        res[r] = json.loads(f.read_text())
        assert "crash" not in res[r], res[r]["crash"]
    return res


def test_ddp(tmp_path: Path) -> None:
    res = spawn(tmp_path, "ddp", 2)
    for r, x in res.items():
        assert x["deferred"] and x["exact"] == [], (r, x)
        assert x["changed"] is not None and x["changed"]["type"] == "StateChangedError", (r, x)
        assert "model.2.weight" in x["changed"]["msg"] and x["steps"] == [1], (r, x)
    assert res[1]["changed"]["keys"] == ["model.2.weight"]


def test_fsdp2(tmp_path: Path) -> None:
    res = spawn(tmp_path, "fsdp2", 2)
    for r, x in res.items():
        assert x["deferred"] and x["exact"] == [], (r, x)


def test_killed_while_a_deferred_save_is_in_flight(tmp_path: Path) -> None:
    root, out = tmp_path / "root", tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([sys.executable, WORKER, "crash", "0", "1", "0", str(root), str(out)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        assert p.stdout is not None
        lines = []
        for line in p.stdout:  # the save() of step 2 returned: kill at once, mid-copy or just after
            lines.append(line)
            if line.startswith(b"SAVED"):
                os.kill(p.pid, signal.SIGKILL)
                break
        assert p.wait(60) == -signal.SIGKILL, b"".join(lines).decode(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if p.stdout is not None:
            p.stdout.close()
    latest = asyncckpt.find_latest(root)
    assert latest is not None and latest.step == 1
    want = torch.load(f"{out}.step1.pt")
    got = asyncckpt.load(root)["model"]
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    with asyncckpt.Checkpointer(root) as ck:  # the root is usable: step 2 saves again
        assert ck.steps() == [1]
        ck.save(2, {"model": want}).result(60)
        assert ck.steps() == [1, 2]
