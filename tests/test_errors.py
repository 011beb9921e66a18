"""Failures reach the caller: on the handle, once at the next save, at flush and close,
and a process that never saw a failure exits non-zero. Nothing committed is lost."""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import FaultOps, assert_same, make_state

from asyncckpt import Checkpointer, SaveError, SaveTimeoutError, find_latest, load

OPS = ["open", "write", "fsync", "close", "rename", "mkdir", "fsync_dir"]


def _assert_nothing_lost(root: Path, good_step: int, good_state: dict[str, object]) -> None:
    latest = find_latest(root)
    assert latest is not None and latest.step == good_step
    assert_same(load(root)["model"], good_state["model"])
    assert not [n for n in os.listdir(root) if ".tmp-" in n], "failed attempt left behind"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_io_error_at_each_operation_fails_the_save_cleanly(tmp_path: Path, op: str, err: int) -> None:
    ops = FaultOps()
    good = make_state(1)
    with Checkpointer(tmp_path, os_ops=ops) as ck:
        ck.save(1, good).result(timeout=30)
        where = "step_00000002"
        ops.fail(op, err, where=where)
        h = ck.save(2, make_state(2))
        exc = h.exception(timeout=30)
        assert type(exc) is SaveError, exc
        assert exc.step == 2 and list(exc.failures) == [0]
        f = exc.failures[0]
        assert f.errno == err and f.path is not None and where in f.path, f
        assert isinstance(exc.__cause__, OSError) and exc.__cause__.errno == err
        with pytest.raises(SaveError):
            ck.flush()
        _assert_nothing_lost(tmp_path, 1, good)
        ops.clear()
        ck.save(2, make_state(2)).result(timeout=30)  # the next save after the fault commits
        assert ck.steps() == [1, 2]


def test_failed_fsync_is_never_retried_on_the_same_file(tmp_path: Path) -> None:
    ops = FaultOps()
    with Checkpointer(tmp_path, os_ops=ops) as ck:
        ops.fail("fsync", errno.EIO, where="rank00000.safetensors", times=1)
        with pytest.raises(SaveError):
            ck.save(1, make_state(1)).result(timeout=30)
        fsyncs = [p for op, p in ops.calls if op == "fsync" and p.endswith("rank00000.safetensors")]
        assert len(fsyncs) == 1
        with pytest.raises(SaveError):
            ck.flush()


def test_failure_delivery_handle_next_save_once_flush_close(tmp_path: Path) -> None:
    ops = FaultOps()
    ck = Checkpointer(tmp_path, os_ops=ops)
    ops.fail("write", errno.EIO, where="step_00000001", times=1)
    h = ck.save(1, make_state(1))
    deadline = time.monotonic() + 30
    while ck.statistics().saves_failed == 0 and time.monotonic() < deadline:  # failed, and nobody looked at the handle
        time.sleep(0.01)
    assert h.done()
    with pytest.raises(SaveError) as first:  # raised once at the next save ...
        ck.save(2, make_state(2))
    assert first.value.step == 1
    h2 = ck.save(2, make_state(2))  # ... and not again
    h2.result(timeout=30)
    with pytest.raises(SaveError) as at_flush:  # flush raises it even though save() already did
        ck.flush()
    assert at_flush.value.step == 1
    ck.flush()  # only once per flush
    ops.fail("write", errno.EIO, where="step_00000003", times=1)
    ck.save(3, make_state(3)).exception(timeout=30)
    with pytest.raises(SaveError) as at_close:
        ck.close()
    assert at_close.value.step == 3
    assert ck.closed


def test_on_error_warn_keeps_training(tmp_path: Path) -> None:
    ops = FaultOps()
    with Checkpointer(tmp_path, on_error="warn", os_ops=ops) as ck:
        ops.fail("write", errno.EIO, where="step_00000001", times=1)
        ck.save(1, make_state(1))
        deadline = time.monotonic() + 30
        while ck.statistics().saves_failed == 0 and time.monotonic() < deadline:  # not looked at on its handle
            time.sleep(0.01)
        with pytest.warns(RuntimeWarning, match="step 1 failed"):
            ck.save(2, make_state(2)).result(timeout=30)
        with pytest.raises(SaveError):
            ck.flush()


def test_real_efbig_from_rlimit_fsize(tmp_path: Path) -> None:
    good = make_state(1, numel=256)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, good).result(timeout=30)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # CPython ignores SIGXFSZ
        try:
            exc = ck.save(2, {"model": {"w": torch.zeros(1 << 20)}}).exception(timeout=30)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        assert type(exc) is SaveError
        assert exc.failures[0].errno == errno.EFBIG and "rank00000.safetensors" in (exc.failures[0].path or "")
        with pytest.raises(SaveError):
            ck.flush()
        _assert_nothing_lost(tmp_path, 1, good)
        ck.save(2, {"model": {"w": torch.zeros(1 << 20)}}).result(timeout=30)


def test_real_enospc_on_small_tmpfs(small_tmpfs: str) -> None:
    root = Path(small_tmpfs) / "ck"
    good = make_state(1, numel=1024)
    with Checkpointer(root) as ck:
        ck.save(1, good).result(timeout=30)
        used_before = _used(small_tmpfs)
        exc = ck.save(2, {"model": {"w": torch.zeros(4 << 20)}}).exception(timeout=30)  # 16 MiB > 8 MiB
        assert type(exc) is SaveError and exc.failures[0].errno == errno.ENOSPC
        with pytest.raises(SaveError):
            ck.flush()
        _assert_nothing_lost(root, 1, good)
        assert _used(small_tmpfs) == used_before  # the partial attempt was removed
        ck.save(2, make_state(2, numel=1024)).result(timeout=30)


def _used(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_writer_deadline_raises_save_timeout(tmp_path: Path) -> None:
    import threading

    from asyncckpt.roots.posix._osops import OsOps

    release = threading.Event()

    class Stuck(OsOps):
        def fsync(self, fd: int) -> None:
            release.wait(20)
            super().fsync(fd)

    with Checkpointer(tmp_path, timeout=0.5, os_ops=Stuck()) as ck:
        h = ck.save(1, make_state(1))
        exc = h.exception(timeout=15)
        release.set()
        assert isinstance(exc, SaveTimeoutError) and isinstance(exc, TimeoutError)
        with pytest.raises(SaveTimeoutError):
            ck.flush()
        assert find_latest(tmp_path) is None


def _run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)


def test_process_with_unseen_failure_exits_nonzero(tmp_path: Path) -> None:
    r = _run_script(tmp_path, f"""
        import errno, torch
        from asyncckpt import Checkpointer
        from conftest import FaultOps
        ops = FaultOps()
        ops.fail("fsync", errno.EIO)
        ck = Checkpointer({str(tmp_path / "ck")!r}, os_ops=ops)
        ck.save(1, {{"w": torch.ones(3)}})
        print("exiting normally")
    """)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "exiting normally" in r.stdout
    assert "save of step 1" in r.stderr and "failed" in r.stderr


def test_process_that_saw_the_failure_exits_normally(tmp_path: Path) -> None:
    r = _run_script(tmp_path, f"""
        import errno, torch
        from asyncckpt import Checkpointer, SaveError
        from conftest import FaultOps
        ops = FaultOps()
        ops.fail("fsync", errno.EIO)
        ck = Checkpointer({str(tmp_path / "ck")!r}, os_ops=ops)
        try:
            ck.save(1, {{"w": torch.ones(3)}}).result(30)
        except SaveError:
            print("handled")
    """)
    assert r.returncode == 0, r.stderr
    assert "handled" in r.stdout


def test_pending_save_is_finished_at_exit(tmp_path: Path) -> None:
    r = _run_script(tmp_path, f"""
        import torch
        from asyncckpt import Checkpointer
        ck = Checkpointer({str(tmp_path / "ck")!r})
        ck.save(1, {{"w": torch.ones(1 << 20)}})
    """)
    assert r.returncode == 0, r.stderr
    assert find_latest(tmp_path / "ck") is not None
