"""One root, one writer (issue 9 B): real processes, real SIGKILL, a real read-only mount, real gloo ranks.

* A second Checkpointer on an owned root - same process, another process, another job, the
  other sub-group of a 4-rank job - raises ``RootInUseError`` at construction naming the
  owner's pid and host, before it touches anything under the root.
* Ownership ends with ``close()`` and with the owner's death (SIGKILL: no stale lock).
* Readers need no ownership: ``load``, ``find_latest`` and the ``asyncckpt`` command work
  while a writer holds the root.
* A read-only root raises ``RootNotWritableError`` (a ``PermissionError``) pointing to ``load``.
* Manifests record the global ranks of the writing group.

``-s`` shows the measured figures.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _ckcheck import dir_problem
from _cli_util import run_cli
from _ranks import free_port, log_tail, run_ranks

import asyncckpt
from asyncckpt import Checkpointer, CheckpointError, RootInUseError, RootNotWritableError, find_latest

HERE = Path(__file__).parent
WORKER = str(HERE / "support" / "_owner_worker.py")
WAIT_S = 60.0
HOST = socket.gethostname()


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(step)), "step": step}


def _popen(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
    return subprocess.Popen(
        [sys.executable, WORKER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _line(p: subprocess.Popen[str], limit: float = WAIT_S) -> str:
    """The next line ``p`` prints, within ``limit`` seconds (else kill it and fail)."""
    assert p.stdout is not None
    stdout = p.stdout
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(limit)
    if not box or not box[0]:
        p.kill()
        _, err = p.communicate(timeout=30)
        raise AssertionError(f"no line from pid {p.pid} within {limit}s; stderr:\n{err[-3000:]}")
    return box[0].strip()


def _owner_record(root: Path) -> Any:
    return json.loads((root / ".asyncckpt" / "owner.json").read_bytes())


def _leftover(root: Path, step: int) -> Path:
    """A save attempt in progress (the owner's, as far as anyone else can tell)."""
    d = root / f"step_{step:08d}.tmp-{uuid.uuid4().hex[:16]}"
    d.mkdir()
    (d / "rank00000.safetensors").write_bytes(b"being written")
    return d


# ---------------------------------------------------------------- same process
@pytest.mark.timeout(60)
def test_second_checkpointer_in_the_same_process_is_refused_naming_the_owner(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    link = tmp_path / "link"
    first = Checkpointer(root, timeout=WAIT_S)
    try:
        first.save(1, _state(1)).result(timeout=WAIT_S)
        record = _owner_record(root)
        assert record["pid"] == os.getpid() and record["host"] == HOST and record["ranks"] == [0]
        live = _leftover(root, 5)
        link.symlink_to(root, target_is_directory=True)
        for spelling in (root, str(root) + "/", link, os.path.relpath(root)):
            with pytest.raises(RootInUseError) as ei:
                Checkpointer(spelling, timeout=WAIT_S)
            msg = str(ei.value)
            assert isinstance(ei.value, CheckpointError)
            assert f"pid {os.getpid()}" in msg and f"host {HOST}" in msg and "global ranks [0]" in msg, msg
            assert "asyncckpt.load()" in msg, msg
        # refused before any clean-up: the owner's attempt in progress is untouched
        assert (live / "rank00000.safetensors").read_bytes() == b"being written"
        assert _owner_record(root)["pid"] == os.getpid()
        first.save(2, _state(2)).result(timeout=WAIT_S)  # the owner is unaffected
    finally:
        first.close()
    assert not (root / ".asyncckpt" / "owner.json").exists()  # released with close()
    with Checkpointer(root, timeout=WAIT_S) as second:
        assert second.steps() == [1, 2]
        second.save(3, _state(3)).result(timeout=WAIT_S)
    with Checkpointer(link, timeout=WAIT_S) as third:  # and again, through the link
        assert third.steps() == [1, 2, 3]


# ---------------------------------------------------------------- another process; SIGKILL
@pytest.mark.timeout(90)
def test_owner_in_another_process_refuses_writers_serves_readers_and_dies_without_a_stale_lock(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ck"
    holder = _popen("hold", str(root))
    try:
        word, pid_s = _line(holder).split()
        assert word == "ready"
        pid = int(pid_s)
        assert _owner_record(root)["pid"] == pid
        live = _leftover(root, 9)
        # a writer in this process is refused, naming the other process
        t0 = time.monotonic()
        with pytest.raises(RootInUseError) as ei:
            Checkpointer(root, timeout=WAIT_S)
        refused_s = time.monotonic() - t0
        assert f"pid {pid}" in str(ei.value) and f"host {HOST}" in str(ei.value), str(ei.value)
        # ... and so is one in a third process (multiprocessing, spawn)
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        from _owner_worker import try_construct

        child = ctx.Process(target=try_construct, args=(str(root), queue))
        child.start()
        kind, msg, child_pid = queue.get(timeout=WAIT_S)
        child.join(timeout=WAIT_S)
        assert child.exitcode == 0
        assert kind == "RootInUseError" and f"pid {pid}" in msg and child_pid != pid, (kind, msg)
        assert (live / "rank00000.safetensors").read_bytes() == b"being written"
        # readers need no ownership
        assert asyncckpt.load(root)["step"] == 1
        assert asyncckpt.load(root, 1)["step"] == 1
        found = find_latest(root)
        assert found is not None and found.step == 1
        ls = run_cli("ls", root, "--json")
        assert ls.code == 0, ls.err
        rows = json.loads(ls.out)
        assert [r["step"] for r in rows if r.get("complete")] == [1], rows
        verify = run_cli("verify", root)
        assert verify.code == 0, verify.err
        console = Path(sys.executable).parent / "asyncckpt"  # the installed console entry point
        if console.exists():
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), *sys.path]))
            r = subprocess.run([str(console), "ls", str(root)], capture_output=True, text=True, env=env, timeout=60)
            assert r.returncode == 0 and "step_00000001" in r.stdout, (r.stdout, r.stderr)
        # the owner dies without closing anything
        holder.kill()
        holder.wait(timeout=30)
        assert holder.returncode == -9
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.communicate(timeout=30)
    assert _owner_record(root)["pid"] == pid  # its record outlives it; its lock does not
    t0 = time.monotonic()
    with Checkpointer(root, timeout=WAIT_S) as ck:
        taken_s = time.monotonic() - t0
        assert _owner_record(root)["pid"] == os.getpid()
        assert not live.exists()  # dead now that the root is ours: removed
        assert ck.steps() == [1]
        ck.save(2, _state(2)).result(timeout=WAIT_S)
    assert taken_s < 2.0, taken_s
    print(f"\nrefused in {refused_s * 1000:.1f} ms; root taken {taken_s * 1000:.1f} ms after the owner's SIGKILL")


# ---------------------------------------------------------------- who the refusal names, in a tight race
SLOW_OWNER = """
import fcntl, json, os, socket, sys, time
from asyncckpt.roots.posix import _ownership
root, delay = sys.argv[1], float(sys.argv[2])
meta = os.path.join(root, ".asyncckpt")
os.makedirs(meta, exist_ok=True)
fd = os.open(os.path.join(meta, "owner.lock"), os.O_RDONLY | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("locked", flush=True)
time.sleep(delay)  # the owner between its lock and its record, in slow motion
_ownership._write_record(meta, {"host": socket.gethostname(), "pid": os.getpid(),
    "start_time": _ownership.process_start_time(), "ranks": [0], "since": time.time()})
print("recorded", flush=True)
time.sleep(120)
"""


def _slow_owner(root: Path, delay: float) -> subprocess.Popen[str]:
    """A process that takes the root's lock as the library does, and writes its owner record
    (in the library's format, with the library's writer) only ``delay`` s later."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen(
        [sys.executable, "-c", SLOW_OWNER, str(root), str(delay)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert _line(p, 30) == "locked"
    return p


@pytest.mark.timeout(60)
def test_refusal_right_after_the_owner_was_killed_names_the_new_owner_not_the_dead_one(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    holder = _popen("hold", str(root))
    try:
        word, pid_s = _line(holder).split()
        assert word == "ready"
    finally:
        holder.kill()
        holder.communicate(timeout=30)
    dead = int(pid_s)
    assert _owner_record(root)["pid"] == dead  # what SIGKILL leaves behind
    new_owner = _slow_owner(root, 0.1)  # a restarted job takes the root
    try:
        with pytest.raises(RootInUseError) as ei:
            Checkpointer(root, timeout=WAIT_S)  # another restarted job, a moment later
        assert _line(new_owner, 30) == "recorded"
    finally:
        new_owner.kill()
        new_owner.communicate(timeout=30)
    msg = str(ei.value)
    assert f"pid {dead} " not in msg, msg
    assert f"pid {new_owner.pid} " in msg, msg


@pytest.mark.timeout(60)
def test_refusal_just_after_the_owner_took_the_lock_names_the_owner(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    owner = _slow_owner(root, 0.1)
    try:
        with pytest.raises(RootInUseError) as ei:
            Checkpointer(root, timeout=WAIT_S)
        assert _line(owner, 30) == "recorded"
    finally:
        owner.kill()
        owner.communicate(timeout=30)
    assert f"pid {owner.pid} " in str(ei.value) and f"host {HOST}" in str(ei.value), str(ei.value)


# ---------------------------------------------------------------- a read-only root
@pytest.fixture
def read_only_root(tmp_path: Path) -> Iterator[Path]:
    """A directory holding one committed checkpoint, bind-mounted read-only (a real EROFS)."""
    src, ro = tmp_path / "src", tmp_path / "ro"
    ro.mkdir()
    with Checkpointer(src, timeout=WAIT_S) as ck:
        ck.save(1, _state(1)).result(timeout=WAIT_S)
    if os.geteuid() != 0:
        pytest.skip(f"needs root/mount: a read-only bind mount needs root (euid {os.geteuid()})")
    r = subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"needs root/mount: cannot bind-mount: {r.stderr.strip()}")
    try:
        r = subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            pytest.skip(f"needs root/mount: cannot remount read-only: {r.stderr.strip()}")
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True, timeout=30)


@pytest.mark.timeout(60)
def test_read_only_root_raises_root_not_writable_pointing_to_load(read_only_root: Path) -> None:
    ro = read_only_root
    with pytest.raises(OSError) as probe:
        (ro / "probe").write_bytes(b"x")
    assert probe.value.errno == errno.EROFS  # a real read-only file system, even for root
    before = sorted(os.listdir(ro))
    for root in (ro, ro / "new"):
        with pytest.raises(RootNotWritableError) as ei:
            Checkpointer(root, timeout=WAIT_S)
        e = ei.value
        assert isinstance(e, PermissionError) and isinstance(e, CheckpointError)
        assert e.errno in (errno.EROFS, errno.EACCES), (root, e.errno, str(e))
        assert str(root) in str(e) and "asyncckpt.load()" in str(e), str(e)
    assert sorted(os.listdir(ro)) == before
    # reading needs nothing of that
    assert asyncckpt.load(ro)["step"] == 1
    found = find_latest(ro)
    assert found is not None and found.step == 1
    ls = run_cli("ls", ro)
    assert ls.code == 0 and "1" in ls.out, ls.err


@pytest.mark.timeout(60)
def test_read_only_root_error_says_read_only_file_system(read_only_root: Path) -> None:
    for root in (read_only_root / "new", read_only_root):  # a new root is right; the existing one is not
        with pytest.raises(RootNotWritableError) as ei:
            Checkpointer(root, timeout=WAIT_S)
        assert ei.value.errno == errno.EROFS, (root, ei.value.errno, str(ei.value))
        assert "Read-only file system" in str(ei.value), str(ei.value)


# ---------------------------------------------------------------- two independent jobs
@pytest.mark.timeout(90)
def test_two_independent_jobs_on_one_root_exactly_one_writes(tmp_path: Path) -> None:
    root, go, done, steps = tmp_path / "ck", tmp_path / "go", tmp_path / "done", 200
    jobs = [_popen("job", str(who), str(root), str(go), str(done), str(steps)) for who in (0, 1)]
    try:
        for p in jobs:
            assert _line(p) == "ready"
        go.touch()  # both build their Checkpointer now
        first = [_line(p) for p in jobs]
        owners = [who for who, line in enumerate(first) if line.startswith("owner ")]
        refused = [who for who, line in enumerate(first) if line.startswith("refused ")]
        assert len(owners) == 1 and len(refused) == 1, first
        (winner,), (loser,) = owners, refused
        owner_pid = int(first[winner].split()[1])
        msg = json.loads(first[loser].split(" ", 1)[1])
        # the loser names the winner, even when it lost by microseconds (between the winner's
        # lock and its owner record: the refusal waits for the record)
        named = f"pid {owner_pid}" in msg and f"host {HOST}" in msg
        assert named, msg
        assert f"pid {jobs[loser].pid}" not in msg, msg
        assert _line(jobs[winner]) == f"saved {steps}"
        done.touch()
        for p in jobs:
            _, err = p.communicate(timeout=WAIT_S)
            assert p.returncode == 0, err
    finally:
        done.touch()
        for p in jobs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    false_commits = []
    for step in range(1, steps + 1):
        problem = dir_problem(root, step)
        if problem is None:
            loaded = asyncckpt.load(root, step)
            if loaded["who"] != winner:
                problem = f"holds job {loaded['who']}'s data"
        if problem is not None:
            false_commits.append((step, problem))
    assert not false_commits, false_commits
    on_disk = sorted(n for n in os.listdir(root) if n.startswith("step_"))
    assert on_disk == [f"step_{s:08d}" for s in range(1, steps + 1)]
    print(
        f"\n2 jobs on one root: job {winner} wrote, job {loser} was refused "
        "(naming the owner); "
        f"0 false commits over {steps} steps"
    )


# ---------------------------------------------------------------- two sub-groups of one job
@pytest.mark.timeout(120)
def test_second_subgroup_on_an_owned_root_is_refused_on_every_rank(tmp_path: Path) -> None:
    shared, root_a, root_b, out = tmp_path / "shared", tmp_path / "a", tmp_path / "b", tmp_path / "result"
    port = str(free_port())
    world = 4
    t0 = time.monotonic()
    hung = run_ranks(
        lambda r: [WORKER, "groups", str(r), str(world), port, str(shared), str(root_a), str(root_b), str(out)],
        world,
        tmp_path,
        deadline=100,
        warm=True,
    )
    elapsed = time.monotonic() - t0
    assert not hung, f"ranks {hung} hung: " + "".join(log_tail(tmp_path, r) for r in hung)
    res = {}
    for r in range(world):
        path = Path(f"{out}.{r}.json")
        assert path.exists(), log_tail(tmp_path, r)
        res[r] = json.loads(path.read_text())
        assert "crash" not in res[r], res[r]["crash"]
    owner_pid = res[0]["pid"]
    assert res[0]["shared"] == res[1]["shared"] == "owner"
    for r in (2, 3):  # every rank of the second group, none left waiting
        got = res[r]["shared"]
        assert isinstance(got, dict) and got["type"] == "RootInUseError", (r, got)
        assert f"pid {owner_pid}" in got["msg"] and "global ranks [0, 1]" in got["msg"], (r, got["msg"])
        assert got["elapsed"] < 10, (r, got)
        assert res[r]["shared_after_close"] == [1, 2]  # free again once group A closed it
    manifests = {
        name: json.loads((root / "step_00000001" / "manifest.json").read_bytes())
        for name, root in (("a", root_a), ("b", root_b), ("shared", shared))
    }
    assert manifests["a"]["ranks"] == [0, 1] and manifests["a"]["world_size"] == 2
    assert manifests["b"]["ranks"] == [2, 3] and manifests["b"]["world_size"] == 2
    assert manifests["shared"]["ranks"] == [0, 1]
    second = json.loads((shared / "step_00000002" / "manifest.json").read_bytes())
    assert second["ranks"] == [2, 3]
    for root in (root_a, root_b):
        assert dir_problem(root, 1) is None
        assert res[0 if root == root_a else 2]["own_root_steps"] == [1]
    refusal = max(res[r]["shared"]["elapsed"] for r in (2, 3))
    print(f"\n4 ranks, 2 groups: group [2, 3] refused on both ranks within {refusal:.2f}s; job {elapsed:.1f}s")
