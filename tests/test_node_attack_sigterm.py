"""Attacks on the node-local tiers' SIGTERM handling: a preemption that reaches some ranks only.

2 nodes x 2 ranks (``test_node_memory.Cluster``: each node's disk and tmpfs directory
bind-mounted in the ranks' private mount namespaces); ranks 0-1 node "a", 2-3 node "b". The
preempted ranks (``SIGTERM_RANKS``) run asyncckpt's handler (its final save ``FINAL_STEP``, its
flush) with no flush or close of their own; the others go on as a training loop would (a plain
save of ``OTHERS_FINAL`` when set, then flush and close). Every process's exit status is kept:
the handler's failure must be a nonzero exit, never a silent zero. Needs root.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_node_attack_misc import Nodes
from test_node_memory import _needs_root, _resumed, _steps
from test_node_replica import _wipe, shm_dir


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    _needs_root()
    with shm_dir() as shm:
        yield Nodes(tmp_path, shm)


def _preempted(c: Nodes, ranks: str, **env: str) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """A run that saves steps 1 and 2 on every rank, then SIGTERMs ``ranks`` (their handler's
    final save: step 3); ``CK_TIMEOUT`` 20 s unless ``env`` says."""
    return c.run(f"preempt-{ranks}", STEPS="1,2", SIGTERM_AT_END="1", SIGTERM_RANKS=ranks, FINAL_STEP="3",
                 **{"CK_TIMEOUT": "20", **env})  # fmt: skip


@contextlib.contextmanager
def _mirrored() -> Iterator[tuple[Any, str, dict[str, str]]]:
    """A SeaweedFS of this test's own, a fresh prefix on it and the ranks' environment for a
    persistent tier there with ``mirror_every=3`` (the test skips without the s3 extra)."""
    from s3fixtures import opts, require_s3, running_server

    require_s3()
    with running_server("node-attack") as s3:
        url = f"s3://node-attack/run-{uuid.uuid4().hex[:10]}"
        yield s3, url, {"MIRROR": url, "S3OPTS": json.dumps(opts(s3.endpoint)), "MIRROR_EVERY": "3"}


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks, one waiting out a timeout
@pytest.mark.timeout(400)
def test_sigterm_on_one_node_only_fails_its_final_save_with_a_nonzero_exit_and_loses_no_step(nodes: Nodes) -> None:
    # node b preempted alone: its final save (step 3) has no partner on node a (rank 0 never
    # calls save()): it must fail within the grace and exit nonzero, never claim a step
    c = nodes
    res, logs = _preempted(c, "2,3", CK_TIMEOUT="8", KEEP_LAST="2")
    for r in range(4):
        assert res[r]["saved"] == [1, 2], (r, res[r])
    assert c.codes[2] != 0 and c.codes[3] != 0, (c.codes, logs[2][-3000:])
    assert not res[2].get("sigterm_flushed") and not res[3].get("sigterm_flushed"), res
    assert "final flush on SIGTERM failed" in logs[2], logs[2][-3000:]
    assert c.codes[0] == 0 and c.codes[1] == 0, (c.codes, logs[0][-3000:])
    for d in (c.a, c.b):
        assert 3 not in _steps(d), d  # the final save committed nowhere
    res, _ = c.run("restart", KILL_AFTER_FLUSH="1")
    _resumed(res, 2)


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(400)
def test_sigterm_on_node_b_only_while_rank_0_saves_takes_rank_0s_route_and_the_restart_skips_the_lost_step(
    nodes: Nodes,
) -> None:
    # docs/api.md: the final save goes to every tier because rank 0's handler decides it. Node b
    # alone preempted, its final save (step 3) paired with node a's plain save of step 3:
    # disk_every=5 sends it to memory only (rank 0 is not in its grace). Node b's memory goes
    # with the node: the restart must resume step 1 (the newest disk step), bit-exact, never 3
    c = nodes
    res, logs = _preempted(c, "2,3", OTHERS_FINAL="3", DISK_EVERY="5")
    assert c.codes == [0, 0, 9, 9], (c.codes, logs[2][-3000:])  # 9: the handler succeeded (the worker's exit)
    for r in (0, 1):
        assert res[r]["saved"] == [1, 2, 3] and res[r]["tiers"][2][0] == "memory", res[r]
    for r in (2, 3):
        assert res[r]["saved"] == [1, 2] and res[r].get("sigterm_flushed"), res[r]
    assert _steps(c.a) == [1] and _steps(c.b) == [1]  # the final save reached no disk: rank 0's route
    assert _steps(c.ma) == [3] and _steps(c.mb) == [3]
    _wipe(c.mb)  # node b was preempted: its tmpfs is gone
    res, _ = c.run("restart", KILL_AFTER_FLUSH="1", DISK_EVERY="5")
    _resumed(res, 1)


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(400)
def test_with_the_replica_node_bs_memory_only_final_save_survives_the_node_on_its_buddies(nodes: Nodes) -> None:
    # as above, with replicate=True: the memory-only step 3 is pushed to the buddies (docs), so
    # node b lost (disk and memory) resumes step 3 from node a's memory, bit-exact
    c = nodes
    res, logs = _preempted(c, "2,3", OTHERS_FINAL="3", DISK_EVERY="5", REPLICATE="1")
    assert c.codes == [0, 0, 9, 9], (c.codes, logs[2][-3000:])
    assert _steps(c.a) == [1] and _steps(c.b) == [1] and _steps(c.ma) == [3] and _steps(c.mb) == [3]
    _wipe(c.b, c.mb)
    res, logs = c.run("replaced", KILL_AFTER_FLUSH="1", DISK_EVERY="5", REPLICATE="1")
    _resumed(res, 3)
    assert "loading step 3 from its buddy's memory" in logs[2], logs[2][-3000:]


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(400)
def test_sigterm_on_rank_0_only_while_the_others_save_sends_the_final_save_to_every_tier(nodes: Nodes) -> None:
    # the other half of the docs' rule: rank 0 in its grace, the others in their training loop
    # (a plain save of the same step): rank 0's word sends it to the disks too
    c = nodes
    res, logs = _preempted(c, "0", OTHERS_FINAL="3", DISK_EVERY="5")
    for r in (1, 2, 3):
        assert res[r]["saved"] == [1, 2, 3] and res[r]["tiers"][2][0] == "local", res[r]
        assert c.codes[r] == 0, (c.codes, logs[r][-3000:])
    assert res[0].get("sigterm_flushed") and c.codes[0] == 9, (c.codes, res[0], logs[0][-3000:])
    assert _steps(c.a) == [1, 3] and _steps(c.b) == [1, 3]
    _wipe(c.ma, c.mb)  # both nodes rebooted: the disks alone
    res, _ = c.run("restart", KILL_AFTER_FLUSH="1", DISK_EVERY="5")
    _resumed(res, 3)


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks and a store
@pytest.mark.timeout(400)
def test_sigterm_on_node_b_only_with_mirror_every_uploads_the_skipped_step_once_and_a_lost_node_resumes_it(
    nodes: Nodes,
) -> None:
    # mirror_every=3: commits 1 and 4 are due. Node b alone preempted, its final save paired with
    # node a's plain save of step 3 (not due: skipped). Node b's handler uploads the skipped
    # commit, node a's close() too: the rounds of both halves must be the same round (a handler
    # that uploaded alone would wait for rank 0 until its grace ran out)
    c = nodes
    with _mirrored() as (s3, url, env):
        res, logs = _preempted(c, "2,3", OTHERS_FINAL="3", **env)
        assert c.codes == [0, 0, 9, 9], (c.codes, logs[2][-3000:])
        for r in (0, 1):
            assert res[r]["saved"] == [1, 2, 3] and res[r].get("flush_error") is None, res[r]
        from test_node_tier_store import _stored

        assert _stored(s3, url) == [1, 3]
        _wipe(c.b, c.mb)  # node b lost
        res, logs = c.run("restart", KILL_AFTER_FLUSH="1", **env)
        _resumed(res, 3)
        assert "rank 2: loading step 3 from the store" in logs[2], logs[2][-3000:]


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(400)
def test_sigterm_on_node_b_only_while_node_a_saves_another_step_commits_no_mix_and_exits_nonzero(
    nodes: Nodes,
) -> None:
    # node b's handler saves step 3 while node a's loop saves step 4 (one collective save, two
    # steps): it must fail on every rank (never a step 4 holding node b's step 3), node b's
    # handler exiting nonzero, and the restart resume step 2 bit-exact
    c = nodes
    res, logs = _preempted(c, "2,3", OTHERS_FINAL="4", MEMORY_KEEP_LAST="3")
    assert c.codes[2] == 1 and c.codes[3] == 1, (c.codes, logs[2][-3000:])
    for r in (0, 1):  # the cause named on every rank: ranks 2 and 3 save another step (before: rank 0's
        # commit check found a manifest without their files, "CheckpointCorruptError: ... malformed")
        err = res[r]["save_error"]
        assert res[r]["saved"] == [1, 2] and res[r]["failed_step"] == 4, res[r]
        assert err["type"] == "SaveError" and sorted(err["failures"]) == ["2", "3"], (r, err)
        assert all("ranks disagree on the step: rank 0 saves 4" in f["message"] for f in err["failures"].values())
    assert "ranks disagree on the step" in logs[2], logs[2][-3000:]
    for d in (c.a, c.b, c.ma, c.mb):
        assert _steps(d) == [1, 2], d
    res, _ = c.run("restart", KILL_AFTER_FLUSH="1")
    _resumed(res, 2)


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks and a store
@pytest.mark.timeout(400)
def test_sigterm_on_node_b_only_without_a_final_save_while_node_a_trains_on_never_claims_an_upload(
    nodes: Nodes,
) -> None:
    # mirror_every=3: step 2 skipped. Node b preempted (no final save): its handler uploads step
    # 2 while node a saves step 3 (which node b never joins). Whatever each side's outcome, a
    # zero-status handler (9 here) must mean step 2 is on the store, step 3 commits nowhere, and
    # the restart resumes a step every rank holds, bit-exact
    from test_node_tier_store import _stored

    c = nodes
    with _mirrored() as (s3, url, env):
        res, logs = c.run("preempt-b", STEPS="1,2", SIGTERM_AT_END="1", SIGTERM_RANKS="2,3", OTHERS_FINAL="3",
                          CK_TIMEOUT="15", **env)  # fmt: skip
        stored = _stored(s3, url)
        for r in (2, 3):
            assert c.codes[r] in (1, 9), (c.codes, logs[r][-3000:])
            assert c.codes[r] == 1 or 2 in stored, (r, stored, logs[r][-3000:])
        for r in (0, 1):
            assert res[r]["saved"] == [1, 2] and res[r]["failed_step"] == 3, res[r]
        assert 3 not in stored and 3 not in _steps(c.a) and 3 not in _steps(c.b)
        res, _ = c.run("restart", KILL_AFTER_FLUSH="1", **env)
        _resumed(res, 2)
