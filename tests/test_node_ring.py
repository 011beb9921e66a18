"""The peer replica on a ring of four nodes (``memory=..., replicate=True``): 4 nodes x 1 rank,
real processes (``test_node_memory.Cluster`` with a node layout of its own). Rank r is node r's
only rank; its buddy is node r+1's (mod 4), so node k's memory holds node k-1's replica. A
"replaced" node: its disk and its memory wiped, its process started again. Needs root.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_node_memory import FROM_MEMORY, Cluster, _needs_root, _resumed, _steps
from test_node_replica import FROM_PEER, _all_saved, _replica, _wipe, shm_dir

NODES = 4


class Ring:
    """Four simulated nodes of one rank each: disks ``disk[k]``, memory ``mem[k]`` (on /dev/shm)."""

    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.disk = [c.tmp / f"disk{k}" for k in range(NODES)]
        self.mem = [c.shm / f"mem{k}" for k in range(NODES)]
        for d in (*self.disk, *self.mem):
            d.mkdir()

    def run(self, tag: str, **env: str) -> tuple[dict[int, dict[str, Any]], list[str]]:
        """The four ranks, each on its own node, with the replica and 2 steps kept on disk."""
        layout = {"NODE_NAMES": ":".join(f"n{k}" for k in range(NODES)), "NODE_DIRS": ":".join(map(str, self.disk)),
                  "MEMORY_DIRS": ":".join(map(str, self.mem))}  # fmt: skip
        return self.c.run(tag, REPLICATE="1", KEEP_LAST="2", **layout, **env)


@pytest.fixture
def ring(tmp_path: Path) -> Iterator[Ring]:
    """Four nodes that saved steps 1 and 2 with the replica, then were killed (no close)."""
    _needs_root()
    with shm_dir() as shm:
        r = Ring(Cluster(tmp_path, shm))
        res, _ = r.run("first", STEPS="1,2", KILL_AFTER_FLUSH="1")
        _all_saved(res, [1, 2])
        yield r


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(400)
def test_on_a_ring_of_four_a_replaced_node_resumes_from_its_buddy_and_the_ring_refills(ring: Ring) -> None:
    # each rank's newest step is in its buddy's memory (the next node on the ring) and nowhere else's
    for r in range(NODES):
        for k in range(NODES):
            held = _replica(ring.mem[k], r)
            assert (_steps(held) == [2]) if k == (r + 1) % NODES else not held.exists(), (r, k)
    _wipe(ring.disk[1], ring.mem[1])  # node 1 replaced
    res, logs = ring.run("replaced", STEPS="3", KILL_AFTER_FLUSH="1")
    _resumed(res, 2)
    assert f"loading step 2 {FROM_PEER}" in logs[1], logs[1][-3000:]
    for r in (0, 2, 3):
        assert f"loading step 2 {FROM_MEMORY}" in logs[r] and FROM_PEER not in logs[r], logs[r][-3000:]
    _all_saved(res, [3])  # the job goes on: the replaced node holds its part and node 0's replica again
    assert _steps(ring.disk[1]) == [3] and _steps(ring.mem[1]) == [3]
    assert all(_steps(_replica(ring.mem[(r + 1) % NODES], r)) == [3] for r in range(NODES))


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(400)
def test_on_a_ring_of_four_two_neighbours_lost_fail_every_rank_alike_and_remove_nothing(ring: Ring) -> None:
    # nodes 1 and 2 replaced: rank 1's replica was on node 2, so no tier holds rank 1's part
    # (rank 2's is still on node 3): no step is complete for every rank, the same refusal on
    # every rank, never an older step, nothing removed from the nodes that survived
    _wipe(ring.disk[1], ring.mem[1], ring.disk[2], ring.mem[2])
    res, logs = ring.run("lost", CK_TIMEOUT="30")
    for r, got in res.items():
        assert (got.get("load_error") or {}).get("type") == "CheckpointNotFoundError", (r, got)
    assert "loading step" not in "".join(logs)
    assert _steps(ring.disk[0]) == [1, 2] and _steps(ring.disk[3]) == [1, 2]
    assert _steps(_replica(ring.mem[3], 2)) == [2] and _steps(_replica(ring.mem[0], 3)) == [2]
