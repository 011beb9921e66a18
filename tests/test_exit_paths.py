"""Exit paths end on time (issue 9 F): real processes, real signals, real fork, real gloo ranks.

Each test bounds what it waits for; the figures it measures are printed (``-s`` shows them).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from _ranks import free_port, log_tail
from _ranks import run_ranks as launch
from conftest import FaultOps, make_state

from asyncckpt import Checkpointer, SaveError, SaveTimeoutError, find_latest, load
from asyncckpt.format._layout import META_DIR

HERE = Path(__file__).parent
WORKER = str(HERE / "support" / "_exit_worker.py")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))


def _spawn(tmp_path: Path, body: str) -> subprocess.Popen[str]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )


def _finish(p: subprocess.Popen[str], limit: float) -> tuple[str, str]:
    try:
        return p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"still running after {limit}s\nstdout:\n{out}\nstderr:\n{err[-3000:]}") from None


# ---------------------------------------------------------------- 7. every wait is bounded
def test_checkpointer_on_proc_fails_at_once_instead_of_spinning(tmp_path: Path) -> None:
    p = _spawn(tmp_path, """
        import time
        from asyncckpt import Checkpointer
        t0 = time.monotonic()
        try:
            Checkpointer("/proc/asyncckpt-x/ck", timeout=5)
        except FileNotFoundError as e:
            print("FileNotFoundError", round(time.monotonic() - t0, 2), e.filename)
    """)
    out, err = _finish(p, 30)
    assert p.returncode == 0, err
    kind, elapsed, name = out.split()
    assert kind == "FileNotFoundError" and name == "/proc/asyncckpt-x" and float(elapsed) < 5, out


@pytest.mark.timing  # a 2 s bound
def test_ensure_dir_enoent_after_parent_is_bounded_by_its_deadline(tmp_path: Path) -> None:
    from asyncckpt.roots.posix._ensure_dir import ensure_dir
    from asyncckpt.roots.posix._osops import OsOps

    class NoNewDirs(OsOps):  # stands in for a file system that keeps refusing mkdir with ENOENT
        calls = 0

        def mkdir(self, path: str, mode: int = 0o777) -> None:
            self.calls += 1
            if path.endswith("leaf"):
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
            super().mkdir(path, mode)

    ops = NoNewDirs()
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError) as ei:
        ensure_dir(tmp_path / "leaf", timeout=30, ops=ops)
    assert time.monotonic() - t0 < 2 and ops.calls < 20
    assert ei.value.filename == str(tmp_path / "leaf") and ei.value.errno == errno.ENOENT


# ---------------------------------------------------------------- 6. seen on the handle: not raised again
@pytest.mark.parametrize("how", ["result", "exception", "await"])
def test_failure_seen_on_its_handle_is_not_raised_by_the_next_save(tmp_path: Path, how: str) -> None:
    ops = FaultOps()
    with Checkpointer(tmp_path, os_ops=ops) as ck:
        ck.save(1, make_state(1)).result(timeout=30)
        ops.fail("fsync", errno.EIO, where="step_00000002", times=1)
        h = ck.save(2, make_state(2))
        if how == "result":
            with pytest.raises(SaveError):
                h.result(timeout=30)
        elif how == "exception":
            assert isinstance(h.exception(timeout=30), SaveError)
        else:

            async def wait() -> None:
                await h

            with pytest.raises(SaveError):
                asyncio.run(wait())
        time.sleep(0.05)  # let the writer's done-callback record the failure
        ck.save(3, make_state(3)).result(timeout=30)  # no SaveError: the caller saw it already
        with pytest.raises(SaveError) as at_flush:  # flush still reports every failure since the last flush
            ck.flush()
        assert at_flush.value.step == 2
        ck.flush()
        assert ck.steps() == [1, 3]


def test_failure_not_seen_on_its_handle_is_raised_once_by_the_next_save(tmp_path: Path) -> None:
    ops = FaultOps()
    with Checkpointer(tmp_path, os_ops=ops) as ck:
        ops.fail("fsync", errno.EIO, where="step_00000001", times=1)
        h = ck.save(1, make_state(1))
        deadline = time.monotonic() + 30
        while ck.statistics().saves_failed == 0 and time.monotonic() < deadline:  # settled, handle unseen
            time.sleep(0.01)
        assert h.done()
        with pytest.raises(SaveError):
            ck.save(2, make_state(2))
        ck.save(2, make_state(2)).result(timeout=30)
        with pytest.raises(SaveError):
            ck.flush()


# ---------------------------------------------------------------- 4. fork
@pytest.mark.timing  # a 5 s bound (5.0 s seen under parallel load)
def test_forked_child_exits_promptly_and_never_writes(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    p = _spawn(tmp_path, f"""
        import os, sys, time, torch
        from asyncckpt import Checkpointer
        from asyncckpt.roots.posix._osops import OsOps

        class SlowFsync(OsOps):  # keeps the parent's save pending while the child lives
            def fsync(self, fd):
                time.sleep(2.0)
                super().fsync(fd)

        ck = Checkpointer({str(root)!r}, timeout=20, os_ops=SlowFsync())
        h = ck.save(1, {{"w": torch.ones(1 << 16)}})
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            for call in (lambda: ck.save(2, {{"w": torch.zeros(4)}}), ck.flush):
                try:
                    call()
                    print("child: no error", flush=True)
                except RuntimeError as e:
                    print("child: RuntimeError", "forked child" in str(e), flush=True)
            ck.close()  # only marks the child's copy closed
            sys.exit(0)  # a normal exit: atexit hooks run in the child
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), round(time.monotonic() - t0, 2), flush=True)
        print("parent", h.result(timeout=60).step, flush=True)
        ck.close()
    """)
    out, err = _finish(p, 60)
    assert p.returncode == 0, err
    lines = out.splitlines()
    assert lines[:2] == ["child: RuntimeError True", "child: RuntimeError True"], out
    _, _, code, elapsed = lines[2].split()
    print(f"forked child exit: {elapsed}s after fork (parent save pending, timeout=20)")
    assert code == "0" and float(elapsed) < 5, (out, err)  # not the parent's save timeout (20 s)
    assert lines[3] == "parent 1"
    assert sorted(n for n in os.listdir(root) if n != META_DIR) == ["step_00000001"]
    assert sorted(os.listdir(root / "step_00000001")) == ["manifest.json", "rank00000.json", "rank00000.safetensors"]


# ---------------------------------------------------------------- 5. Ctrl-C during close()
def test_ctrl_c_during_close_leaves_old_or_new_checkpoint_and_says_which(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    p = _spawn(tmp_path, f"""
        import signal, time, torch
        from asyncckpt import Checkpointer
        from asyncckpt.roots.posix._osops import OsOps

        # a user's Python raises KeyboardInterrupt on Ctrl-C; a test run launched in the background
        # by a non-interactive shell ignores SIGINT, and children inherit that: restore Python's own
        signal.signal(signal.SIGINT, signal.default_int_handler)

        class SlowFsync(OsOps):
            def fsync(self, fd):
                if "step_00000002" in str(getattr(self, "last", "")):
                    open({str(tmp_path / "in_fsync")!r}, "w").close()  # close() is waiting on this save now
                    time.sleep(1.5)
                super().fsync(fd)

            def open(self, path, flags, mode=0o644):
                self.last = path
                return super().open(path, flags, mode)

        ck = Checkpointer({str(root)!r}, timeout=20, os_ops=SlowFsync())
        ck.save(1, {{"w": torch.ones(1 << 16)}}).result(timeout=30)
        ck.save(2, {{"w": torch.full((1 << 16,), 2.0)}})
        print("closing", flush=True)
        ck.close()
        print("not reached", flush=True)
    """)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "closing"
    deadline = time.monotonic() + 20
    while not (tmp_path / "in_fsync").exists():  # the slow fsync began: close() is waiting in it
        assert time.monotonic() < deadline and p.poll() is None, "step 2's fsync never began"
        time.sleep(0.01)
    time.sleep(0.1)  # into close()'s wait (the fsync itself lasts 1.5 s)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, err = _finish(p, 30)
    elapsed = time.monotonic() - t0
    print(f"Ctrl-C during close(): process gone {elapsed:.2f}s after SIGINT")
    assert "not reached" not in out
    assert "KeyboardInterrupt" in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("asyncckpt:")]
    assert lines, err
    assert not [ln for ln in lines if ln.rstrip().endswith(":")], lines  # never an empty "failed: "
    said = [ln for ln in lines if "close() was interrupted" in ln and "step 2" in ln]
    assert len(said) == 1, lines
    latest = find_latest(root)
    assert latest is not None and latest.step in (1, 2)
    if latest.step == 2:
        assert " committed;" in said[0], said
    else:
        assert "abandoned before its commit" in said[0] and "newest complete checkpoint: step 1" in said[0], said
    assert elapsed < 15
    assert float(load(root)["w"][0]) == float(latest.step)
    with Checkpointer(root) as ck:  # the next start removes the abandoned attempt and goes on
        assert not [n for n in os.listdir(root) if ".tmp-" in n]
        ck.save(3, {"w": make_state(3)["model"]["layer0.weight"]}).result(timeout=30)


def test_abandoned_save_has_a_message_on_its_handle(tmp_path: Path) -> None:
    import threading

    from asyncckpt.roots.posix._osops import OsOps

    release = threading.Event()

    class Stuck(OsOps):
        def fsync(self, fd: int) -> None:
            release.wait(5)
            super().fsync(fd)

    ck = Checkpointer(tmp_path, timeout=20, os_ops=Stuck())
    h = ck.save(1, make_state(1))
    with pytest.raises(TimeoutError):
        ck.close(timeout=0.2)  # flush times out, close stops the writer: the save is dropped
    release.set()
    exc = h.exception(timeout=10)
    assert exc is not None and "abandoned" in str(exc) and "step 1" in str(exc)
    with pytest.raises(type(exc), match="abandoned"):
        h.result(timeout=1)


# ---------------------------------------------------------------- 3. SIGTERM while save() copies
def test_sigterm_while_save_is_staging_exits_within_grace_with_the_final_save(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    grace = 4.0
    p = _spawn(tmp_path, f"""
        import os, signal, sys, threading, time, torch
        from asyncckpt import Checkpointer

        ck = Checkpointer({str(root)!r}, timeout=20, max_pending=1)
        ck.install_sigterm_handler(grace_s={grace}, final_save=lambda c: c.save(99, {{"w": torch.full((8,), 99.0)}}))
        big = {{f"t{{i}}": torch.randn(1 << 20) for i in range(48)}}  # 192 MiB: staging takes a while
        ck.save(1, big).result(timeout=60)
        main = threading.main_thread().ident

        def watch():  # a real SIGTERM, sent the moment the main thread is seen copying in save()
            while True:
                f = sys._current_frames().get(main)
                while f is not None:
                    if f.f_code.co_name == "stage" and f.f_code.co_filename.endswith("_stagecopy.py"):
                        print("sigterm", time.monotonic(), flush=True)
                        os.kill(os.getpid(), signal.SIGTERM)
                        return
                    f = f.f_back
                time.sleep(0.0005)

        threading.Thread(target=watch, daemon=True).start()
        for step in range(2, 40):
            ck.save(step, big).result(timeout=60)
        print("never signalled", flush=True)
    """)
    out, err = _finish(p, 60)
    t_exit = time.monotonic()
    assert out.startswith("sigterm"), (out, err)
    exit_s = t_exit - float(out.split()[1])
    print(f"SIGTERM during staging: process gone {exit_s:.2f}s after the signal (grace_s={grace})")
    assert p.returncode == -signal.SIGTERM, (p.returncode, err)
    assert exit_s < grace + 1.5, exit_s
    latest = find_latest(root)
    assert latest is not None and latest.step == 99, os.listdir(root)
    assert float(load(root, 99)["w"][0]) == 99.0
    assert load(root, 1)["t0"].numel() == 1 << 20


def test_sigterm_final_save_waiting_for_a_slot_is_bounded_by_grace(tmp_path: Path) -> None:
    # the slot is held by a save stuck in the writer (not by the interrupted frame): the final
    # save waits for it only within the grace period, and the process still exits in time
    p = _spawn(tmp_path, f"""
        import os, signal, time, torch
        from asyncckpt import Checkpointer
        from asyncckpt.roots.posix._osops import OsOps

        class Stuck(OsOps):
            def fsync(self, fd):
                time.sleep(60)

        ck = Checkpointer({str(tmp_path / "ck")!r}, timeout=30, max_pending=1, os_ops=Stuck())
        ck.install_sigterm_handler(grace_s=2, final_save=lambda c: c.save(99, {{"w": torch.ones(4)}}))
        ck.save(1, {{"w": torch.ones(4)}})
        print("sigterm", time.monotonic(), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
    """)
    out, err = _finish(p, 60)
    exit_s = time.monotonic() - float(out.split()[1])
    assert p.returncode == 1, (p.returncode, err)
    assert "final flush on SIGTERM failed" in err and "staging slot" in err, err
    assert exit_s < 2 + 1.5, exit_s


# ---------------------------------------------------------------- 1, 2. many ranks
def run_exit_ranks(
    tmp_path: Path, scenario: str, world: int, deadline: float = 60.0, extra: list[str] | None = None
) -> dict[int, dict[str, Any]]:
    root, out = tmp_path / "ck", tmp_path / "result"
    port = free_port()
    hung = launch(
        lambda r: [WORKER, scenario, str(r), str(world), str(port), str(root), str(out), *(extra or [])],
        world,
        tmp_path,
        deadline,
    )
    results = {}
    for r in range(world):
        f = Path(f"{out}.{r}.json")
        if f.exists():
            results[r] = json.loads(f.read_text())
            assert "crash" not in results[r], results[r]["crash"]
    assert not hung, f"ranks {hung} still running at the deadline:\n" + "\n".join(log_tail(tmp_path, r) for r in hung)
    return results


@pytest.mark.timing  # a 4 s save deadline on 3 ranks: missed under the parallel phase's load in CI
@pytest.mark.timeout(90)
def test_rank0_close_does_not_wait_for_a_follower_known_dead(tmp_path: Path) -> None:
    res = run_exit_ranks(tmp_path, "follower_dies", 3)
    death = res[2]["died_at"]
    for r in (0, 1):
        got = res[r]
        assert got["error"]["type"] == "SaveTimeoutError" and got["error"]["missing"] == [2], got
        print(f"rank {r}: death -> exit {got['exit_at'] - death:.2f}s (close() took {got['close_s']:.2f}s, timeout=4)")
    assert res[0]["close_s"] < 2.0, res[0]  # not another full timeout
    assert max(res[r]["exit_at"] for r in (0, 1)) - death < 4 + 2 + 2.5
    assert find_latest(tmp_path / "ck").step == 1  # type: ignore[union-attr]


@pytest.mark.timeout(90)
def test_rank0_close_stops_waiting_for_a_follower_whose_heartbeat_stopped(tmp_path: Path) -> None:
    res = run_exit_ranks(tmp_path, "follower_dies_idle", 3)
    death = res[2]["died_at"]
    for r in (0, 1):
        got = res[r]
        print(f"rank {r}: idle death -> exit {got['exit_at'] - death:.2f}s (close() {got['close_s']:.2f}s, timeout=20)")
        assert res[r]["threads"] == [], res[r]  # the heartbeat stopped with the rest
    assert res[0]["close_s"] < 12, res[0]  # the heartbeat's staleness bound, not the 20 s timeout
    assert res[1]["close_s"] < 2, res[1]


@pytest.mark.timeout(90)
def test_leader_killed_followers_end_within_seconds_saying_the_coordinator_is_gone(tmp_path: Path) -> None:
    res = run_exit_ranks(tmp_path, "leader_killed", 3)
    assert 0 not in res
    for r in (1, 2):
        got = res[r]
        death = got["leader_died_at"]
        print(f"rank {r}: rank 0 SIGKILLed -> exit {got['exit_at'] - death:.2f}s; steps {got['timings']}")
        _assert_coordinator_gone(got)
        assert got["exit_at"] - death < 5, got


@pytest.mark.timeout(90)
def test_store_host_killed_every_rank_ends_within_seconds(tmp_path: Path) -> None:
    # the launcher (torchrun) hosts the store in its own process: kill that process
    port = free_port()
    host = subprocess.Popen([sys.executable, WORKER, "store_host", "0", "2", str(port)], env=_env(),
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "up"
        marker = tmp_path / "killed"
        import threading

        def kill_when_saved() -> None:
            end = time.monotonic() + 40
            while time.monotonic() < end and len(list(tmp_path.glob("saved.*"))) < 2:
                time.sleep(0.02)
            host.kill()
            host.wait()
            marker.write_text(str(time.monotonic()))

        threading.Thread(target=kill_when_saved, daemon=True).start()
        res = run_exit_ranks(tmp_path, "host_killed", 2, extra=[str(port), str(tmp_path)])
    finally:
        host.kill()
        host.wait()
        assert host.stdout is not None
        host.stdout.close()
    killed_at = float(marker.read_text())
    for r in (0, 1):
        got = res[r]
        print(f"rank {r}: store host killed -> exit {got['exit_at'] - killed_at:.2f}s; steps {got['timings']}")
        _assert_coordinator_gone(got, leader=r == 0)
        assert got["exit_at"] - killed_at < 5, got


def _assert_coordinator_gone(got: dict[str, Any], leader: bool = False) -> None:
    err = got["save_error"]
    assert err["type"] in ("SaveTimeoutError", "SaveError"), err
    assert "coordinator is gone" in err["msg"], err
    assert "within" not in err["msg"], err
    if not leader:
        assert err["type"] == "SaveTimeoutError" and err["missing"] == [0], err
    latest = got["latest_error"]
    if not (leader and latest is None):  # rank 0 answers latest() itself; its publish may not fail yet
        assert latest["type"] == "CoordinationLost" and "coordinator is gone" in latest["msg"], latest
        assert "did not answer" not in latest["msg"], latest
    nxt = got["next_save_error"]
    assert "coordinator is gone" in nxt["msg"], nxt
    for name, t in got["timings"].items():
        assert t < 3, (name, t, got)


def test_coordination_lost_is_a_checkpoint_error() -> None:
    from asyncckpt import CheckpointError, CoordinationLost

    assert issubclass(CoordinationLost, CheckpointError) and issubclass(CoordinationLost, RuntimeError)
    assert issubclass(SaveTimeoutError, TimeoutError)
