"""The peer replica of the memory tier (``memory=..., replicate=True``): 2 nodes x 2 ranks, real
processes (``test_node_memory.Cluster``: each node's disk and tmpfs directory bind-mounted in the
ranks' private mount namespaces). Rank r's buddy is the same-index rank of the other node
(0 <-> 2, 1 <-> 3), so node a's memory holds ranks 2 and 3's replicas and node b's ranks 0 and 1's.
A "replaced" node: its disk and its memory wiped, its processes started again. Needs root.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_node_memory import FROM_DISK, FROM_MEMORY, Cluster, _needs_root, _resumed, _steps

from asyncckpt import Checkpointer

FROM_PEER = "from its buddy's memory (the peer replica)"


@contextlib.contextmanager
def shm_dir() -> Iterator[Path]:
    """A test's own directory on /dev/shm (tmpfs): the nodes' memory directories live in it."""
    d = Path(tempfile.mkdtemp(prefix="asyncckpt-replica-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm() -> Iterator[Path]:
    with shm_dir() as d:
        yield d


def _wipe(*dirs: Path) -> None:
    for d in dirs:
        shutil.rmtree(d)
        d.mkdir()


def _replica(mem: Path, rank: int) -> Path:
    return mem / ".replicas" / f"peer-rank{rank:05d}"


def _all_saved(res: dict[int, dict[str, Any]], steps: list[int]) -> None:
    for got in res.values():
        assert got.get("init_error") is None and got["saved"] == steps and got.get("flush_error") is None, got


def saved(tmp_path: Path, shm: Path, steps: str, **env: str) -> Cluster:
    """Two nodes that saved ``steps`` with the replica, then were killed (no close)."""
    _needs_root()
    c = Cluster(tmp_path, shm)
    res, _ = c.run("first", STEPS=steps, KEEP_LAST="2", REPLICATE="1", KILL_AFTER_FLUSH="1", **env)
    _all_saved(res, [int(x) for x in steps.split(",")])
    return c


def flip(path: Path) -> None:
    """One byte of ``path`` flipped, the size kept: corruption only a CRC finds."""
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.needs_root
@pytest.mark.slow  # one run of 4 ranks
@pytest.mark.timeout(300)
def test_the_replicas_a_node_holds_count_toward_its_memory_budget(tmp_path: Path, shm: Path) -> None:
    # a node part is ~2.1 MiB (2 ranks x 1 MiB): two own steps fit a 5 MiB budget alone, not
    # with the two steps of replicas the node holds for the other node's ranks (keep 2): the
    # oldest own step goes (before: [2, 3] were kept, 8.4 MiB of tmpfs under a 5 MiB budget)
    c = saved(tmp_path, shm, "1,2,3", STATE_MB="1", MEMORY_KEEP_LAST="2", MEMORY_BUDGET=str(5 << 20))
    for mem, sources in ((c.ma, (2, 3)), (c.mb, (0, 1))):
        assert _steps(mem) == [3], mem
        assert all(_steps(_replica(mem, r)) == [2, 3] for r in sources)  # the replicas: memory_keep_last each


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(400)
def test_a_replaced_node_resumes_bit_exact_from_its_buddies_memory_without_a_store(tmp_path: Path, shm: Path) -> None:
    c = saved(tmp_path, shm, "1,2,3")
    # each rank's memory files of the newest step are on its buddy's node, byte for byte
    for mem, other, ranks in ((c.ma, c.mb, (2, 3)), (c.mb, c.ma, (0, 1))):
        for r in ranks:
            held = _replica(mem, r)
            assert _steps(held) == [3], r  # memory_keep_last=1: one replica kept per source
            names = {p.name for p in (held / "step_00000003").iterdir()}
            assert names == {".replica.json", "manifest.json", f"rank{r:05d}.safetensors", f"rank{r:05d}.json"}
            for n in names - {".replica.json"}:
                assert (held / "step_00000003" / n).read_bytes() == (other / "step_00000003" / n).read_bytes()
    # node b replaced: no disk, no memory; its ranks read their parts from node a's memory
    _wipe(c.b, c.mb)
    res, logs = c.run("replaced", STEPS="4", REPLICATE="1", KILL_AFTER_FLUSH="1")
    _resumed(res, 3)
    for r in (2, 3):
        assert f"loading step 3 {FROM_PEER}" in logs[r] and FROM_DISK not in logs[r], logs[r][-3000:]
    for r in (0, 1):
        assert f"loading step 3 {FROM_MEMORY}" in logs[r] and FROM_PEER not in logs[r]
    _all_saved(res, [4])  # and the job goes on: both tiers and the replicas hold the next step
    assert _steps(c.mb) == [4] and _steps(c.b) == [4] and _steps(c.ma) == [4]
    assert all(_steps(_replica(m, r)) == [4] for m, rs in ((c.ma, (2, 3)), (c.mb, (0, 1))) for r in rs)


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(400)
def test_a_corrupt_replica_without_a_store_fails_the_load_on_every_rank_and_loses_nothing(
    tmp_path: Path, shm: Path
) -> None:
    c = saved(tmp_path, shm, "1,2")
    _wipe(c.b, c.mb)
    flip(_replica(c.ma, 2) / "step_00000002" / "rank00002.safetensors")
    res, logs = c.run("corrupt", REPLICATE="1", CK_TIMEOUT="30")
    assert res[2]["load_error"]["type"] == "ReplicaCorruptError", res[2]
    assert "fails its CRC-32C" in res[2]["load_error"]["msg"]
    for r in (0, 1, 3):  # named on every rank; rank 3 read its own replica
        assert res[r]["load_error"]["type"] == "CheckpointError" and "rank(s) [2]" in res[r]["load_error"]["msg"]
    assert f"loading step 2 {FROM_PEER}" in logs[3]
    # never another step, nothing removed: node a still holds both steps, rank 3's replica is whole
    assert "loading step 1" not in "".join(logs)
    assert _steps(c.a) == [1, 2] and _steps(c.ma) == [2] and _steps(_replica(c.ma, 3)) == [2]


@pytest.mark.needs_root
@pytest.mark.slow  # three runs of 4 ranks
@pytest.mark.timeout(500)
def test_two_nodes_holding_each_others_replicas_lost_never_resume_a_mix_of_steps(tmp_path: Path, shm: Path) -> None:
    c = saved(tmp_path, shm, "1,2")
    # node b replaced and node a rebooted (its memory, with ranks 2 and 3's replicas, emptied):
    # node a's ranks still have their disk, node b's ranks nothing: no step for every rank
    _wipe(c.b, c.mb, c.ma)
    res, logs = c.run("lost", REPLICATE="1", KILL_AFTER_FLUSH="1")
    for r, got in res.items():
        assert got["load_error"]["type"] == "CheckpointNotFoundError", (r, got)
    assert "loading step" not in "".join(logs)
    assert _steps(c.a) == [1, 2]  # nothing removed from the disk that survived
    # both nodes replaced: nothing anywhere, the same refusal on every rank
    _wipe(c.a, c.ma)
    res, _ = c.run("both", REPLICATE="1", KILL_AFTER_FLUSH="1")
    for r, got in res.items():
        assert got["load_error"]["type"] == "CheckpointNotFoundError", (r, got)


@pytest.mark.needs_root
@pytest.mark.slow  # one run of 4 ranks: 15.6 s on the shared VM
@pytest.mark.timeout(200)
def test_replicate_on_one_node_is_refused_at_construction_on_every_rank(tmp_path: Path, shm: Path) -> None:
    _needs_root()
    c = Cluster(tmp_path, shm)
    same = {"NODE_NAMES": "a:a:a:a", "NODE_DIRS": ":".join([str(c.a)] * 4), "MEMORY_DIRS": ":".join([str(c.ma)] * 4)}
    res, _ = c.run("one-node", REPLICATE="1", **same)
    for r, got in res.items():
        assert got["init_error"]["type"] == "SingleNodeError", (r, got)
        assert "needs two nodes or more" in got["init_error"]["msg"]
    assert list(c.a.iterdir()) == [] and list(c.ma.iterdir()) == []  # refused before anything was made


@pytest.mark.parametrize(
    ("kw", "error", "words"),
    [
        ({"memory": "/dev/shm/x", "node_local": True, "replicate": 1}, TypeError, "replicate must be a bool"),
        ({"node_local": True, "replicate": True}, ValueError, "it needs memory=..."),
    ],
)
def test_bad_replicate_options_raise_typed_errors_at_the_call(
    tmp_path: Path, kw: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error) as e:
        Checkpointer(tmp_path / "ck", **kw)
    assert words in str(e.value)
    assert not (tmp_path / "ck").exists()
