"""The peer replica (``asyncckpt.roots.replica``): buddies from nodes, the held replicas' commit
discipline in one process, and push/fetch between real gloo processes on 2 and 4 simulated
nodes (``ASYNCCKPT_NODE``; each node keeps its replicas in a directory of its own)."""

from __future__ import annotations

import ctypes
import errno
import gc
import json
import mmap
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from _ranks import free_port, log_tail, run_ranks
from _replica_worker import digest, files_for

from asyncckpt.format._checksum import crc32c
from asyncckpt.ranks._nodes import Nodes
from asyncckpt.roots.posix import _fileio
from asyncckpt.roots.replica import DIRECTORY, buddy_of, holdings, lost_with, sources_of
from asyncckpt.roots.replica._held import Entry, HeldReplicas, NotHeld, Record, check_name
from asyncckpt.roots.replica._wire import CHUNK

WORKER = str(Path(__file__).parent / "support" / "_replica_worker.py")


# ------------------------------------------------------------------------------------ buddies
def test_every_buddy_is_on_another_node_and_every_rank_has_one() -> None:
    for nodes in (
        Nodes.group(["a", "a", "b", "b"]),
        Nodes.group(["a", "b", "c", "d"]),
        Nodes.group(["a", "b", "a", "b", "c", "c"]),
        Nodes.group(["a", "a", "a", "b"]),  # uneven: rank 3 holds three replicas
    ):
        world = sum(len(m) for m in nodes.members)
        for r in range(world):
            b = buddy_of(nodes, r)
            assert b is not None and nodes.node_of(b) != nodes.node_of(r), (nodes, r)
        held = sorted(s for r in range(world) for s in sources_of(nodes, r))
        assert held == list(range(world))  # every rank's replica is held exactly once
    two = Nodes.group(["a", "a", "b", "b"])
    assert [buddy_of(two, r) for r in range(4)] == [2, 3, 0, 1]
    assert sources_of(Nodes.group(["a", "a", "a", "b"]), 3) == (0, 1, 2)
    assert buddy_of(Nodes.single(4), 2) is None and sources_of(Nodes.single(4), 2) == ()


def test_one_node_lost_loses_nothing_two_neighbours_lose_the_first() -> None:
    four = Nodes.group(["a", "a", "b", "b", "c", "c", "d", "d"])
    for k in range(4):
        assert lost_with(four, {k}) == ()
    assert lost_with(four, {0, 2}) == ()  # not neighbours in the ring
    assert lost_with(four, {1, 2}) == (2, 3)  # node 1's parts were on node 2
    assert lost_with(Nodes.group(["a", "b"]), {0, 1}) == (0, 1)


# ------------------------------------------------------------------------------- held replicas
def _record(source: int, step: int, attempt: str, files: dict[str, bytes]) -> tuple[Record, memoryview]:
    entries = tuple(Entry(n, len(b), crc32c(b)) for n, b in files.items())
    return Record(source, step, attempt, entries), memoryview(b"".join(files.values()))


def test_a_held_replica_reads_back_exact_and_the_newest_k_are_kept(tmp_path: Path) -> None:
    held = HeldReplicas(str(tmp_path), keep=2)
    for step in (1, 2, 3):
        held.commit(*_record(5, step, "a", {"x": bytes([step]) * 1000, "y": b"", "z": b"zz"}))
    assert held.steps(5) == [2, 3]
    rec = held.find(5, 3, "a")
    assert [bytes(v) for v in held.map(rec)] == [b"\x03" * 1000, b"", b"zz"]
    assert held.held(5, 2, "a") and not held.held(5, 1, "a") and not held.held(4, 3, "a")
    with pytest.raises(NotHeld, match="no replica") as e:
        held.find(5, 1, "a")
    assert e.value.kind == "missing"
    assert sorted(os.listdir(tmp_path / "peer-rank00005")) == ["step_00000002", "step_00000003"]


def test_a_new_replica_reuses_the_oldest_ones_memory_and_holds_only_its_own_files(tmp_path: Path) -> None:
    held = HeldReplicas(str(tmp_path), keep=2)
    held.commit(*_record(0, 1, "a", {"x": b"1" * 4096, "old": b"gone", "y": b"short"}))
    old_x = os.stat(tmp_path / "peer-rank00000" / "step_00000001" / "x").st_ino
    held.commit(*_record(0, 2, "a", {"x": b"2" * 4096}))
    held.commit(*_record(0, 3, "a", {"x": b"3" * 4096, "y": b"longer now", "new": b"n"}))
    step3 = tmp_path / "peer-rank00000" / "step_00000003"
    assert held.steps(0) == [2, 3] and sorted(os.listdir(step3)) == [".replica.json", "new", "x", "y"]
    assert os.stat(step3 / "x").st_ino == old_x  # step 1's file, received into again
    assert [bytes(v) for v in held.map(held.find(0, 3, "a"))] == [b"3" * 4096, b"longer now", b"n"]
    # a replica that fails on arrival takes the recycled step with it; the newer one stays
    incoming = held.receive(_record(0, 4, "a", {"x": b"4" * 4096})[0])
    incoming.views[0][:] = b"5" * 4096
    with pytest.raises(NotHeld, match="fails its CRC-32C"):
        incoming.commit()
    incoming.abort()
    assert held.steps(0) == [3] and os.listdir(tmp_path / "peer-rank00000") == ["step_00000003"]
    one = HeldReplicas(str(tmp_path / "one"), keep=1)  # keep 1: the one held stays until the next commits
    one.commit(*_record(0, 1, "a", {"x": b"1"}))
    one.receive(_record(0, 2, "a", {"x": b"2"})[0]).abort()
    assert one.held(0, 1, "a")


def _mapped_files(under: Path) -> list[str]:
    """The files under ``under`` this process maps now (deleted ones too: their memory is held)."""
    with open("/proc/self/maps") as f:
        return [line.split(None, 5)[5].strip() for line in f if str(under) in line]


def test_a_recycled_replica_is_received_into_its_kept_mapping_and_a_retired_one_is_unmapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steady state (one attempt a step, keep 2): the oldest step's files are received into
    through the mappings its commit kept (faulted in already: no mmap, no populate: ~17 ms a
    64 MiB file on a VM); the mappings of a retired, replaced or failed step are closed (a
    mapping of a removed file would hold its memory)."""
    from asyncckpt.roots.replica import _held

    held = HeldReplicas(str(tmp_path), keep=2)
    for step in (1, 2):
        held.commit(*_record(0, step, "a", {"x": bytes([step]) * 8192, "y": b"y" * 4096}))
    made: list[int] = []

    def counting(fd: int, size: int, **kw: Any) -> mmap.mmap:
        made.append(size)
        return mmap.mmap(fd, size, **kw)

    monkeypatch.setattr(_held, "mmap", SimpleNamespace(mmap=counting, ACCESS_WRITE=mmap.ACCESS_WRITE,
                                                       ACCESS_COPY=mmap.ACCESS_COPY))  # fmt: skip
    for step in (3, 4, 5):  # each recycles the oldest: x and y, same sizes
        held.commit(*_record(0, step, "a", {"x": bytes([step]) * 8192, "y": b"y" * 4096}))
        assert bytes(held.map(held.find(0, step, "a"))[0]) == bytes([step]) * 8192
    assert made == [8192, 4096] * 3  # held.map's own (copy-on-write) mappings only: none to receive into
    made.clear()
    held.commit(*_record(0, 6, "a", {"x": b"6" * 100}))  # x changed size, y gone: one new mapping
    assert made == [100] and held.steps(0) == [5, 6]
    monkeypatch.undo()
    gc.collect()
    mapped = _mapped_files(tmp_path)
    assert mapped and all("(deleted)" not in m and ("step_00000005" in m or "step_00000006" in m) for m in mapped)
    held.commit(*_record(0, 6, "b", {"x": b"7" * 100}))  # the same step again: the replaced one unmapped
    incoming = held.receive(_record(0, 7, "b", {"x": b"8" * 100})[0])  # recycles step 5, then fails
    incoming.views[0][:] = b"9" * 100
    with pytest.raises(NotHeld):
        incoming.commit()
    incoming.abort()
    gc.collect()
    assert [m for m in _mapped_files(tmp_path) if "(deleted)" in m] == []
    held.close()
    assert _mapped_files(tmp_path) == []


def test_with_keep_1_the_retired_step_is_a_hidden_spare_the_next_replica_is_received_into(tmp_path: Path) -> None:
    """keep 1 (``memory_keep_last``'s default): the step held stays visible until the next one is
    committed, then its files are kept hidden as the source's spare and the next replica lands in
    them (no new pages to fault and zero, no pages to free: a push's peak memory, held between
    pushes); a spare is never a step, and the next start removes it."""
    held = HeldReplicas(str(tmp_path), keep=1)
    src = tmp_path / "peer-rank00000"
    held.commit(*_record(0, 1, "a", {"x": b"1" * 8192}))
    first = os.stat(src / "step_00000001" / "x").st_ino
    held.commit(*_record(0, 2, "a", {"x": b"2" * 8192}))
    spares = [n for n in os.listdir(src) if n.startswith(".spare-")]
    assert held.steps(0) == [2] and len(spares) == 1 and os.listdir(src / spares[0]) == ["x"]
    assert not held.held(0, 1, "a") and held.attempts(0) == {2: "a"}
    held.commit(*_record(0, 3, "a", {"x": b"3" * 8192}))
    assert os.stat(src / "step_00000003" / "x").st_ino == first  # step 1's memory, received into again
    assert bytes(held.map(held.find(0, 3, "a"))[0]) == b"3" * 8192
    assert held.steps(0) == [3] and len([n for n in os.listdir(src) if n.startswith(".spare-")]) == 1
    held.close()
    HeldReplicas(str(tmp_path), keep=1).clean([0])  # the next start: the spare is not a replica
    assert os.listdir(src) == ["step_00000003"]


def test_another_attempts_replica_is_never_returned(tmp_path: Path) -> None:
    held = HeldReplicas(str(tmp_path), keep=2)
    held.commit(*_record(1, 7, "run1/a", {"x": b"old"}))
    assert not held.held(1, 7, "run2/a")
    with pytest.raises(NotHeld, match="of attempt 'run1/a'") as e:
        held.find(1, 7, "run2/a")
    assert e.value.kind == "missing"
    held.commit(*_record(1, 7, "run2/a", {"x": b"new"}))  # the same step again: replaced whole
    assert held.held(1, 7, "run2/a") and not held.held(1, 7, "run1/a")
    assert os.listdir(tmp_path / "peer-rank00001") == ["step_00000007"]


def test_a_corrupt_replica_is_refused_on_read_and_on_arrival(tmp_path: Path) -> None:
    held = HeldReplicas(str(tmp_path), keep=2)
    rec, payload = _record(2, 4, "a", {"x": b"abcdef" * 100})
    held.commit(rec, payload)
    p = tmp_path / "peer-rank00002" / "step_00000004" / "x"
    raw = bytearray(p.read_bytes())
    raw[10] ^= 1
    p.write_bytes(raw)
    with pytest.raises(NotHeld, match="fails its CRC-32C") as e:
        held.map(held.find(2, 4, "a"))
    assert e.value.kind == "corrupt"
    p.write_bytes(raw[:-1])  # cut short: seen without reading it
    with pytest.raises(NotHeld, match="599 bytes, not 600"):
        held.find(2, 4, "a")
    bad = bytearray(payload)
    bad[0] ^= 1
    with pytest.raises(NotHeld, match="fails its CRC-32C"):
        held.commit(rec, memoryview(bytes(bad)))
    assert held.steps(2) == [4] and not [n for n in os.listdir(tmp_path / "peer-rank00002") if n.startswith(".")]


def test_a_half_received_replica_is_never_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldReplicas(str(tmp_path), keep=2)
    held.commit(*_record(3, 1, "a", {"x": b"one"}))
    real = _fileio._FALLOCATE
    calls = {"n": 0}

    def full_disk(fd: int, mode: int, offset: int, size: int) -> int:  # the OS call: a tmpfs over its size
        calls["n"] += 1
        if calls["n"] == 2:  # the second file does not fit
            ctypes.set_errno(errno.ENOSPC)
            return -1
        return int(real(fd, mode, offset, size))

    monkeypatch.setattr(_fileio, "_FALLOCATE", full_disk)
    with pytest.raises(OSError, match="No space"):
        held.commit(*_record(3, 2, "a", {"x": b"two", "y": b"more"}))
    monkeypatch.undo()
    assert held.steps(3) == [1] and not held.held(3, 2, "a")
    assert os.listdir(tmp_path / "peer-rank00003") == ["step_00000001"]  # the attempt directory is gone
    # what a killed receiver leaves (an attempt directory with some files) is invisible, then cleaned
    crashed = tmp_path / "peer-rank00003" / ".incoming-step_00000002-123"
    crashed.mkdir()
    (crashed / "x").write_bytes(b"tw")
    assert held.steps(3) == [1] and not held.held(3, 2, "a")
    HeldReplicas(str(tmp_path), keep=2).clean([3])
    assert os.listdir(tmp_path / "peer-rank00003") == ["step_00000001"]


def test_names_a_replica_cannot_hold_are_refused(tmp_path: Path) -> None:
    for bad in ("", ".replica.json", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="plain, visible name"):
            check_name(bad)
    with pytest.raises(ValueError, match="keep must be at least 1"):
        HeldReplicas(str(tmp_path), keep=0)


# ------------------------------------------------------------------------------ real processes
def _run(tmp_path: Path, tag: str, names: list[str], deadline: float = 120, **env: str) -> dict[int, dict[str, Any]]:
    base, out, logs = tmp_path / "nodes", tmp_path / f"{tag}-result", tmp_path / tag
    base.mkdir(exist_ok=True)
    logs.mkdir()
    port, world = free_port(), len(names)
    hung = run_ranks(
        lambda r: [WORKER, str(r), str(world), str(port), str(base), str(out)], world, logs, deadline,
        extra_env={"NODE_NAMES": ",".join(names), **env}, warm="DIE_RANK" not in env,
    )  # fmt: skip
    assert not hung, f"ranks {hung} hung:\n" + "\n".join(log_tail(logs, r) for r in hung)
    res = {}
    for r in range(world):
        f = Path(f"{out}.{r}.json")
        if env.get("DIE_RANK") == str(r):
            assert not f.exists()
            continue
        assert f.exists(), f"rank {r} wrote no result:\n{log_tail(logs, r)}"
        res[r] = json.loads(f.read_text())
        assert "crash" not in res[r], res[r]["crash"]
    return res


def _want(rank: int, step: int, attempt: str = "a", size: int | None = None) -> dict[str, str]:
    return digest(files_for(rank, step, attempt, size))


def test_push_then_fetch_is_bit_exact_and_failures_are_typed_on_both_sides(tmp_path: Path) -> None:
    """Two nodes, two ranks each: push steps 1..3 (keep 2); fetch: node B's ranks get step 3
    back exact; a retired step and another attempt's are missing on the needer and its buddy;
    a corrupt replica is refused; the group still serves a good fetch after all that."""
    fetches = "3:a:2,3;1:a:1;3:b:0;2:a:2:corrupt;3:a:0,1,2,3"
    res = _run(tmp_path, "pf", ["A", "A", "B", "B"], PUSH="1,2,3", FETCHES=fetches, KEEP="2")
    for r, got in res.items():
        assert got["buddy"] == (r + 2) % 4 and got["sources"] == [(r + 2) % 4]
        assert [p["error"] for p in got["pushes"]] == [None, None, None] and all(p["held"] for p in got["pushes"])
        good, retired, other, corrupt, again = got["fetches"]
        assert good["got"] == (_want(r, 3) if r in (2, 3) else None), r
        if r in (1, 3):  # rank 1 needed the retired step 1; rank 3 holds rank 1's replicas
            assert retired["error"]["type"] == "ReplicaMissingError" and retired["error"]["failed"].keys() == {"1"}
            assert not retired["error"]["broken"]
        else:
            assert retired == {"got": None, "step": 1, "attempt": "a", "s": retired["s"], "held": False}
        if r in (0, 2):
            assert other["error"]["type"] == "ReplicaMissingError"
            assert "of attempt 'a', not 'b'" in other["error"]["msg"]
        else:
            assert other["got"] is None
        if r in (0, 2):  # rank 2 needed step 2, which rank 0 holds corrupt
            assert corrupt["error"]["type"] == "ReplicaCorruptError", corrupt
            assert "fails its CRC-32C" in corrupt["error"]["failed"]["2"]
        else:
            assert corrupt["got"] is None
        assert again["got"] == _want(r, 3)
        # a push each way: header, description, a piece per non-empty file (2 of 3: under a piece's 8 MiB), trailer;
        # bytes: the files + 32 + the description + 8 a file
        push = got["pushes"][0]["counts"]
        size = sum(len(b) for b in files_for(r, 1, "a").values())
        assert push["sent_messages"] == 5 and push["recv_messages"] == 5
        assert size + 32 < push["sent_bytes"] < size + 32 + 300


def test_four_nodes_one_rank_each_replicate_round_the_ring(tmp_path: Path) -> None:
    size = str(40 << 20)  # more than one piece (8 MiB) a file
    res = _run(tmp_path, "ring", ["n0", "n1", "n2", "n3"], PUSH="5", FETCHES="5:a:0,1,2,3", SIZE=size)
    for r, got in res.items():
        assert got["buddy"] == (r + 1) % 4 and got["sources"] == [(r - 1) % 4]
        # a group of two per pair that talks (its buddy, its source), not one of every rank
        assert got["links"] == {str((r + 1) % 4): 2, str((r - 1) % 4): 2}
        assert got["fetches"][0]["got"] == _want(r, 5, size=int(size))
        pieces = -(-(int(size) + 17 * r) // CHUNK)  # the large file (40 MiB + 17 r bytes) in 5 or 6 pieces
        assert got["pushes"][0]["counts"]["sent_messages"] == 2 + pieces + 1 + 1
    for k in range(4):
        assert os.listdir(tmp_path / "nodes" / f"n{k}" / "replicas") == [f"peer-rank{(k - 1) % 4:05d}"]


def test_a_replaced_node_fetches_its_ranks_files_from_the_buddys_memory(tmp_path: Path) -> None:
    """The job ends; node B is replaced (its memory and disk wiped); new processes fetch."""
    first = _run(tmp_path, "first", ["A", "A", "B", "B"], PUSH="7,8", ATTEMPT="run1", NO_FILES_RANK="3")
    assert all(p["error"] is None for got in first.values() for p in got["pushes"])
    shutil.rmtree(tmp_path / "nodes" / "B")
    res = _run(tmp_path, "second", ["A", "A", "B", "B"], FETCHES="8:run1:2,3")
    assert res[2]["fetches"][0]["got"] == _want(2, 8, "run1")
    assert res[3]["fetches"][0]["got"] == {}  # rank 3 pushed no files: it gets none back
    assert res[0]["fetches"][0] == {"got": None, "step": 8, "attempt": "run1", "s": res[0]["fetches"][0]["s"],
                                    "held": True}  # fmt: skip


@pytest.mark.timing
@pytest.mark.parametrize("at", ["before", "mid"])
def test_a_dead_rank_fails_the_push_on_every_survivor_within_the_deadline(tmp_path: Path, at: str) -> None:
    """Rank 1 dies by SIGKILL (before its push, or with its frame's header sent and none of
    its 8 MiB): every survivor raises a typed push error within the 4 s deadline, and rank 1's
    buddy (rank 3) holds no part of rank 1's step. (The agreement waits for rank 1 to its
    deadline: rank 3 saw rank 1's connection close at once, but only the deadline tells a dead
    rank from a slow one to the others.)"""
    res = _run(tmp_path, at, ["A", "A", "B", "B"], deadline=60, PUSH="1", DIE_RANK="1", DIE_AT=at,
               REPLICA_TIMEOUT="4")  # fmt: skip
    for r in (0, 2, 3):
        (push,) = res[r]["pushes"]
        assert push["error"]["type"] == "ReplicaPushTimeout", push  # rank 1 never reports: named on every rank
        assert push["error"]["failed"] == {"1": "did not answer"} and push["error"]["broken"], push
        assert push["s"] < 4 + 1.5, push
    assert res[0]["pushes"][0]["held"] and not res[3]["pushes"][0]["held"]  # rank 2's replica landed, 1's not
    # node B holds rank 0's replica (rank 2 got it whole) and nothing of rank 1's, nothing half-received
    assert not [p for p in res[3]["leftovers"] if "peer-rank00001" in p or ".incoming" in p or ".deleting" in p], res[3]
    assert "peer-rank00000/step_00000001/.replica.json" in res[3]["leftovers"]


def test_a_rank_whose_files_cannot_be_read_fails_the_push_everywhere_and_nothing_is_lost(tmp_path: Path) -> None:
    """Rank 2 names a file that is not there at step 2: it tells its buddy (a failure frame,
    not silence), every rank raises ``ReplicaPushError`` at once (the group still works), the
    replicas of step 1 stay, the other ranks' replicas of step 2 land, and step 3 pushes fine."""
    res = _run(tmp_path, "bad", ["A", "A", "B", "B"], PUSH="1,2,3", BAD_RANK="2", BAD_STEP="2", KEEP="3")
    for r, got in res.items():
        one, two, three = got["pushes"]
        assert one["error"] is None and three["error"] is None and three["held"]
        assert two["error"]["type"] == "ReplicaPushError" and not two["error"]["broken"], two
        assert set(two["error"]["failed"]) == {"0", "2"}  # the sender and its buddy both say so
        assert "could not be read" in two["error"]["failed"]["2"] and "rank 2 sent none" in two["error"]["failed"]["0"]
        assert two["s"] < 10 and two["held"] == (r != 0)  # rank 0 holds rank 2's: it is the one missing
        assert one["held"]


@pytest.mark.timing
def test_a_silent_rank_fails_the_push_within_the_deadline(tmp_path: Path) -> None:
    """Rank 1 is alive and connected but never pushes (a stuck process), with 8 MiB frames
    that no socket buffer absorbs: rank 3's receive from it and its send to it both end at the
    round's deadline (``Work.wait`` with what is left; gloo then closes the pair), and every
    survivor raises ``ReplicaPushTimeout`` naming rank 1 within the 4 s."""
    res = _run(tmp_path, "hang", ["A", "A", "B", "B"], deadline=60, PUSH="1", DIE_RANK="1", DIE_AT="hang",
               REPLICA_TIMEOUT="4", SIZE=str(8 << 20))  # fmt: skip
    for r in (0, 2, 3):
        (push,) = res[r]["pushes"]
        assert push["error"]["type"] == "ReplicaPushTimeout", push
        assert push["error"]["failed"] == {"1": "did not answer"} and push["error"]["broken"], push
        assert push["s"] < 4 + 1.5, push
    assert not res[3]["pushes"][0]["held"] and res[0]["pushes"][0]["held"]


@pytest.mark.timing
def test_a_buddy_that_dies_before_a_fetch_fails_it_on_every_survivor_within_the_deadline(tmp_path: Path) -> None:
    """Rank 3 (the holder of rank 1's replica) dies before the fetch in which rank 1 needs its
    files: every survivor raises ``ReplicaTimeoutError`` naming rank 3 within the 4 s, and the
    object refuses further rounds (``ReplicaTransportError``, broken)."""
    res = _run(tmp_path, "fetchdead", ["A", "A", "B", "B"], deadline=60, PUSH="1", FETCHES="1:a:1;1:a:1",
               DIE_RANK="3", DIE_AT="fetch", REPLICA_TIMEOUT="4")  # fmt: skip
    for r in (0, 1, 2):
        first, second = res[r]["fetches"]
        assert first["error"]["type"] == "ReplicaTimeoutError", first
        assert first["error"]["failed"] == {"3": "did not answer"} and first["error"]["broken"]
        assert first["s"] < 4 + 1.5, first
        # the second round first builds a new group: rank 3 never comes, so it cannot be rebuilt
        assert second["error"]["type"] == "ReplicaTransportError", second
        assert "could not be rebuilt" in second["error"]["msg"], second
        assert second["error"]["failed"] == {"3": "did not answer"}, second  # within the round's time
        assert second["s"] < 4 + 2 + 1.5, second


@pytest.mark.timing
def test_a_rank_back_from_a_stall_rejoins_a_new_group_and_the_next_push_lands(tmp_path: Path) -> None:
    """Rank 1 stalls 5 s (alive: a paused process, a slow disk) before its push of step 2, past
    the 3 s deadline: every rank's push of step 2 fails with the group broken (rank 1's too,
    once it is back). The push of step 3 first builds the group's next generation on every
    rank (rank 1 joins late) and lands on every buddy; step 3 comes back bit-exact. Before,
    the replica was given up for the rest of the job after one stall."""
    res = _run(tmp_path, "stall", ["A", "A", "B", "B"], deadline=90, PUSH="1,2,3", STALL_RANK="1", STALL_STEP="2",
               STALL_S="5", REPLICA_TIMEOUT="3", FETCHES="3:a:1,2")  # fmt: skip
    for r, got in res.items():
        one, two, three = got["pushes"]
        assert one["error"] is None and one["held"], one
        assert two["error"]["type"] == "ReplicaPushTimeout" and two["error"]["broken"], two
        assert two["error"]["failed"] == {"1": "did not answer"}, two
        assert three["error"] is None and three["held"], three
        assert got["generation"] == 1
        (fetch,) = got["fetches"]
        assert fetch["got"] == (_want(r, 3) if r in (1, 2) else None), fetch


def test_a_full_tmpfs_on_the_receiver_fails_the_push_everywhere_and_the_group_stays_usable(tmp_path: Path) -> None:
    """Rank 2's tmpfs has no room at step 2 (fallocate: ENOSPC): it drains rank 0's frame (the
    pair stays in step), every rank raises ``ReplicaPushError``, not broken; nothing of step 2
    is visible on rank 2; step 3 pushes fine."""
    res = _run(tmp_path, "full", ["A", "A", "B", "B"], PUSH="1,2,3", FULL_RANK="2", FULL_STEP="2", KEEP="3")
    for r, got in res.items():
        one, two, three = got["pushes"]
        assert one["error"] is None and three["error"] is None and three["held"]
        assert two["error"]["type"] == "ReplicaPushError" and not two["error"]["broken"], two
        assert list(two["error"]["failed"]) == ["2"] and "No space left" in two["error"]["failed"]["2"]
        assert two["held"] == (r != 2)
    assert sorted(os.listdir(tmp_path / "nodes" / "B" / "replicas" / "peer-rank00000")) == [
        "step_00000001", "step_00000003"]  # fmt: skip


def test_holdings_report_each_sources_committed_replicas_with_their_attempts_only(tmp_path: Path) -> None:
    held = HeldReplicas(str(tmp_path / DIRECTORY), keep=2)
    held.commit(*_record(2, 3, "a3", {"x": b"3" * 100}))
    held.commit(*_record(2, 4, "a4", {"x": b"4" * 100}))
    held.commit(*_record(3, 4, "b4", {"x": b"4" * 100}))
    os.truncate(tmp_path / DIRECTORY / "peer-rank00003" / "step_00000004" / "x", 10)  # cut short: not held
    (tmp_path / DIRECTORY / "peer-rank00002" / ".incoming-step_00000005-0123").mkdir()  # half received: never
    assert holdings(str(tmp_path), [2, 3, 7]) == {"2": {"3": "a3", "4": "a4"}}
    assert held.attempts(2) == {3: "a3", 4: "a4"}
    assert holdings(str(tmp_path / "nothing"), [2]) == {}  # a look: nothing made
    assert not (tmp_path / "nothing").exists()


def test_a_failed_first_receive_leaves_no_trace_of_its_source_and_a_later_one_keeps_the_held(tmp_path: Path) -> None:
    """A sender that dies mid-frame: the receiver aborts. For a source it held nothing of, not even
    an empty ``peer-rankRRRRR/`` remains (CI saw one, racing the sender's kill); for one it holds
    steps of, those stay."""
    held = HeldReplicas(str(tmp_path), keep=2)
    rec, _ = _record(1, 1, "a", {"x": b"1" * 100})
    held.receive(rec).abort()
    assert os.listdir(tmp_path) == []
    held.commit(*_record(1, 1, "a", {"x": b"1" * 100}))
    held.receive(_record(1, 2, "a", {"x": b"2" * 100})[0]).abort()
    assert sorted(os.listdir(tmp_path / "peer-rank00001")) == ["step_00000001"]
    assert held.held(1, 1, "a")
