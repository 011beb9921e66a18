"""Statistics, the on_commit hook, the INFO log line, and the SIGTERM handler."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import FaultOps, make_state

from asyncckpt import Checkpointer, CheckpointInfo, SaveError, find_latest


def test_statistics_totals_and_last(tmp_path: Path) -> None:
    ops = FaultOps()
    with Checkpointer(tmp_path, os_ops=ops) as ck:
        infos = [ck.save(s, make_state(s)).result(timeout=30) for s in (1, 2, 3)]
        ops.fail("fsync", errno.EIO, where="step_00000004", times=1)
        ck.save(4, make_state(4)).exception(timeout=30)
        with pytest.raises(SaveError):
            ck.flush()
        st = ck.statistics()
    assert st.saves_committed == 3 and st.saves_failed == 1
    assert st.bytes_committed == sum(i.nbytes for i in infos)
    assert st.last == infos[-1].statistics
    assert st.total_s == pytest.approx(sum(i.statistics.total_s for i in infos))  # type: ignore[union-attr]
    assert st.blocking_s > 0 and st.write_s > 0 and st.fsync_s > 0 and st.commit_s > 0


def test_on_commit_runs_on_the_writer_thread_and_its_errors_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[tuple[int, str]] = []

    def hook(info: CheckpointInfo) -> None:
        seen.append((info.step, threading.current_thread().name))
        if info.step == 2:
            raise RuntimeError("metrics backend down")

    with caplog.at_level(logging.INFO, logger="asyncckpt"), Checkpointer(tmp_path, on_commit=hook) as ck:
        ck.save(1, make_state(1)).result(timeout=30)
        ck.save(2, make_state(2)).result(timeout=30)
        ck.save(3, make_state(3)).result(timeout=30)
        ck.flush()
    deadline = time.monotonic() + 5
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [s for s, _ in seen] == [1, 2, 3]
    assert all(name == "asyncckpt-writer" for _, name in seen)
    assert "on_commit callback raised" in caplog.text
    assert sum("committed step" in r.getMessage() for r in caplog.records) == 3


def test_library_configures_no_handlers() -> None:
    assert logging.getLogger("asyncckpt").handlers == []


def _spawn(tmp_path: Path, body: str) -> subprocess.Popen[str]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _sigterm_when_ready(p: subprocess.Popen[str]) -> tuple[str, str]:
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "ready", line
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    return out, err


def test_sigterm_flushes_takes_final_save_and_dies_by_the_signal(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    p = _spawn(tmp_path, f"""
        import time, torch
        from asyncckpt import Checkpointer
        ck = Checkpointer({str(root)!r})
        ck.install_sigterm_handler(grace_s=30, final_save=lambda c: c.save(99, {{"w": torch.full((4,), 99.0)}}))
        ck.save(1, {{"w": torch.ones(1 << 20)}})
        print("ready", flush=True)
        time.sleep(60)
        print("not reached")
    """)
    out, err = _sigterm_when_ready(p)
    assert p.returncode == -signal.SIGTERM, (p.returncode, err)
    assert "not reached" not in out
    latest = find_latest(root)
    assert latest is not None and latest.step == 99
    assert sorted(os.listdir(root)) == [".asyncckpt", "step_00000001", "step_00000099"]


def test_sigterm_with_failed_final_flush_exits_nonzero(tmp_path: Path) -> None:
    p = _spawn(tmp_path, f"""
        import errno, time, torch
        from asyncckpt import Checkpointer
        from conftest import FaultOps
        ops = FaultOps()
        ops.fail("fsync", errno.EIO)
        ck = Checkpointer({str(tmp_path / "ck")!r}, os_ops=ops)
        ck.install_sigterm_handler(grace_s=30)
        ck.save(1, {{"w": torch.ones(16)}})
        print("ready", flush=True)
        time.sleep(60)
    """)
    _, err = _sigterm_when_ready(p)
    assert p.returncode == 1, (p.returncode, err)
    assert "final flush on SIGTERM failed" in err and "step 1" in err


def test_sigterm_handler_needs_main_thread_and_valid_grace(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(ValueError):
            ck.install_sigterm_handler(grace_s=0)
        errors: list[BaseException] = []

        def other() -> None:
            try:
                ck.install_sigterm_handler()
            except ValueError as e:
                errors.append(e)

        t = threading.Thread(target=other)
        t.start()
        t.join(10)
        assert errors and "main thread" in str(errors[0])
