"""One deadline for a node-local root's collective calls, through real gloo ranks (one node, two
ranks: ``support/_deadline_worker.py``): the construction (a leader slow to start) and
``load()`` (a rank late, then slow to read) end by the timeout on every rank, the others
with ``AgreeTimeout`` naming the late rank, and leave the root as it was; a rank whose call
to its own node's disk never returns (a read at load, a look or the leader's start at
construction) fails by the timeout with ``CheckpointReadError`` naming it and the file.
Each test failed on the code before its fix (the deadline audit's open findings; the rest:
``test_deadline_audit.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from faultfs import FaultFS, mounted, rule


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFS]:
    base = tmp_path_factory.mktemp("deadline-ranks")
    # direct: every read reaches it
    with mounted(base / "backing", base / "mnt", direct_io=True, skip_unavailable=True) as fs:
        yield fs


WORKER = str(Path(__file__).parent / "support" / "_deadline_worker.py")


def _ranks(
    tmp_path: Path, scenario: str, root: str, on_saved: Callable[[], None] | None = None, **env: str
) -> dict[int, dict[str, Any]]:
    """Run ``scenario`` of the deadline worker on 2 ranks (one node) over ``root``; ``on_saved``
    runs once the ranks said they saved (``<OUT>.saved``), before they go on (``<OUT>.go``)."""
    import json

    from _ranks import free_port, log_tail, run_ranks

    out, logs = tmp_path / f"{scenario}-result", tmp_path / scenario
    logs.mkdir()
    port = free_port()

    def started(procs: list[Any]) -> None:
        if on_saved is None:
            return
        end = time.monotonic() + 90
        while not os.path.exists(f"{out}.saved") and time.monotonic() < end and all(p.poll() is None for p in procs):
            time.sleep(0.02)
        on_saved()
        Path(f"{out}.go").touch()

    hung = run_ranks(lambda r: [WORKER, scenario, str(r), "2", str(port), root, str(out)], 2, logs, 150,
                     extra_env={"OUT": str(out), **env}, on_started=started)  # fmt: skip
    assert not hung, f"ranks {hung} hung:\n" + "\n".join(log_tail(logs, r) for r in hung)
    res = {}
    for r in range(2):
        f = Path(f"{out}.{r}.json")
        assert f.exists(), f"rank {r} wrote no result:\n{log_tail(logs, r)}"
        res[r] = json.loads(f.read_text())
        assert "crash" not in res[r], res[r]["crash"]
    return res


def _held_ranks(
    faulty: FaultFS, tmp_path: Path, scenario: str, root: str, rules: Callable[[Path], list[Any]], ended: str,
    rule_id: str, **env: str,
) -> dict[int, dict[str, Any]]:  # fmt: skip
    """:func:`_ranks` with a call the file system holds: once the ranks saved, ``rules(out)``
    (``out``: the scenario's result prefix, where the ranks' pids are) go in; once both ranks
    said how their call ended (``<out>.<ended>.<rank>``, or after 30 s) the rules go and the
    ranks hear ``<out>.go2``. The rule ``rule_id`` must have fired once."""
    import threading

    out = tmp_path / f"{scenario}-result"

    def release() -> None:
        end = time.monotonic() + 30
        while time.monotonic() < end and not all(os.path.exists(f"{out}.{ended}.{r}") for r in range(2)):
            time.sleep(0.02)
        faulty.clear()
        Path(f"{out}.go2").touch()

    def on_saved() -> None:
        faulty.set_rules(rules(out))
        threading.Thread(target=release, daemon=True).start()

    try:
        res = _ranks(tmp_path, scenario, root, on_saved, **env)
        assert faulty.fired(rule_id) == 1
    finally:
        faulty.clear()
    return res


@pytest.mark.timing
@pytest.mark.timeout(200)
def test_a_leader_slow_to_start_fails_a_node_local_construction_on_every_rank_by_the_timeout(
    tmp_path: Path,
) -> None:
    # the node-local start's deadline was counted from the end of the leader's own start: the
    # leader 1.5 timeouts late, every rank waited past its timeout and then went on as if in time
    timeout = 2.0
    res = _ranks(tmp_path, "slow_start", str(tmp_path / "ck"), CK_TIMEOUT=str(timeout), SLOW_S=str(1.5 * timeout))
    # the follower times out naming the leader; the leader's own start ends by the timeout too
    # (a thread of its own since a start that never returns held it forever), naming it and the root
    assert res[1].get("ctor_error", {}).get("type") == "AgreeTimeout", res[1]
    assert res[1]["ctor_error"]["missing"] == [0], res[1]  # the leader is the one named
    err = res[0].get("ctor_error", {})
    assert err.get("type") == "CheckpointReadError" and "rank 0" in err["msg"] and err["filename"] == str(
        tmp_path / "ck"), res[0]  # fmt: skip
    assert res[0]["ctor_s"] < timeout + 1.0 and res[1]["ctor_s"] < timeout + 1.0, res  # by the timeout
    assert res[0]["after"] == [] and res[1]["after"] == []  # the root was left free: the next job starts


@pytest.mark.needs_root
@pytest.mark.timing
@pytest.mark.timeout(200)
def test_a_node_local_load_ends_by_its_timeout_when_a_rank_is_late_and_then_reads_slowly(
    faulty: FaultFS, tmp_path: Path
) -> None:
    # load_part gave each phase the whole timeout: rank 0 waited up to one for rank 1 to come
    # to the agreement on the step, then up to one again for its outcome, and returned at 1.3x
    timeout = 2.0
    root = faulty.path("nodeload")
    slow = [rule("read", glob="*/step_00000001/rank00001.safetensors", delay_s=0.7 * timeout, count=1, id="slow-read")]
    try:
        res = _ranks(tmp_path, "late_load", root, lambda: faulty.set_rules(slow), CK_TIMEOUT=str(timeout),
                     LATE_S=str(0.6 * timeout))  # fmt: skip
        assert faulty.fired("slow-read") == 1
    finally:
        faulty.clear()
    for r, got in res.items():
        assert got.get("load_error", {}).get("type") == "AgreeTimeout", (r, got)
    assert res[0]["load_error"]["missing"] == [1], res[0]
    assert res[0]["load_s"] < timeout + 0.5, res[0]  # rank 0: by its timeout
    assert res[0]["loaded"] == 1.0 and res[1]["loaded"] == 2.0  # nothing lost: each rank loads its part after


@pytest.mark.needs_root
@pytest.mark.timing
@pytest.mark.timeout(200)
def test_a_rank_whose_read_of_its_own_node_disk_never_returns_fails_its_node_local_load_by_the_timeout(
    faulty: FaultFS, tmp_path: Path
) -> None:
    # the other ranks time out and name it, but the rank itself waited for its read with no
    # bound: its own node's file system holds the read of its shard (a server that stopped
    # answering). The read must end by the load's deadline with a typed error naming the
    # rank and the file, on that rank; the others fail naming it
    timeout = 2.0
    root = faulty.path("stuckread")
    stuck = [rule("read", glob="*/step_00000001/rank00001.safetensors", hold_s=60, count=1, id="held-read")]
    res = _held_ranks(faulty, tmp_path, "stuck_read", root, lambda _: stuck, "loaded", "held-read",
                      CK_TIMEOUT=str(timeout))  # fmt: skip
    err = res[1].get("load_error", {})
    assert err.get("type") == "CheckpointReadError", res[1]  # was: no error, the read waited 30 s for the test
    assert "rank 1" in err["msg"] and str(err.get("filename", "")).endswith("rank00001.safetensors"), err
    assert res[1]["load_s"] < timeout + 1.0, res[1]  # by the load's deadline, not the file system's
    # rank 0 hears rank 1's error in the agreement on the outcome (or, were rank 1 later than
    # the agreement's wait on a loaded machine, times out naming it)
    other = res[0].get("load_error", {})
    assert (other.get("type") == "CheckpointError" and "rank(s) [1]" in other["msg"]
            and "rank 1: reading its part" in other["msg"]) or (other.get("type") == "AgreeTimeout"
                                                                and other["missing"] == [1]), res[0]  # fmt: skip
    print(f"\nrank 1 (its read held): {err['type']} after {res[1]['load_s']:.2f} s; rank 0: {other['type']} after "
          f"{res[0]['load_s']:.2f} s (timeout {timeout} s)")
    assert res[0]["load_s"] < timeout + 1.0, res[0]
    assert res[0]["loaded"] == 1.0 and res[1]["loaded"] == 2.0  # nothing lost: each rank loads its part after


#: (the file system's rule for the call it holds: op, glob; the rank whose call it is, by pid),
#: each rule with an id of its own (the events last as long as the module's file system)
HELD = {
    # before any read, each rank looks at which steps its node's disk holds for it (the stat of
    # its files: roots._nodeparts.parts), unbounded as the read was: rank 1's stat of its shard
    # (rank 1's calls only: rank 0, the node's leader, looks at every file)
    "look": ("getattr", "*/step_00000001/rank00001.safetensors", 1),
    # the node's leader starts on its disk (make the root, take it: roots._rootstart.node_start)
    # with no bound of its own either: its open of the root's lock file
    "leader-start": ("open", "*/held-leader-start/.asyncckpt/owner.lock", 0),
    # then it places a token on its disk (which ranks see it: check_node_disks), unbounded too
    "leader-token": ("create", "*/held-leader-token/.asyncckpt-shared-*", 0),
    # then every rank looks for every leader's token on its own disk (check_node_disks), a
    # lookup with no bound of its own: rank 1's
    "token-look": ("getattr", "*/held-token-look/.asyncckpt-shared-*", 1),
}


@pytest.mark.needs_root
@pytest.mark.timing
@pytest.mark.timeout(200)
@pytest.mark.parametrize("held", list(HELD))
def test_a_rank_whose_call_to_its_own_node_disk_never_returns_fails_a_node_local_construction_by_the_timeout(
    faulty: FaultFS, tmp_path: Path, held: str
) -> None:
    # the file system holds one rank's call at construction (HELD): that rank's construction
    # must end by the timeout with a typed error naming it and the root; the other times out
    # naming it; once let go, the call leaves the root free and nothing is lost
    timeout = 2.0
    op, glob, stuck = HELD[held]
    other_rank = 1 - stuck

    def rules(out: Path) -> list[Any]:
        pid = int(Path(f"{out}.pid.{stuck}").read_text())
        return [rule(op, glob=glob, pid=pid, hold_s=60, count=1, id=f"held-{held}")]

    res = _held_ranks(faulty, tmp_path, "held_construction", faulty.path(f"held-{held}"), rules, "built",
                      f"held-{held}", CK_TIMEOUT=str(timeout))  # fmt: skip
    root = faulty.path(f"held-{held}")
    err, other = res[stuck].get("ctor_error", {}), res[other_rank].get("ctor_error", {})
    print(f"\nrank {stuck} (its {op} held): {err.get('type')} after {res[stuck]['ctor_s']:.2f} s; rank {other_rank}: "
          f"{other.get('type')} after {res[other_rank]['ctor_s']:.2f} s (timeout {timeout} s)")
    assert err.get("type") == "CheckpointReadError", res[stuck]  # was: the call waited 30 s, for the test
    assert f"rank {stuck}" in err["msg"] and err.get("filename") == root, err
    assert res[stuck]["ctor_s"] < timeout + 1.0, res[stuck]  # by the construction's deadline, not the file system's
    assert other.get("type") == "AgreeTimeout" and other["missing"] == [stuck], res[other_rank]
    assert res[other_rank]["ctor_s"] < timeout + 1.0, res[other_rank]
    assert res[0]["loaded"] == 1.0 and res[1]["loaded"] == 2.0  # nothing lost: each rank loads its part after


@pytest.mark.needs_root
@pytest.mark.timing
@pytest.mark.timeout(200)
def test_a_rank_whose_look_at_a_shared_root_never_returns_fails_the_construction_of_every_rank_in_time(
    faulty: FaultFS, tmp_path: Path
) -> None:
    # a shared root (node_local=False): rank 0 places a token, rank 1 looks for it in its view
    # of the root; the file system holds rank 1's lookup (a hung NFS server). Rank 1 must answer
    # by the check's window, not wait on the file system, and every rank's construction fail,
    # typed, naming rank 1 (was: rank 1 waited until the call was let go, rank 0 blamed a
    # different disk); nothing lost
    timeout = 2.0

    def rules(out: Path) -> list[Any]:
        pid = int(Path(f"{out}.pid.1").read_text())
        return [rule("getattr", glob="*/held-shared-look/.asyncckpt-shared-*", pid=pid, hold_s=60, count=1,
                     id="shared-look")]  # fmt: skip

    res = _held_ranks(faulty, tmp_path, "held_construction", faulty.path("held-shared-look"), rules, "built",
                      "shared-look", CK_TIMEOUT=str(timeout), CK_NODE_LOCAL="0")  # fmt: skip
    print(f"\n{res[0]['ctor_error']} after {res[0]['ctor_s']:.2f} s; rank 1: {res[1]['ctor_error']} after "
          f"{res[1]['ctor_s']:.2f} s")
    for r in range(2):
        err = res[r].get("ctor_error", {})
        assert err.get("type") == "CheckpointReadError", res[r]
        assert "rank(s) [1]" in err["msg"] and "did not answer" in err["msg"], err
        assert res[r]["ctor_s"] < timeout + 3.0, res[r]  # the window and a second, not the file system's 60 s
    assert res[0]["loaded"] == 1.0 and res[1]["loaded"] == 2.0  # nothing lost


@pytest.mark.needs_root
@pytest.mark.timing
@pytest.mark.timeout(200)
def test_a_single_process_whose_mkdir_of_its_root_never_returns_fails_its_construction_by_the_timeout(
    faulty: FaultFS, tmp_path: Path
) -> None:
    # the file system holds the root's mkdir: the construction must end by its timeout, typed,
    # naming the root (was: it waited on the file system); once let go, the next Checkpointer
    # starts. (Not the take of the root's lock: it stays on the caller's thread, see
    # _rootstart.start_on_root.)
    import subprocess
    import sys

    timeout = 2.0
    root = faulty.path("held-single-mkdir")
    code = (
        "import sys, time\nfrom asyncckpt import Checkpointer\nt = time.monotonic()\n"
        "try:\n    Checkpointer(sys.argv[1], timeout=float(sys.argv[2])).close()\n    print('built', flush=True)\n"
        "except Exception as e:\n    print(type(e).__name__, time.monotonic() - t, getattr(e, 'filename', None),"
        " flush=True)\n"
    )
    faulty.set_rules([rule("mkdir", glob="*/held-single-mkdir", hold_s=60, count=1, id="single-mkdir")])
    with subprocess.Popen([sys.executable, "-c", code, root, str(timeout)], stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}) as proc:  # fmt: skip
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().split()  # by the timeout, not the file system's 60 s (the test's 200 s)
        finally:
            faulty.clear()
            proc.wait(30)
    assert faulty.fired("single-mkdir") == 1
    print(f"\nheld mkdir: {line}")
    assert line[0] == "CheckpointReadError" and line[2] == root, line
    assert float(line[1]) < timeout + 1.0, line
    from asyncckpt import Checkpointer

    Checkpointer(root, timeout=10).close()  # the root was left free


#: One process, one rank (a gloo group of one), a node-local root: save step 1, wait for the
#: test's go (a line on stdin), then a construction with ``argv[3]``'s timeout (the file system
#: holds its leader's start), then the next owner: a second Checkpointer on the root, which
#: saves step 2. A second one refused (the root still held) waits for the test to let the held
#: call go (a second line), then for the start to end, and tries once more. Each outcome: a
#: JSON line.
LATE_START = """
import json, os, sys, threading, time
from datetime import timedelta
import torch, torch.distributed as dist
os.environ["ASYNCCKPT_NODE"] = "one"
root, out, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
dist.init_process_group("gloo", init_method="file://" + out + ".pg", rank=0, world_size=1,
                        timeout=timedelta(seconds=60))
from asyncckpt import Checkpointer
def say(**kw):
    print(json.dumps(kw), flush=True)
with Checkpointer(root, node_local=True, timeout=60) as ck:
    ck.save(1, {"w": torch.ones(4096)}).result(60)
say(saved=1)
sys.stdin.readline()
t = time.monotonic()
try:
    Checkpointer(root, node_local=True, timeout=timeout).close()
    say(first="built")
except Exception as e:
    say(first=type(e).__name__, s=time.monotonic() - t)
def second():
    with Checkpointer(root, node_local=True, timeout=60) as ck:
        say(second="built")
        ck.save(2, {"w": torch.full((4096,), 2.0)}).result(120)
        return ck.steps()
try:
    try:
        steps = second()
    except Exception as e:
        if type(e).__name__ != "RootInUseError":
            raise
        say(second=type(e).__name__)
        sys.stdin.readline()
        end = time.monotonic() + 30
        while any(t.name.startswith("asyncckpt-node") for t in threading.enumerate()) and time.monotonic() < end:
            time.sleep(0.02)
        steps = second()
    say(saved2=steps)
except Exception as e:
    say(error=f"{type(e).__name__}: {e}")
os._exit(0)
"""


@pytest.mark.needs_root
@pytest.mark.timing
@pytest.mark.timeout(200)
def test_a_node_leaders_start_that_outlives_its_construction_never_removes_the_next_owners_save(
    faulty: FaultFS, tmp_path: Path
) -> None:
    """The file system holds the node leader's write of its owner record (its start has
    locked the root): the construction fails by its timeout and releases the root. The start
    went on when let go (its look for leftovers, their removal) with the root no longer its:
    the next owner (a second Checkpointer) had taken it and was saving step 2, whose
    in-progress files the late start removed ("holds no complete part of attempt ...": the
    save failed). Now the root stays held until the late start ended: the next owner is
    refused (``RootInUseError``) while the call is held, and once it ended, takes the root
    and saves."""
    import json
    import subprocess
    import sys

    from asyncckpt.format._layout import parse_leftover

    timeout = 2.0
    root = faulty.path("late-start")
    backing = os.path.join(faulty.backing, "late-start")
    with subprocess.Popen([sys.executable, "-c", LATE_START, root, str(tmp_path / "late"), str(timeout)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}) as proc:  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        try:

            def line() -> dict[str, Any]:
                text = proc.stdout.readline()  # type: ignore[union-attr]
                assert text, "the process ended early"
                return dict(json.loads(text))

            def go() -> None:
                proc.stdin.write("\n")  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]

            assert line() == {"saved": 1}
            slow_save = rule("write", glob="*/late-start/step_00000002.tmp-*", delay_s=3.0, id="late-slow-save")
            held = rule("write", glob="*/late-start/.asyncckpt/owner.json.*", hold_s=60, count=1, id="late-record")
            faulty.set_rules([held, slow_save])
            go()
            first = line()
            assert first["first"] == "CheckpointReadError" and first["s"] < timeout + 1.0, first
            assert faulty.fired("late-record") == 1
            second = line()
            if second == {"second": "built"}:  # the root was let go: the next owner saves step 2
                end = time.monotonic() + 30
                while not any(parse_leftover(n) == 2 for n in os.listdir(backing)) and time.monotonic() < end:
                    time.sleep(0.01)
                assert any(parse_leftover(n) == 2 for n in os.listdir(backing)), "step 2's save never started"
                faulty.set_rules([slow_save])  # lets the held write go (the save's writes stay slow)
            else:  # the root stays held while its start is: refused
                assert second == {"second": "RootInUseError"}, second
                faulty.clear()
                go()
                assert line() == {"second": "built"}
            last = line()
        finally:
            faulty.clear()
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
    print(f"\nthe next owner: {second}, then {last}")
    assert last == {"saved2": [1, 2]}, last  # was: SaveError, its in-progress step 2 removed
