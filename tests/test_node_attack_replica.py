"""Attacks on the peer replica (``replicate=True``) under a tight ``memory_budget`` and on a full
or tampered replica directory: 2 nodes x 2 ranks (``test_node_memory.Cluster``), ranks 0-1
node "a", 2-3 node "b"; rank r's buddy is the same-index rank of the other node. ``STATE_MB=1``:
a rank's part is ~1 MiB, a node's ~2.1 MiB, the replicas a node holds (two sources) ~2.1 MiB a
step kept. The memory tier may drop steps, never fail a save; a load reads one step and one
attempt, never a half-received or tampered replica. Needs root.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_node_memory import FROM_DISK, FROM_MEMORY, Cluster, _needs_root, _resumed, _steps, small_tmpfs
from test_node_replica import FROM_PEER, _all_saved, _replica, _wipe, flip, shm_dir

MIB = 1 << 20


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    _needs_root()
    with shm_dir() as shm:
        yield Cluster(tmp_path, shm)


def _bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file() and not p.name.startswith(".asyncckpt-owner"))


def _harm(held: Path, harm: str, other_manifest: Path) -> None:
    """Harm rank 2's replica ``held`` (a committed replica step directory) as ``harm`` says:
    ``truncated`` (its shard cut to half), ``flipped`` (one byte), ``manifest-of-another-step``
    (its manifest swapped for ``other_manifest``), ``record-lies`` (the shard and the record's
    size of it both cut by 8 bytes: only the CRCs can tell), ``half-received`` (renamed back to a
    receiving directory, as a push a kill interrupted before its rename leaves it)."""
    shard = held / "rank00002.safetensors"
    if harm == "half-received":  # whole bytes, but a push never renamed: only a committed replica is read
        held.rename(held.parent / f".incoming-{held.name}-0123456789ab")
    elif harm == "flipped":
        flip(shard)
    elif harm == "manifest-of-another-step":
        (held / "manifest.json").write_bytes(other_manifest.read_bytes())
    else:
        cut = shard.stat().st_size // 2 if harm == "truncated" else 8
        if harm == "record-lies":
            rec = json.loads((held / ".replica.json").read_text())
            for e in rec["files"]:  # [name, size, crc]
                if e[0] == shard.name:
                    e[1] -= cut
            (held / ".replica.json").write_text(json.dumps(rec))
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - cut)


def _saved_then_harmed(c: Cluster, harm: str) -> None:
    """Steps 1 and 2 saved with the replica (then every process killed), then rank 2's replica
    of step 2 on node a harmed (:func:`_harm`)."""
    res, _ = c.run("first", STEPS="1,2", KEEP_LAST="2", REPLICATE="1", KILL_AFTER_FLUSH="1", STATE_MB="1")
    _all_saved(res, [1, 2])
    _harm(_replica(c.ma, 2) / "step_00000002", harm, c.b / "step_00000001" / "manifest.json")


def _replaced_resumes(c: Cluster, step: int, **env: str) -> None:
    """Node b replaced (its disk and memory wiped), the job restarted: every rank resumes
    ``step`` bit-exact, node b's ranks from their buddies' memory, node a's from their own."""
    _wipe(c.b, c.mb)
    res, logs = c.run("replaced", KILL_AFTER_FLUSH="1", REPLICATE="1", STATE_MB="1", **env)
    _resumed(res, step)
    for r, where in ((2, FROM_PEER), (3, FROM_PEER), (0, FROM_MEMORY), (1, FROM_MEMORY)):
        assert f"loading step {step} {where}" in logs[r], logs[r][-3000:]


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("keep", "budget"),
    [(1, 7 * MIB), (1, 3 * MIB), (2, 7 * MIB), (2, 3 * MIB)],
    ids=["keep1-own+replica+spare", "keep1-less", "keep2-own+replicas", "keep2-less"],
)
def test_a_tight_budget_with_the_replica_commits_every_save_and_a_replaced_node_resumes_the_newest_step(
    cluster: Cluster, keep: int, budget: int
) -> None:
    c = cluster
    res, _ = c.run("tight", STEPS="1,2,3,4", KEEP_LAST="2", REPLICATE="1", KILL_AFTER_FLUSH="1", STATE_MB="1",
                      MEMORY_KEEP_LAST=str(keep), MEMORY_BUDGET=str(budget))  # fmt: skip
    _all_saved(res, [1, 2, 3, 4])  # the memory tier drops steps, never a save
    for mem, sources in ((c.ma, (2, 3)), (c.mb, (0, 1))):
        assert _steps(mem)[-1:] == [4], mem  # the newest own step stays whatever the budget
        for r in sources:
            assert _steps(_replica(mem, r))[-1:] == [4], (mem, r)  # and so does each source's newest replica
        own = sum(_bytes(mem / f"step_{s:08d}") for s in _steps(mem))
        assert len(_steps(mem)) == 1 or own + _bytes(mem / ".replicas") <= budget, (mem, _steps(mem), own)
    _replaced_resumes(c, 4, MEMORY_KEEP_LAST=str(keep), MEMORY_BUDGET=str(budget))


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(400)
def test_a_budget_below_one_part_keeps_no_memory_and_no_replica_and_a_replaced_node_fails_alike(
    cluster: Cluster,
) -> None:
    # 1 MiB: less than a node's part (~2.1 MiB): no step in memory, so no replica either
    c = cluster
    res, _ = c.run("none", STEPS="1,2", KEEP_LAST="2", REPLICATE="1", KILL_AFTER_FLUSH="1", STATE_MB="1",
                      MEMORY_BUDGET=str(MIB))  # fmt: skip
    _all_saved(res, [1, 2])
    assert _steps(c.ma) == [] and _steps(c.mb) == []
    _wipe(c.b, c.mb)
    res, _ = c.run("replaced", REPLICATE="1", STATE_MB="1", MEMORY_BUDGET=str(MIB), CK_TIMEOUT="30")
    for r, got in res.items():
        assert got["load_error"]["type"] == "CheckpointNotFoundError", (r, got)
    assert _steps(c.a) == [1, 2]  # nothing removed from the disk that survived


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(400)
def test_a_full_tmpfs_on_one_node_while_replicas_are_pushed_commits_every_save_and_resumes_one_step(
    cluster: Cluster,
) -> None:
    # node a's memory: 3 MiB of tmpfs, room for its own part (~2.1 MiB) but not for node b's
    # replicas on top (~2.1 MiB more): the pushes to node a hit ENOSPC, the saves commit
    c = cluster
    with small_tmpfs(c.ma, "3m"):
        res, logs = c.run("full", STEPS="1,2,3", KEEP_LAST="2", REPLICATE="1", KILL_AFTER_FLUSH="1", STATE_MB="1")
        _all_saved(res, [1, 2, 3])
        assert "No space left on device" in "".join(logs), logs[0][-3000:]
        assert not [p for p in (c.ma / ".replicas").rglob("*") if p.name.startswith(".incoming-")]
        # node b rebooted (its memory gone): ranks 2-3 have no whole replica on node a, their disk has step 3
        _wipe(c.mb)
        res, logs = c.run("rebooted", KILL_AFTER_FLUSH="1", REPLICATE="1", STATE_MB="1")
        _resumed(res, 3)
        for r in (2, 3):
            assert f"loading step 3 {FROM_DISK}" in logs[r] or f"loading step 3 {FROM_PEER}" in logs[r], logs[r]


@pytest.mark.needs_root
@pytest.mark.slow  # three runs of 4 ranks
@pytest.mark.timeout(500)
@pytest.mark.parametrize("harm", ["truncated", "flipped", "manifest-of-another-step"])
def test_a_replica_harmed_between_saves_then_a_rebooted_node_reads_the_same_step_from_its_disk(
    cluster: Cluster, harm: str
) -> None:
    c = cluster
    _saved_then_harmed(c, harm)
    # the job restarted (every process) and goes on: the harmed replica is the spare/recycled one
    res, _ = c.run("again", STEPS="3", KEEP_LAST="2", REPLICATE="1", KILL_AFTER_FLUSH="1", STATE_MB="1")
    _resumed(res, 2)
    _all_saved(res, [3])
    # node b rebooted: its memory gone; rank 2 reads step 3 from node a's replica or its disk, never a mix
    _wipe(c.mb)
    res, _ = c.run("rebooted", KILL_AFTER_FLUSH="1", REPLICATE="1", STATE_MB="1")
    _resumed(res, 3)
    _replaced_resumes(c, 3)  # and node b replaced too: the replica of step 3 is whole (received after the harm)


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(400)
@pytest.mark.parametrize("harm", ["truncated", "flipped", "record-lies", "half-received"])
def test_a_harmed_replica_of_the_agreed_step_on_a_rebooted_node_falls_back_to_its_disk(
    cluster: Cluster, harm: str
) -> None:
    # node b rebooted (memory gone, disk kept) and rank 2's replica on node a harmed: rank 2 must
    # read the same step and attempt from node b's disk (memory, buddy, disk: the next tier)
    c = cluster
    _saved_then_harmed(c, harm)
    _wipe(c.mb)
    res, logs = c.run("rebooted", KILL_AFTER_FLUSH="1", REPLICATE="1", STATE_MB="1")
    _resumed(res, 2)
    assert f"loading step 2 {FROM_DISK}" in logs[2], logs[2][-3000:]
    assert f"loading step 2 {FROM_PEER}" in logs[3], logs[3][-3000:]
