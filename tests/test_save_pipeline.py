"""The save pipeline: the writer streams the staged part of the arena while save() still
copies the rest, with several writes in flight; a copy that fails (or is interrupted, or
the process killed) while the writer already streams commits nothing, and save() raises the
copy's own exception as it always did.

Every wait has a deadline; the gates are events set by the real OS calls (no sleeps).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FaultOps, assert_same

import asyncckpt
from asyncckpt import Checkpointer, SaveError, find_latest, load
from asyncckpt.checkpointer._pipeline import SavePipeline
from asyncckpt.roots.posix import _osops
from asyncckpt.saving import _arena, _stagecopy, _stageprogress
from asyncckpt.threads import _cpumeter

REPO = Path(__file__).resolve().parent.parent
GATE_S = 20.0


def big_state(seed: int, n: int = 12, numel: int = 1 << 20) -> dict[str, Any]:
    """48 MiB in 4 MiB tensors: several staging groups and several 16 MiB writes."""
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(numel, generator=g) for i in range(n)}, "step": seed}


class ShardWrites(FaultOps):
    """Real OS calls; sets ``first`` at the first write into a shard file, and tracks how
    many shard writes run at once (each one slowed a little, so overlaps show)."""

    def __init__(self, slow_s: float = 0.0) -> None:
        super().__init__()
        self.first = threading.Event()
        self.slow_s = slow_s
        self._lock = threading.Lock()
        self.running = 0
        self.most = 0

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        shard = self._fd_paths.get(fd, "").endswith(".safetensors")
        if shard:
            self.first.set()
            with self._lock:
                self.running += 1
                self.most = max(self.most, self.running)
        try:
            if shard and self.slow_s:
                time.sleep(self.slow_s)
            return super().pwrite(fd, data, offset)
        finally:
            if shard:
                with self._lock:
                    self.running -= 1


class Stall:
    """Patches ``StageProgress.group_done``: after group ``at`` of the next save is copied,
    the copy waits (bounded) for the writer's first shard write, then raises ``raise_`` (if
    given) in that thread."""

    def __init__(self, ops: ShardWrites, at: int = 1, raise_: BaseException | None = None) -> None:
        self.ops, self.at, self.raise_ = ops, at, raise_
        self.streamed_before_staged: bool | None = None

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = _stageprogress.StageProgress.group_done
        stall = self

        def group_done(progress: _stageprogress.StageProgress, g: int) -> None:
            real(progress, g)
            if g == stall.at and stall.streamed_before_staged is None:
                stall.streamed_before_staged = stall.ops.first.wait(GATE_S)
                if stall.raise_ is not None:
                    raise stall.raise_

        monkeypatch.setattr(_stageprogress.StageProgress, "group_done", group_done)


def _no_leftovers(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if ".tmp-" in n or ".deleting-" in n)


def test_writer_streams_the_staged_prefix_while_save_still_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops = ShardWrites()
    stall = Stall(ops, at=1)
    stall.install(monkeypatch)
    state = big_state(1)
    with Checkpointer(tmp_path, os_ops=ops) as ck:
        info = ck.save(1, state).result(timeout=60)
    # the first shard write happened while the copy was stopped after its second group
    assert stall.streamed_before_staged is True
    assert info.statistics is not None and info.statistics.staging_s > 0
    assert_same(load(tmp_path, 1), state)


def test_at_least_two_shard_writes_in_flight(tmp_path: Path) -> None:
    ops = ShardWrites(slow_s=0.02)
    state = big_state(2)
    with Checkpointer(tmp_path, os_ops=ops) as ck:
        ck.save(1, state).result(timeout=60)
    assert ops.most >= 2, ops.most
    assert_same(load(tmp_path, 1), state)


class Boom(Exception):
    pass


class Interrupt(BaseException):
    """Stands in for KeyboardInterrupt (a BaseException, like it)."""


@pytest.mark.parametrize("exc_type", [Boom, Interrupt, KeyboardInterrupt])
def test_copy_failing_while_the_writer_streams_commits_nothing_and_raises_its_own_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc_type: type[BaseException]
) -> None:
    ops = ShardWrites()
    before = big_state(0)
    with Checkpointer(tmp_path, os_ops=ops) as ck:
        ck.save(1, before).result(timeout=60)
        ops.first.clear()
        stall = Stall(ops, at=1, raise_=exc_type("the copy failed"))
        stall.install(monkeypatch)
        with pytest.raises(exc_type, match="the copy failed"):
            ck.save(2, big_state(2))
        assert stall.streamed_before_staged is True  # the writer had begun writing step 2
        # nothing committed, nothing left behind, the slot and the step free again
        assert ck.steps() == [1]
        assert find_latest(tmp_path) is not None and find_latest(tmp_path).step == 1  # type: ignore[union-attr]
        assert _no_leftovers(tmp_path) == []
        ck.flush(timeout=30)  # the copy's failure was raised by save(): not a save failure to report
        assert ck.statistics().saves_failed == 0
        monkeypatch.undo()
        after = big_state(3)
        ck.save(2, after).result(timeout=60)
        assert ck.staging_statistics().allocations == 1  # the failed save gave its arena back
    assert_same(load(tmp_path, 2), after)
    assert_same(load(tmp_path, 1), before)


def test_writer_failure_while_save_copies_reaches_the_handle(tmp_path: Path) -> None:
    # the other direction: a write error while save() is still copying; save() returns
    # (everything staged), the handle carries the error, nothing is committed
    ops = ShardWrites()
    ops.fail("write", errno.EIO, where=".safetensors", times=1)
    with Checkpointer(tmp_path, os_ops=ops) as ck:
        h = ck.save(1, big_state(1))
        with pytest.raises(SaveError) as ei:
            h.result(timeout=60)
        assert ei.value.failures[0].errno == errno.EIO
        assert ck.steps() == []
        with pytest.raises(SaveError):
            ck.flush(timeout=30)
        ck.save(1, big_state(1)).result(timeout=60)
        assert ck.steps() == [1]


def test_kill_in_the_middle_of_staging_while_the_writer_streams_commits_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    marker = tmp_path / "streamed"
    code = textwrap.dedent(f"""
        import os, signal, threading, torch
        from asyncckpt import Checkpointer
        from asyncckpt.saving import _stageprogress
        from asyncckpt.roots.posix._osops import OsOps

        first = threading.Event()

        class Ops(OsOps):
            def open(self, path, flags, mode=0o644):
                fd = super().open(path, flags, mode)
                if path.endswith(".safetensors") and ".tmp-" in path and "step_00000002" in path:
                    self.fd = fd
                return fd

            def pwrite(self, fd, data, offset):
                n = super().pwrite(fd, data, offset)
                if fd == getattr(self, "fd", None):
                    first.set()
                return n

        real = _stageprogress.StageProgress.group_done

        def group_done(progress, g):
            real(progress, g)
            if g == 1 and getattr(ck, "armed", False) and first.wait(20):
                open({str(marker)!r}, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # mid-copy, the writer already streaming

        _stageprogress.StageProgress.group_done = group_done
        state = {{f"w{{i}}": torch.full((1 << 20,), float(i)) for i in range(12)}}
        ck = Checkpointer({str(root)!r}, os_ops=Ops())
        ck.save(1, state).result(timeout=60)
        ck.armed = True
        ck.save(2, state)
        print("not killed", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, (p.returncode, p.stdout, p.stderr)
    assert marker.exists()  # killed while the writer streamed step 2
    assert [n for n in os.listdir(root) if n.startswith("step_00000002.tmp-")]  # it had begun
    latest = find_latest(root)
    assert latest is not None and latest.step == 1
    with Checkpointer(root) as ck:  # takes the root: the leftover goes
        assert ck.steps() == [1]
        assert _no_leftovers(root) == []
        assert float(ck.load(1)["w11"][0]) == 11.0


class Fallocate(FaultOps):
    def __init__(self, err: int) -> None:
        super().__init__()
        self.err = err
        self.calls_fallocate = 0

    def fallocate(self, fd: int, length: int) -> None:
        self.calls_fallocate += 1
        raise OSError(self.err, os.strerror(self.err))


def test_buffered_shard_is_preallocated_where_supported_and_a_refusal_is_ignored(tmp_path: Path) -> None:
    ops = Fallocate(errno.EOPNOTSUPP)
    state = big_state(4)
    with Checkpointer(tmp_path, os_ops=ops, direct_io="off") as ck:
        ck.save(1, state).result(timeout=60)
    assert ops.calls_fallocate == 1  # the shard only (small files are not preallocated)
    assert_same(load(tmp_path, 1), state)


def test_preallocation_enospc_fails_the_save_before_any_write(tmp_path: Path) -> None:
    ops = Fallocate(errno.ENOSPC)
    with Checkpointer(tmp_path, os_ops=ops, direct_io="off") as ck:
        with pytest.raises(SaveError) as ei:
            ck.save(1, big_state(5)).result(timeout=60)
        f = ei.value.failures[0]
        assert f.errno == errno.ENOSPC and f.path is not None and f.path.endswith("rank00000.safetensors")
        assert not [c for c in ops.calls if c[0] == "write" and c[1].endswith(".safetensors")]
        assert ck.steps() == []
        with pytest.raises(SaveError):
            ck.flush(timeout=30)


def test_real_preallocation_leaves_the_size_alone(tmp_path: Path) -> None:
    # FALLOC_FL_KEEP_SIZE: the file's size is what was written, never the reservation
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        try:
            _osops.DEFAULT_OPS.fallocate(fd, 1 << 20)
        except OSError as e:
            pytest.skip(f"no fallocate here: {e}")
        assert os.fstat(fd).st_size == 0
        assert os.fstat(fd).st_blocks * 512 >= 1 << 20
    finally:
        os.close(fd)


def test_writer_cpu_seconds_are_reported_per_save(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        info = ck.save(1, big_state(6)).result(timeout=60)
        totals = ck.statistics()
    st = info.statistics
    assert st is not None
    # the CRC of 48 MiB alone takes CPU; a thread's CPU can never exceed the wall time it ran
    assert 0 < st.writer_cpu_s < st.total_s * (1 + 2)  # the writer loop and at most io_threads=2 I/O threads
    assert st.cpu_s_per_gib == pytest.approx(st.writer_cpu_s / (st.nbytes / 2**30))
    assert totals.writer_cpu_s == pytest.approx(st.writer_cpu_s)


def test_metered_calls_use_the_thread_clock_of_the_thread_that_ran_them() -> None:
    meter = _cpumeter.CpuMeter()
    seen: list[float] = []

    def spin() -> None:  # 50 ms of this thread's CPU, however loaded the machine is
        c0, wall_end = _cpumeter.thread_cpu(), time.monotonic() + GATE_S
        while _cpumeter.thread_cpu() - c0 < 0.05 and time.monotonic() < wall_end:
            pass

    def idle() -> None:
        seen.append(meter.seconds)
        time.sleep(0.1)

    def main_spin() -> None:  # CPU of another thread (this test's) must not count
        c0 = _cpumeter.thread_cpu()
        while _cpumeter.thread_cpu() - c0 < 0.05:
            pass

    t = threading.Thread(target=lambda: (_cpumeter.metered(spin, meter)(), _cpumeter.metered(idle, meter)()))
    t.start()
    main_spin()
    t.join(GATE_S)
    assert not t.is_alive()
    assert 0.05 <= seen[0] < 0.08  # the spin counted
    assert meter.seconds - seen[0] < 0.02  # the 0.1 s sleep did not, nor the main thread's spin


def test_public_statistics_field_is_documented() -> None:
    assert "writer_cpu_s" in (asyncckpt.SaveStatistics.__doc__ or "")


@pytest.mark.timeout(240)
def test_interrupt_at_every_line_of_the_streaming_copy_leaves_every_commit_true(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the sweep of test_interrupts, over the code that runs while the writer already streams
    from test_interrupts import At, Interrupt, _codes, _sweep

    monkeypatch.setattr(_arena, "GROUP", 64 * 1024)  # several groups from small tensors

    codes = _codes(
        [
            SavePipeline._stage_streaming,
            SavePipeline._forget_unstaged,
            _stagecopy.StagingCopier.stage,
            _stagecopy.StagingCopier._stage_cpu,
            _stagecopy._CopyRun.work,
            _stagecopy._CopyRun.close,
        ]
    )

    def state(v: float) -> dict[str, Any]:  # 3 groups: the helper thread takes part
        return {"w": [torch.full((1 << 14,), v + i) for i in range(3)], "v": v}

    fired = 0
    step = 0
    with Checkpointer(tmp_path / "ck", max_pending=1, timeout=20) as ck:
        for code, line in _sweep(codes):
            step += 1
            with At(code, line) as at:
                try:
                    ck.save(step, state(float(step)))
                except Interrupt:
                    pass
            fired += at.fired
            step += 1  # the next save finds its slot and its step at once
            ck.save(step, state(float(step))).result(timeout=20)
        ck.flush(timeout=60)
        steps = ck.steps()
    assert fired > 20, fired
    for s in steps:
        got = load(tmp_path / "ck", s)
        assert got["v"] == float(s), s
        for i in range(3):
            assert torch.equal(got["w"][i], torch.full((1 << 14,), float(s) + i)), (s, i)
    assert _no_leftovers(tmp_path / "ck") == []
