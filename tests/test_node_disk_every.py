"""The disk tier's frequency (``disk_every=n``): every n-th save goes to the node disks, every
other one commits to the memory tier only. 2 nodes x 2 ranks, real processes
(``test_node_memory.Cluster``: each node's disk and tmpfs directory bind-mounted in the ranks'
private mount namespaces). Needs root for the cluster tests.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from test_node_memory import FROM_DISK, FROM_MEMORY, Cluster, _files, _needs_root, _resumed, _steps, small_tmpfs
from test_node_replica import FROM_PEER, _all_saved, _replica, _wipe, shm_dir

from asyncckpt import Checkpointer
from asyncckpt.saving._memtier import make_room


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Cluster]:
    """Two simulated nodes (``test_node_memory.Cluster``), their memory in a directory of this
    test's own on /dev/shm (needs root: mount namespaces)."""
    _needs_root()
    with shm_dir() as shm:
        yield Cluster(tmp_path, shm)


@pytest.mark.needs_root
@pytest.mark.slow  # four runs of 4 ranks
@pytest.mark.timeout(600)
def test_disk_every_3_the_disks_hold_1_and_4_and_a_restart_resumes_5_from_memory(nodes: Cluster) -> None:
    c = nodes
    res, _ = c.save("first", [1, 2, 3, 4, 5], DISK_EVERY="3", MEMORY_KEEP_LAST="2", KILL_AFTER_FLUSH="1")
    assert _steps(c.a) == [1, 4] and _steps(c.b) == [1, 4]  # the 1st and the 4th save
    assert _steps(c.ma) == [4, 5] and _steps(c.mb) == [4, 5]  # the newest 2, whichever tier took them
    assert _files(c.ma, 5) == {"manifest.json", "rank00000.safetensors", "rank00000.json",
                               "rank00001.safetensors", "rank00001.json"}  # fmt: skip
    # each save's result names where it is durable: the disks, or the memory tier only
    for r, got in res.items():
        assert [t for t, _ in got["tiers"]] == ["local", "memory", "memory", "local", "memory"], (r, got)
        assert got["tiers"][1][1].endswith("/mem/step_00000002"), got["tiers"]
        assert got["tiers"][3][1].endswith("/ck/step_00000004"), got["tiers"]
    # every process killed: the restart resumes step 5 from each node's memory, bit-exact
    res, logs = c.run("restart", KILL_AFTER_FLUSH="1")
    _resumed(res, 5)
    for r in range(4):
        assert f"loading step 5 {FROM_MEMORY}" in logs[r], logs[r][-3000:]
    # node b rebooted (its memory empty): step 5 is on node a's memory alone, so every rank
    # resumes step 4 (node a's ranks from their memory, which keeps it too): never a mix
    _wipe(c.mb)
    res, logs = c.run("b-rebooted", KILL_AFTER_FLUSH="1")
    _resumed(res, 4)
    for r in range(4):
        assert f"loading step 4 {FROM_MEMORY if r < 2 else FROM_DISK}" in logs[r], logs[r][-3000:]
    # every node's memory wiped: step 4 from the disks
    _wipe(c.ma, c.mb)
    res, logs = c.run("rebooted", KILL_AFTER_FLUSH="1")
    _resumed(res, 4)
    for r in range(4):
        assert f"loading step 4 {FROM_DISK}" in logs[r], logs[r][-3000:]


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(600)
def test_with_replicate_a_replaced_node_resumes_a_memory_only_step_from_its_buddy(nodes: Cluster) -> None:
    c = nodes
    res, _ = c.run("first", STEPS="1,2", DISK_EVERY="2", REPLICATE="1", KILL_AFTER_FLUSH="1")
    _all_saved(res, [1, 2])
    assert _steps(c.a) == [1] and _steps(c.ma) == [2]
    for mem, ranks in ((c.ma, (2, 3)), (c.mb, (0, 1))):  # the memory-only step was pushed to the buddies
        for r in ranks:
            assert _steps(_replica(mem, r)) == [2], (r, list(_replica(mem, r).parent.iterdir()))
    _wipe(c.b, c.mb)  # node b replaced: its disk and its memory gone
    res, logs = c.run("replaced", REPLICATE="1", KILL_AFTER_FLUSH="1")
    _resumed(res, 2)
    for r in (2, 3):
        assert f"loading step 2 {FROM_PEER}" in logs[r], logs[r][-3000:]
    for r in (0, 1):
        assert f"loading step 2 {FROM_MEMORY}" in logs[r], logs[r][-3000:]


@pytest.mark.needs_root
@pytest.mark.slow  # one run of 4 ranks
@pytest.mark.timeout(300)
def test_a_memory_only_save_that_fails_on_one_node_fails_on_every_rank_and_the_next_save_works(
    nodes: Cluster,
) -> None:
    with small_tmpfs(nodes.mb):  # node b's memory too small for its part (~33 KB): a real ENOSPC
        res, _ = nodes.run("full", STEPS="1,2,3", DISK_EVERY="2", GO_ON="1", CK_TIMEOUT="20")
    c = nodes
    for r, got in res.items():
        assert got.get("init_error") is None and got["saved"] == [1, 3], (r, got)
        (err,) = got["save_errors"]
        assert err["step"] == 2 and err["type"] == "SaveError" and err["s"] < 20, (r, err)
        assert "No space left on device" in err["msg"] or any(
            "No space left" in f["message"] for f in err.get("failures", {}).values()
        ), (r, err)
        flushed = got.get("flush_error") or {}  # flush() reports the failures since the last flush: step 2's
        assert "save of step 2 failed" in flushed.get("msg", ""), (r, flushed)
    assert _steps(c.a) == [1, 3] and _steps(c.b) == [1, 3]
    assert _steps(c.ma) == [3]  # node a: the failed step 2 was taken back
    assert not [p for p in c.ma.iterdir() if ".tmp-" in p.name]


@pytest.mark.needs_root
@pytest.mark.slow  # one run of 4 ranks
@pytest.mark.timeout(300)
def test_a_step_committed_in_memory_only_is_not_saved_again(nodes: Cluster) -> None:
    # the step rule asks rank 0's disk which committed steps are still resumable: a memory-only
    # step is not there, and was taken for gone (a second save of it committed on the disks,
    # another attempt of the same step beside the memory one)
    res, _ = nodes.run("twice", STEPS="1,2,2,3", DISK_EVERY="2", GO_ON="1")
    for r, got in res.items():
        assert got["saved"] == [1, 2, 3], (r, got.get("save_errors"), got.get("save_error"), _log_tail(nodes, "twice"))
        (err,) = got["save_errors"]
        assert err["step"] == 2 and err["type"] == "ValueError" and "already committed" in err["msg"], (r, err)
    assert _steps(nodes.a) == [1, 3] and _steps(nodes.ma) == [3]


@pytest.mark.needs_root
@pytest.mark.slow  # three runs of 4 ranks
@pytest.mark.timeout(400)
def test_disk_retention_at_a_restart_counts_only_the_steps_on_every_disk(nodes: Cluster) -> None:
    # step 2 is in memory only; the restart's first save (3, to the disks, keep_last=1) fails on
    # rank 0's node after node b committed it. Had node b's retention counted step 2 as a step
    # every node holds, it would have removed step 1, the last step on every disk
    c = nodes
    c.save("first", [1, 2], DISK_EVERY="2", KEEP_LAST="1", KILL_AFTER_FLUSH="1")
    assert _steps(c.a) == [1] and _steps(c.ma) == [2]
    res, _ = c.run("failed", STEPS="3", DISK_EVERY="2", KEEP_LAST="1", FAIL_RENAME_RANK="0", FAIL_RENAME_STEP="3")
    for r, got in res.items():
        assert got["loaded"] == 2 and (got.get("save_error") or {}).get("type") == "SaveError", (r, got)
    assert _steps(c.a) == [1] and 1 in _steps(c.b)
    _wipe(c.ma, c.mb)  # both nodes rebooted: the disks alone
    res, _ = c.run("rebooted", KILL_AFTER_FLUSH="1")
    _resumed(res, 1)


@pytest.mark.parametrize(
    ("kw", "error", "words"),
    [
        ({"node_local": True, "disk_every": 2}, ValueError, "it needs memory="),
        ({"disk_every": 2}, ValueError, "node-local roots"),
        ({"memory": "/dev/shm/x", "node_local": True, "disk_every": 0}, ValueError, "at least 1"),
        ({"memory": "/dev/shm/x", "node_local": True, "disk_every": 2.0}, TypeError, "must be an int"),
        ({"memory": "/dev/shm/x", "node_local": True, "disk_every": True}, TypeError, "must be an int"),
        ({"memory": "/dev/shm/x", "node_local": True, "disk_every": 3, "memory_every": 2}, ValueError,
         "needs memory_every=1"),
        # by time (a datetime.timedelta: tests/test_every_time.py)
        ({"memory": "/dev/shm/x", "node_local": True, "disk_every": timedelta(0)}, ValueError, "positive timedelta"),
        ({"memory": "/dev/shm/x", "node_local": True, "disk_every": timedelta(seconds=-1)}, ValueError,
         "positive timedelta"),
        ({"memory": "/dev/shm/x", "node_local": True, "memory_every": timedelta(0)}, ValueError, "positive timedelta"),
        ({"mirror": "s3://b/p", "mirror_every": timedelta(microseconds=-5)}, ValueError, "positive timedelta"),
        ({"mirror": "s3://b/p", "mirror_every": 0.5}, TypeError, "or a datetime.timedelta"),
        ({"mirror": "s3://b/p", "mirror_every": "60s"}, TypeError, "or a datetime.timedelta"),
        ({"memory": "/dev/shm/x", "node_local": True, "disk_every": 1.5}, TypeError, "or a datetime.timedelta"),
        ({"node_local": True, "disk_every": timedelta(seconds=1)}, ValueError, "it needs memory="),
        ({"disk_every": timedelta(seconds=1)}, ValueError, "node-local roots"),
        ({"mirror_every": timedelta(seconds=1)}, ValueError, "(mirror=...), which is not set"),
        ({"memory": "/dev/shm/x", "node_local": True, "disk_every": timedelta(seconds=1), "memory_every": 2},
         ValueError, "needs memory_every=1"),
        ({"memory": "/dev/shm/x", "node_local": True, "disk_every": 2, "memory_every": timedelta(seconds=1)},
         ValueError, "needs memory_every=1"),
    ],
)  # fmt: skip
def test_bad_frequencies_raise_typed_errors_at_the_constructor(
    tmp_path: Path, kw: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error) as e:
        Checkpointer(tmp_path / "ck", **kw)
    assert words in str(e.value)
    assert not (tmp_path / "ck").exists()  # nothing made


def test_memory_retention_never_removes_a_step_above_the_one_its_round_committed(tmp_path: Path) -> None:
    """A save not due for the disks commits into the memory tier itself, so a newer step may be
    there before the previous step's round makes room: that round removes older steps only."""
    import torch

    with Checkpointer(tmp_path / "ck") as ck:
        for s in (4, 5, 6):
            ck.save(s, {"w": torch.full((64,), float(s))})
    mem = tmp_path / "mem"
    mem.mkdir()
    for s in (4, 5, 6):
        shutil.copytree(tmp_path / "ck" / f"step_{s:08d}", mem / f"step_{s:08d}")
    assert make_room(str(mem), (0,), 1, None, 5) == [4]  # step 5's round, step 6 committed already
    assert _steps(mem) == [5, 6]
    assert make_room(str(mem), (0,), 1, None, 6) == [5]
    assert _steps(mem) == [6]


def _log_tail(c: Cluster, tag: str) -> str:
    """The end of each rank's log of run ``tag`` (for an assertion's message)."""
    return "\n".join((c.tmp / tag / f"rank{r}.log").read_text(errors="replace")[-1500:] for r in range(4))
