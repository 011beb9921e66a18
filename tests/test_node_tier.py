"""The node-local tier (``Checkpointer(root, node_local=True)``): 2 nodes x 2 ranks, real processes.

Each rank runs in a private mount namespace with its node's directory bind-mounted at the job's
one root path (``_rank_worker.enter_node``); ranks 0-1 are node "a", ranks 2-3 node "b"
(``ASYNCCKPT_NODE``); gloo over loopback. Needs root (mount namespaces). Each run of 4 ranks
costs ~10-15 s of process start on a busy 2-core machine: the tests with several runs are slow.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from _ranks import free_port, rank_results, run_ranks

WORKER = str(Path(__file__).parent / "support" / "_node_worker.py")
NAMES = "a:a:b:b"


@pytest.fixture(autouse=True)
def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip(f"needs root/mount namespaces: bind mounts in a private mount namespace (euid {os.geteuid()})")


def _tree(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.is_file() else "/"
        for p in sorted(d.rglob("*"))
        if not p.name.startswith(".asyncckpt-owner")
    }


def _run(
    tmp_path: Path, tag: str, nodes: tuple[Path, Path], names: str = NAMES, **env: str
) -> dict[int, dict[str, Any]]:
    mount = tmp_path / "ck"
    mount.mkdir(exist_ok=True)
    out, logs = tmp_path / f"{tag}-result", tmp_path / tag
    logs.mkdir()
    port = free_port()
    dirs = ":".join(map(str, [nodes[0], nodes[0], nodes[1], nodes[1]]))
    hung = run_ranks(
        lambda r: [WORKER, "run", str(r), "4", str(port), str(mount), str(out)], 4, logs, 150,
        extra_env={"NODE_DIRS": dirs, "NODE_NAMES": names, "HOST_STORE_S": "30", **env},
    )  # fmt: skip
    res = rank_results(out, logs, hung, 4)
    assert os.listdir(mount) == []  # every bind mount stayed in its rank's namespace
    return res


def _nodes(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "nodeA", tmp_path / "nodeB"
    a.mkdir(exist_ok=True)
    b.mkdir(exist_ok=True)
    return a, b


def _steps(d: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in d.iterdir() if p.name.startswith("step_") and p.name[5:].isdigit())


def _files(d: Path, step: int) -> set[str]:
    p = d / f"step_{step:08d}"
    return {x.name for x in p.iterdir()} if p.exists() else set()


@pytest.mark.needs_root
@pytest.mark.timeout(300)
def test_each_node_holds_its_ranks_files_and_every_rank_resumes_bit_exact(tmp_path: Path) -> None:
    a, b = _nodes(tmp_path)
    res = _run(tmp_path, "first", (a, b), STEPS="1,2,3", KEEP_LAST="2")
    for got in res.values():
        assert got["load_error"]["type"] == "CheckpointNotFoundError", got  # nothing to resume yet
        assert got["saved"] == [1, 2, 3], got
    assert len({g["run_id"] for g in res.values()}) == 1
    # each node: the manifest and its own ranks' files only; retention per node kept 2 steps
    assert _files(a, 3) == {"manifest.json", "rank00000.safetensors", "rank00000.json",
                            "rank00001.safetensors", "rank00001.json"}  # fmt: skip
    assert _files(b, 3) == {"manifest.json", "rank00002.safetensors", "rank00002.json",
                            "rank00003.safetensors", "rank00003.json"}  # fmt: skip
    assert (a / "step_00000003" / "manifest.json").read_bytes() == (b / "step_00000003" / "manifest.json").read_bytes()
    # node a (rank 0's) keeps 2; node b one more until the next save confirms step 3 to it
    assert _steps(a) == [2, 3] and _steps(b) == [1, 2, 3]
    run = res[0]["run_id"]
    res = _run(tmp_path, "second", (a, b), STEPS="4", KEEP_LAST="2")
    for got in res.values():
        assert got["loaded"] == 3 and got["equal"], got
        assert got["run_id"] == run, got  # the resumed run continues
        assert got["saved"] == [4], got
    assert _steps(a) == [3, 4] and _steps(b) == [2, 3, 4]  # retention per node goes on after a restart


@pytest.mark.needs_root
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_node_lost_mid_save_fails_the_save_everywhere_and_the_restart_resumes_the_last_common_step(
    tmp_path: Path,
) -> None:
    a, b = _nodes(tmp_path)
    res = _run(tmp_path, "first", (a, b), STEPS="1,2,3", DIE_RANKS="2,3", DIE_BEFORE="3", CK_TIMEOUT="30")
    for r in (0, 1):
        assert res[r]["saved"] == [1, 2], res[r].get("save_error")
        assert res[r]["failed_step"] == 3, res[r]
        assert res[r]["save_error"]["type"] == "SaveTimeoutError", res[r]
    assert not (a / "step_00000003").exists() and not (b / "step_00000003").exists()
    res = _run(tmp_path, "restart", (a, b), STEPS="3")
    for got in res.values():
        assert got["loaded"] == 2 and got["equal"], got
        assert got["saved"] == [3], got.get("save_error")


@pytest.mark.needs_root
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_wiped_node_or_another_runs_files_are_never_read(tmp_path: Path) -> None:
    a, b = _nodes(tmp_path)
    for got in _run(tmp_path, "first", (a, b), STEPS="1,2").values():
        assert got["saved"] == [1, 2], got.get("save_error")
    # node b's disk now holds another run's step 5 and step 2 of another attempt: neither is read
    other_a, other_b = tmp_path / "otherA", tmp_path / "otherB"
    other_a.mkdir()
    other_b.mkdir()
    for got in _run(tmp_path, "other", (other_a, other_b), STEPS="2,5").values():
        assert got["saved"] == [2, 5], got.get("save_error")
    shutil.rmtree(b / "step_00000002")
    shutil.copytree(other_b / "step_00000002", b / "step_00000002")
    shutil.copytree(other_b / "step_00000005", b / "step_00000005")
    before = _tree(a)
    res = _run(tmp_path, "mixed", (a, b))
    for got in res.values():
        assert got["loaded"] == 1 and got["equal"], got  # the newest step every rank holds with one attempt
    # a wiped node: no step is complete for every rank; nothing is read, every rank says so
    shutil.rmtree(b)
    b.mkdir()
    res = _run(tmp_path, "wiped", (a, b), STEPS="6")
    runs = set()
    for got in res.values():
        assert got["load_error"]["type"] == "CheckpointNotFoundError", got
        assert got["saved"] == [6], got
        runs.add(got["run_id"])
    assert len(runs) == 1
    assert _tree(a).items() >= before.items()  # node a's earlier files were left as they were
    res = _run(tmp_path, "after-wipe", (a, b))
    for got in res.values():
        assert got["loaded"] == 6 and got["equal"] and got["run_id"] in runs, got


@pytest.mark.needs_root
@pytest.mark.slow  # three runs of 4 ranks
@pytest.mark.timeout(400)
def test_a_step_damaged_in_its_only_copy_falls_back_to_the_step_before_and_the_run_goes_on(tmp_path: Path) -> None:
    """Rank 2's shard of step 3 on node b has one byte flipped (its only copy: no memory tier, no
    store). Before, every rank's load() raised and the job could not resume at all. Now every
    rank resumes step 2 bit-exact, each node marks step 3's attempt bad, and the job saves step
    3 again (the step rule lets it: rank 0's root no longer counts it) and 4; the next start
    resumes 4. Before it, a save of step 3 or 2 is refused as on any root."""
    a, b = _nodes(tmp_path)
    for got in _run(tmp_path, "first", (a, b), STEPS="1,2,3", KEEP_LAST="3").values():
        assert got["saved"] == [1, 2, 3], got
    # the step rule holds on node-local roots (it asked rank 0's disk, where every step is a part,
    # never a whole step: both saves went through, replacing committed parts)
    for got in _run(tmp_path, "rule", (a, b), STEPS="3,2", KEEP_LAST="3", GO_ON="1").values():
        assert got["loaded"] == 3 and got["saved"] == [], got
        (three, two) = got["save_errors"]
        assert three["type"] == "ValueError" and "step 3 is already committed" in three["msg"], three
        assert two["type"] == "ValueError" and "step 2 is already committed" in two["msg"], two
    shard = b / "step_00000003" / "rank00002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF  # same size: only the CRC-32C finds it
    shard.write_bytes(bytes(raw))
    res = _run(tmp_path, "fallback", (a, b), STEPS="3,4", KEEP_LAST="3")
    for r, got in res.items():
        assert got.get("load_error") is None and got["loaded"] == 2 and got["equal"], (r, got)
        assert got["saved"] == [3, 4] and got.get("save_error") is None, (r, got)
        log = (tmp_path / "fallback" / f"rank{r}.log").read_text(errors="replace")
        assert "step 3 cannot be loaded: rank(s) [2] hold a damaged part in every tier" in log, log[-3000:]
        assert "falling back to step 2" in log
    for d in (a, b):  # the mark names the damaged attempt only; the new step 3 replaced the old parts
        assert [p.name.split(".")[0] for p in (d / ".asyncckpt" / "bad").iterdir()] == ["step_00000003"]
        assert _steps(d)[-2:] == [3, 4]
    for got in _run(tmp_path, "after", (a, b)).values():
        assert got["loaded"] == 4 and got["equal"], got


@pytest.mark.slow  # > 15 s in make test's parallel phase: make test-slow (and CI) runs it
@pytest.mark.needs_root
@pytest.mark.timeout(300)
def test_a_node_that_cannot_commit_fails_the_save_on_every_rank_and_nothing_is_lost(tmp_path: Path) -> None:
    a, b = _nodes(tmp_path)
    # node b's leader (rank 2): the rename that commits its part of step 3 fails with EIO
    res = _run(tmp_path, "first", (a, b), STEPS="1,2,3", FAIL_RENAME_RANK="2", FAIL_RENAME_STEP="3")
    for r, got in res.items():
        assert got["saved"] == [1, 2] and got["failed_step"] == 3, got
        err = got["save_error"]
        assert err["type"] == "SaveError", err  # the same error on every rank, naming the node
        assert err["failures"]["0"]["exc_type"] == "NodeCommitError", (r, err)
        assert "node 'b' (leader rank 2)" in err["failures"]["0"]["message"], (r, err)
        assert "Input/output error" in err["failures"]["0"]["message"], (r, err)
    assert _steps(a) == [1, 2] and _steps(b) == [1, 2]  # rank 0's node took its commit back
    res = _run(tmp_path, "restart", (a, b), STEPS="3")
    for got in res.values():
        assert got["loaded"] == 2 and got["equal"], got
        assert got["saved"] == [3], got.get("save_error")
    assert _steps(a) == [1, 2, 3] and _steps(b) == [1, 2, 3]


@pytest.mark.needs_root
@pytest.mark.timeout(300)
def test_a_node_whose_commit_is_slow_but_in_time_commits_the_save_on_every_rank(tmp_path: Path) -> None:
    # node b's leader (rank 2) takes 4 s to rename its part of step 2 into place, well within the
    # 30 s deadline: rank 0 waited for its acknowledgement against a duration read as a point in
    # time (already past) and failed the save at once, whatever the deadline
    a, b = _nodes(tmp_path)
    res = _run(tmp_path, "first", (a, b), STEPS="1,2", FAIL_RENAME_RANK="2", FAIL_RENAME_STEP="2",
               SLOW_RENAME_S="4", CK_TIMEOUT="30")  # fmt: skip
    for got in res.values():
        assert got["saved"] == [1, 2], got.get("save_error")
    assert _steps(a) == [1, 2] and _steps(b) == [1, 2]


@pytest.mark.slow  # > 15 s on a quiet 2-core machine: make test-slow (and CI) runs it
@pytest.mark.needs_root
@pytest.mark.timing
@pytest.mark.timeout(300)
def test_a_node_whose_commit_hangs_fails_the_save_with_a_timeout_on_every_rank(tmp_path: Path) -> None:
    a, b = _nodes(tmp_path)
    res = _run(tmp_path, "first", (a, b), STEPS="1,2", FAIL_RENAME_RANK="2", FAIL_RENAME_STEP="2",
               FAIL_RENAME_HANG_S="25", CK_TIMEOUT="10")  # fmt: skip
    for r, got in res.items():
        assert got["saved"] == [1] and got["failed_step"] == 2, got
        err = got["save_error"]
        assert err["type"] == "SaveTimeoutError", (r, err)
        if r != 2:  # rank 2, stuck in its rename past the deadline, gave up on rank 0 by itself
            assert "node 'b' (leader rank 2) did not confirm its commit" in err["failures"]["0"]["message"], (r, err)
    assert _steps(a) == [1] and _steps(b) == [1]  # rank 0's node took its commit back


@pytest.mark.needs_root
@pytest.mark.timing
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_rank0s_commit_rename_that_lands_after_the_deadline_is_taken_back_and_the_restart_resumes_before_it(
    tmp_path: Path,
) -> None:
    # rank 0's rename of its node's part of step 2 takes 9.5 s of an 8 s deadline: the deadline
    # cancels the commit while the thread goes on and lands it; every rank hears "failed", node b
    # committed on the go word. Rank 0 went on without taking its late commit back, so both nodes
    # held step 2 (one attempt) and the restart resumed a save every rank was told had failed
    a, b = _nodes(tmp_path)
    res = _run(tmp_path, "first", (a, b), STEPS="1,2", FAIL_RENAME_RANK="0", FAIL_RENAME_STEP="2",
               SLOW_RENAME_S="9.5", CK_TIMEOUT="8", LINGER_S="6")  # fmt: skip
    for got in res.values():
        assert got["saved"] == [1] and got["failed_step"] == 2, got
        assert got["save_error"]["type"] == "SaveTimeoutError", got
    assert _steps(a) == [1], _steps(a)  # the late commit was taken back: disk and verdict agree
    res = _run(tmp_path, "restart", (a, b), STEPS="2")
    for got in res.values():
        assert got["loaded"] == 1 and got["equal"], got
        assert got["saved"] == [2], got.get("save_error")
    assert _steps(a) == [1, 2] and _steps(b) == [1, 2]


@pytest.mark.slow  # > 15 s on a quiet 2-core machine: make test-slow (and CI) runs it
@pytest.mark.needs_root
@pytest.mark.timing
@pytest.mark.timeout(300)
def test_a_node_whose_retention_is_slow_still_hears_the_saves_verdict_in_time(tmp_path: Path) -> None:
    # node b's leader (rank 2) removes step 1 after committing step 3 (keep_last=1) on a disk
    # that takes 12 s for it, past the 8 s deadline: it ran that retention before reading the
    # verdict, so its save of step 3 timed out by its own guard while every other rank committed
    # it (one save, two outcomes), and its ranks then missed the next save
    a, b = _nodes(tmp_path)
    res = _run(tmp_path, "first", (a, b), STEPS="1,2,3,4", KEEP_LAST="1", SLOW_RETIRE_RANK="2",
               SLOW_RETIRE_STEP="1", SLOW_RETIRE_S="12", CK_TIMEOUT="8")  # fmt: skip
    for got in res.values():
        assert got["saved"] == [1, 2, 3, 4], got.get("save_error")
        assert "flush_error" not in got, got
    assert _steps(a) == [4] and _steps(b) == [3, 4]  # retention caught up by close()
    res = _run(tmp_path, "restart", (a, b))
    for got in res.values():
        assert got["loaded"] == 4 and got["equal"], got


@pytest.mark.needs_root
@pytest.mark.timeout(300)
def test_a_rank_whose_node_name_does_not_match_its_disk_fails_the_construction_on_every_rank(tmp_path: Path) -> None:
    # rank 2 runs on node b's disk but says it is on node a (ASYNCCKPT_NODE set wrong): every
    # save failed with a CheckpointCorruptError ("holds no complete part") while node b kept a
    # part nobody could use; now the construction fails on every rank, naming rank 2
    a, b = _nodes(tmp_path)
    res = _run(tmp_path, "first", (a, b), names="a:a:a:b", STEPS="1")
    for got in res.values():
        err = got["init_error"]
        assert err["type"] == "CheckpointError", got
        assert "rank 2 (node 'a') does not see the disk of its own node 'a'" in err["msg"], err
        assert "rank 2 (node 'a') sees the disk of node 'b'" in err["msg"], err
    for d in (a, b):
        assert not [p for p in d.iterdir() if p.name.startswith("step_") or p.name.startswith(".asyncckpt-shared-")]
    res = _run(tmp_path, "fixed", (a, b), STEPS="1")  # the names put right: the job runs
    for got in res.values():
        assert got["saved"] == [1], got


@pytest.mark.needs_root
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_interleaved_node_names_put_two_leaders_on_one_disk_and_the_error_names_the_names(tmp_path: Path) -> None:
    # names a:b:a:b on disks A,A,B,B: the leaders of "a" (rank 0) and "b" (rank 1) are both on
    # disk A, so rank 1 could not take the root ("owned by another writer"): the error named an
    # ownership conflict, not the node names that caused it
    a, b = _nodes(tmp_path)
    res = _run(tmp_path, "first", (a, b), names="a:b:a:b", STEPS="1")
    for got in res.values():
        err = got["init_error"]
        assert err["type"] == "CheckpointError", got
        for said in ("rank 0 (node 'a') sees the disk of node 'b'", "rank 1 (node 'b') sees the disk of node 'a'",
                     "rank 2 (node 'a') does not see the disk of its own node 'a'",
                     "rank 3 (node 'b') does not see the disk of its own node 'b'"):  # fmt: skip
            assert said in err["msg"], err
