"""I/O error sweep (SQLite style) across two real gloo ranks: EIO, then ENOSPC, at the i-th
file operation of a save, for every i, on the leader and on a non-leader; each persistent
(that op and every later one fail) and transient (only that op fails)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _ranks import free_port, log_tail, run_ranks

from asyncckpt import find_latest, load

WORKER = str(Path(__file__).parent / "support" / "_sweep_worker.py")
TIMEOUT = 10.0  # the save timeout the ranks use (_sweep_worker.TIMEOUT)


@pytest.mark.slow  # > 15 s in make test's parallel phase: make test-slow (and CI) runs it
@pytest.mark.timeout(300)
def test_io_error_sweep_on_leader_and_follower(tmp_path: Path) -> None:
    world, root, out = 2, tmp_path / "ck", tmp_path / "res"
    port = free_port()
    hung = run_ranks(
        lambda r: [WORKER, str(r), str(world), str(port), str(root), str(out)], world, tmp_path, deadline=240
    )
    assert not hung, f"ranks {hung} still running at the deadline"
    res = {}
    for r in range(world):
        path = Path(f"{out}.{r}.json")
        assert path.exists(), log_tail(tmp_path, r)
        res[r] = json.loads(path.read_text())
        assert "crash" not in res[r], res[r]["crash"]
    n_cases = len(res[0]["cases"])
    by_op: dict[str, int] = {}
    benign = 0
    for c0, c1 in zip(res[0]["cases"], res[1]["cases"], strict=True):
        both = (c0, c1)
        target = c0["target"]
        mine = both[target]
        op, path, _ = mine["faulted_op"]
        by_op[op] = by_op.get(op, 0) + 1
        if mine["once"] and op == "mkdir" and c0["type"] is None:
            # a one-off EIO from mkdir of a directory the leader already made: ensure_dir
            # sees the directory is there, so the save rightly commits
            assert target != 0 and c1["type"] is None and c0["latest"] == c1["latest"] == c0["step"], both
            benign += 1
            continue
        for c in both:
            assert c["type"] == "SaveError", (c, mine)
            assert list(c["failures"]) == [str(target)], c
            _, err, fpath = c["failures"][str(target)]
            assert err == c["err"] and fpath and fpath.startswith(str(root)), c
            assert c["elapsed"] < TIMEOUT + 2.0, c
            assert c["latest"] is not None  # a loadable checkpoint is always there
            assert c["retry"] == c["step"]
        assert mine["fsync_retried"] == [], mine
    print(
        f"\nI/O error sweep: {n_cases} cases (ops per save: {res[0]['ops_per_rank']}), faulted ops: {by_op}; "
        f"{benign} benign (a one-off mkdir EIO on an existing directory: committed); every other case: "
        "SaveError on both ranks naming the rank, errno and path, a loadable checkpoint left, retry committed"
    )
    assert n_cases == 4 * sum(res[0]["ops_per_rank"]) >= 80
    assert set(by_op) >= {"open", "write", "fsync", "close", "rename", "mkdir", "fsync_dir"}
    latest = find_latest(root)
    assert latest is not None and load(root, latest.step, rank=1)["w"][0].item() == float(latest.step)
