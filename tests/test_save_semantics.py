"""The save contract: isolation, backpressure, committed steps, retention, handles, threads."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_same, make_state

import asyncckpt
from asyncckpt import Checkpointer, CheckpointInfo, SaveState, find_latest
from asyncckpt.roots.posix._osops import OsOps


class GateOps(OsOps):
    """Blocks every shard write until the test opens the gate (a real write follows)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()

    def pwrite(self, fd: int, data: object, offset: int) -> int:
        self.entered.set()
        if not self.gate.wait(30):
            raise TimeoutError("test gate never opened")
        return super().pwrite(fd, data, offset)


def test_mutation_after_save_does_not_change_what_is_written(tmp_path: Path) -> None:
    ops = GateOps()
    state = make_state(1, n=3, numel=100_000)
    expected = {k: v.clone() for k, v in state["model"].items()}
    with Checkpointer(tmp_path, os_ops=ops) as ck:
        h = ck.save(1, state)
        assert ops.entered.wait(10)
        for t in state["model"].values():
            t.mul_(-3).add_(1)  # the loop keeps training while the write is held
        state["extra"]["step"] = 99
        ops.gate.set()
        h.result(timeout=30)
        out = ck.load(1)
    assert_same(out["model"], expected)
    assert out["extra"]["step"] == 1


def test_backpressure_waits_for_a_slot_and_reuses_the_buffer(tmp_path: Path) -> None:
    ops = GateOps()
    with Checkpointer(tmp_path, max_pending=1, os_ops=ops) as ck:
        h1 = ck.save(1, make_state(1))
        assert ops.entered.wait(10)
        assert h1.state is SaveState.WRITING
        result: list[asyncckpt.SaveHandle] = []
        t = threading.Thread(target=lambda: result.append(ck.save(2, make_state(2))))
        t.start()
        t.join(0.5)
        assert t.is_alive(), "second save() must wait while max_pending saves are in flight"
        ops.gate.set()
        t.join(30)
        assert not t.is_alive()
        info2 = result[0].result(timeout=30)
        assert h1.result(timeout=30).step == 1
        assert info2.statistics is not None and info2.statistics.wait_s > 0.3
        assert ck.staging_statistics().slots == 1


def test_max_pending_two_allows_two_in_flight(tmp_path: Path) -> None:
    ops = GateOps()
    with Checkpointer(tmp_path, max_pending=2, os_ops=ops) as ck:
        h1 = ck.save(1, make_state(1))
        h2 = ck.save(2, make_state(2))  # must not block
        assert not h1.done() and not h2.done()
        ops.gate.set()
        ck.flush(timeout=30)
        assert ck.steps() == [1, 2]


def test_staging_buffer_is_reused_across_saves(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        ck.save(1, make_state(1)).result(timeout=30)
        (arena,) = ck.staging_statistics().free
        for s in range(2, 6):
            ck.save(s, make_state(s)).result(timeout=30)
        assert ck.staging_statistics().free == (arena,)


def test_committed_step_cannot_be_overwritten_but_failed_step_can_be_retried(tmp_path: Path) -> None:
    from conftest import FaultOps

    ops = FaultOps()
    with Checkpointer(tmp_path, os_ops=ops) as ck:
        ck.save(1, make_state(1)).result(timeout=30)
        with pytest.raises(ValueError, match="already committed"):
            ck.save(1, make_state(1))
        ops.fail("fsync", 5, times=1)
        with pytest.raises(asyncckpt.SaveError):
            ck.save(2, make_state(2)).result(timeout=30)
        with pytest.raises(asyncckpt.SaveError):
            ck.flush()
        ck.save(2, make_state(2)).result(timeout=30)
        assert ck.steps() == [1, 2]
    with Checkpointer(tmp_path) as ck2, pytest.raises(ValueError, match="already committed"):
        ck2.save(2, make_state(2))


def test_step_in_flight_is_refused(tmp_path: Path) -> None:
    ops = GateOps()
    with Checkpointer(tmp_path, max_pending=2, os_ops=ops) as ck:
        ck.save(3, make_state(3))
        with pytest.raises(ValueError, match="already being saved"):
            ck.save(3, make_state(3))
        ops.gate.set()


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"keep_last": 0}, ValueError),
        ({"keep_last": 1.5}, ValueError),
        ({"timeout": 0}, ValueError),
        ({"timeout": "1"}, ValueError),
        ({"max_pending": 0}, ValueError),
        ({"on_error": "ignore"}, ValueError),
        ({"direct_io": "yes"}, ValueError),
    ],
)
def test_bad_constructor_arguments(tmp_path: Path, kwargs: dict[str, object], exc: type[Exception]) -> None:
    with pytest.raises(exc):
        Checkpointer(tmp_path, **kwargs)  # type: ignore[arg-type]


def test_bad_save_arguments_and_closed(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path)
    with pytest.raises(TypeError):
        ck.save("1", {})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ck.save(True, {})
    with pytest.raises(ValueError):
        ck.save(-1, {})
    ck.close()
    ck.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        ck.save(1, {})


def test_root_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError):
        Checkpointer(f)


def test_retention_keeps_newest_complete(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, keep_last=2) as ck:
        for s in range(5):
            ck.save(s, make_state(s)).result(timeout=30)
        assert ck.steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == [".asyncckpt", "step_00000003", "step_00000004"]  # + the owner lock


def test_retention_counts_only_complete_checkpoints(tmp_path: Path) -> None:
    from conftest import FaultOps

    ops = FaultOps()
    with Checkpointer(tmp_path, keep_last=1, os_ops=ops) as ck:
        ck.save(1, make_state(1)).result(timeout=30)
        ops.fail("rename", 5, where="step_00000002")  # the commit rename of step 2 fails
        with pytest.raises(asyncckpt.SaveError):
            ck.save(2, make_state(2)).result(timeout=30)
        with pytest.raises(asyncckpt.SaveError):
            ck.flush()
        assert ck.steps() == [1]  # the failed save did not retire the only good one
        ops.clear()
        ck.save(3, make_state(3)).result(timeout=30)
        assert ck.steps() == [3]


def test_leftovers_are_removed_at_start_never_complete_ones(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        ck.save(1, make_state(1)).result(timeout=30)
    (tmp_path / "step_00000002.tmp-abc123").mkdir()
    (tmp_path / "step_00000002.tmp-abc123" / "rank00000.safetensors").write_bytes(b"partial")
    (tmp_path / "step_00000000.deleting-ff").mkdir()
    (tmp_path / "unrelated").mkdir()
    with Checkpointer(tmp_path) as ck:
        assert ck.steps() == [1]
    assert sorted(os.listdir(tmp_path)) == [".asyncckpt", "step_00000001", "unrelated"]


def test_handle_api_and_statistics(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        h = ck.save(5, make_state(5))
        info = h.result(timeout=30)
        assert h.done() and h.step == 5 and h.exception() is None and h.state is SaveState.COMMITTED
        assert isinstance(info, CheckpointInfo) and info.step == 5 and info.nbytes == 4 * 1024 * 4
        assert info.path == tmp_path / "step_00000005"
        st = h.statistics
        assert st is not None and st.nbytes == info.nbytes and st.total_s >= st.staging_s > 0
        # the walk, plan and tree JSON: a part of staging, measured (wall and the caller's CPU)
        assert st.staging_s >= st.prepare_s > 0 and st.prepare_cpu_s >= 0
        assert find_latest(tmp_path) == CheckpointInfo(5, info.path, info.nbytes, 1, info.created)
        assert ck.latest() == find_latest(tmp_path)


def test_result_timeout_raises_builtin_timeout_and_save_continues(tmp_path: Path) -> None:
    ops = GateOps()
    with Checkpointer(tmp_path, os_ops=ops) as ck:
        h = ck.save(1, make_state(1))
        with pytest.raises(TimeoutError) as ei:
            h.result(timeout=0.05)
        assert not isinstance(ei.value, asyncckpt.SaveError)
        with pytest.raises(TimeoutError):
            ck.flush(timeout=0.05)
        ops.gate.set()
        assert h.result(timeout=30).step == 1


def test_await_handle_and_aflush_from_running_loop(tmp_path: Path) -> None:
    async def main() -> None:
        async with Checkpointer(tmp_path) as ck:
            beats = 0
            h = ck.save(1, make_state(1, numel=200_000))

            async def heartbeat() -> None:
                nonlocal beats
                while not h.done():
                    beats += 1
                    await asyncio.sleep(0)

            hb = asyncio.create_task(heartbeat())
            info = await h
            await hb
            assert info.step == 1
            ck.save(2, make_state(2))
            await ck.aflush(timeout=30)
            assert ck.steps() == [1, 2]
            assert beats > 0  # the caller's loop kept running while we waited

    asyncio.run(main())


def test_cancelling_an_awaiting_task_does_not_cancel_the_save(tmp_path: Path) -> None:
    ops = GateOps()

    async def main() -> None:
        with Checkpointer(tmp_path, os_ops=ops) as ck:
            h = ck.save(1, make_state(1))
            task = asyncio.ensure_future(h._wait())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            ops.gate.set()
            assert (await h).step == 1

    asyncio.run(main())


def _asyncckpt_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncckpt")]


def test_no_thread_left_after_close(tmp_path: Path) -> None:
    before = set(_asyncckpt_threads())
    ck = Checkpointer(tmp_path)
    assert {t.name for t in _asyncckpt_threads()} >= {"asyncckpt-writer", "asyncckpt-io-0"}
    ck.save(1, make_state(1))
    ck.close()
    deadline = time.monotonic() + 10
    while set(_asyncckpt_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not (set(_asyncckpt_threads()) - before)


def test_gc_with_pending_saves_warns_and_the_save_completes(tmp_path: Path) -> None:
    ops = GateOps()
    ck = Checkpointer(tmp_path, os_ops=ops)
    h = ck.save(1, make_state(1))
    with pytest.warns(RuntimeWarning, match="garbage-collected with 1 pending"):
        del ck
        gc.collect()
    ops.gate.set()
    assert h.result(timeout=30).step == 1
    deadline = time.monotonic() + 10
    while any(t.name == "asyncckpt-writer" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_public_exports_are_pinned() -> None:
    assert sorted(asyncckpt.__all__) == sorted([
        "CheckpointCorruptError", "CheckpointError", "CheckpointInfo", "CheckpointNotFoundError",
        "CheckpointReadError", "Checkpointer", "CheckpointerStatistics", "CoordinationLost", "RankFailure",
        "RanksFailedError", "RanksTimeoutError", "RootInUseError", "RootNotWritableError",
        "SaveError", "SaveHandle", "SaveState",
        "SaveStatistics",
        "SaveTimeoutError", "StateChangedError", "__version__", "ensure_dir", "find_latest", "import_dcp", "load",
        "on_every_rank",
        # every documented error type (docs/failures.md), object-store ones included
        "ObjectStoreError", "ObjectNotFoundError", "ObjectStorePermissionError", "ObjectStoreTimeoutError",
        "ObjectStoreUnavailableError", "ObjectStoreFullError", "ObjectIntegrityError",
        "ConditionalWriteUnsupportedError", "StaleDirectoryError",
    ])
    for name in asyncckpt.__all__:
        assert getattr(asyncckpt, name) is not None, name
    # the types the object-store layer raises are the ones exported (obstore not needed to import them)
    from asyncckpt.roots.objstore import _errormap
    assert _errormap.ObjectStoreError is asyncckpt.ObjectStoreError
    for leaf in ("ObjectNotFoundError", "ObjectStorePermissionError", "ObjectStoreTimeoutError",
                 "ObjectStoreUnavailableError", "ObjectStoreFullError", "ObjectIntegrityError",
                 "ConditionalWriteUnsupportedError"):
        assert issubclass(getattr(asyncckpt, leaf), asyncckpt.ObjectStoreError), leaf
    assert issubclass(asyncckpt.ObjectStoreFullError, asyncckpt.ObjectStoreUnavailableError)
    assert issubclass(asyncckpt.ObjectStoreError, asyncckpt.CheckpointError)
    assert issubclass(asyncckpt.ObjectStoreError, OSError)
    assert issubclass(asyncckpt.ObjectNotFoundError, FileNotFoundError)
    assert issubclass(asyncckpt.ObjectStoreTimeoutError, TimeoutError)
    assert issubclass(asyncckpt.StaleDirectoryError, FileExistsError)
    assert issubclass(asyncckpt.StateChangedError, asyncckpt.SaveError)
    assert issubclass(asyncckpt.RanksTimeoutError, asyncckpt.RanksFailedError)
    assert issubclass(asyncckpt.RanksTimeoutError, TimeoutError)
    assert issubclass(asyncckpt.RanksFailedError, asyncckpt.CheckpointError)
    assert issubclass(asyncckpt.SaveTimeoutError, asyncckpt.SaveError)
    assert issubclass(asyncckpt.SaveTimeoutError, TimeoutError)
    assert issubclass(asyncckpt.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(asyncckpt.CheckpointCorruptError, asyncckpt.CheckpointError)
    assert issubclass(asyncckpt.CheckpointReadError, asyncckpt.CheckpointError)
    assert issubclass(asyncckpt.CheckpointReadError, OSError)
    assert not issubclass(asyncckpt.CheckpointReadError, asyncckpt.CheckpointCorruptError)
    assert issubclass(asyncckpt.CoordinationLost, asyncckpt.CheckpointError)
    assert issubclass(asyncckpt.CoordinationLost, RuntimeError)
    assert issubclass(asyncckpt.RootNotWritableError, PermissionError)
    assert (Path(asyncckpt.__file__).parent / "py.typed").exists()


def test_large_state_multi_chunk_roundtrip(tmp_path: Path) -> None:
    # > 16 MiB chunk size and an unaligned tail exercise the O_DIRECT chunk + truncate path
    state = {"big": torch.randn(5_000_001), "odd": torch.arange(3, dtype=torch.int8)}
    with Checkpointer(tmp_path) as ck:
        info = ck.save(1, state).result(timeout=60)
        out = ck.load(1)
    assert_same(out, state)
    assert info.statistics is not None
    assert info.statistics.direct_io in (True, False)
