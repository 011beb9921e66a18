"""Waits that share one deadline: each later wait gets what is left of it, never a fresh one.

Found by the audit of durations passed as points in time (and back) after the node-local
tier's acknowledgement wait (``saving._nodelocal``) read a duration as a deadline; then the
audit's open findings: the ``Deadline`` type (``threads._deadline``), the exit hook's waits,
``Publisher.drain``, ``Storage.ensure_dir``'s deadline, and the mirror's failures and URL
check (a node-local load and construction by one deadline, with real ranks:
``test_deadline_ranks.py``). Each test failed on the code before its fix.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from faultfs import FaultFS, FaultFSUnavailable, mounted, rule, unavailable_reason

import asyncckpt
from asyncckpt import Checkpointer, CheckpointReadError
from asyncckpt.checkpointer._waits import Call, Wait


def test_flush_gives_its_save_wait_only_what_the_deferred_guard_left_of_its_timeout(tmp_path: Path) -> None:
    # flush(timeout) first releases the deferred copies (a guard that may wait up to the end of
    # the timeout), then waits for the saves: that wait got the whole timeout again, so a flush
    # could take twice what it was given
    ck = Checkpointer(tmp_path / "ck")
    try:
        ck.save(1, {"w": torch.ones(4)}).result(30)
        steps = ck._waits.flush_steps(2.0)
        first = next(steps)
        assert isinstance(first, Call)
        time.sleep(1.5)  # the guard took 1.5 s of the 2 s (a deferred copy still running)
        second = steps.send(first.fn())
        assert isinstance(second, Wait)
        assert second.timeout is not None and second.timeout <= 0.6, second.timeout
        steps.close()
    finally:
        ck.close()


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFS]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("deadlines")
    try:
        with mounted(base / "backing", base / "mnt", direct_io=True) as fs:  # direct: every read reaches it
            yield fs
    except FaultFSUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.needs_root
def test_a_load_of_the_newest_step_retries_a_read_fault_only_within_the_checkpointers_timeout(
    faulty: FaultFS,
) -> None:
    # Checkpointer.load() hands load_newest its deadline (timeout from the call); load_newest
    # replaced it with its own 30 s bound, so a read fault was retried past the timeout (all 4
    # tries, 1.75 s of pauses) where load(step) stops within it
    root = faulty.path("newest")
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.ones(1024)}).result(60)
    faulty.set_rules([rule("read", glob="*/step_00000001/rank00000.safetensors", error="EIO", id="f")])
    try:
        with Checkpointer(root, timeout=0.6) as ck:
            for load in (ck.load, lambda: ck.load(1)):
                t0 = time.monotonic()
                with pytest.raises(CheckpointReadError) as ei:
                    load()
                took = time.monotonic() - t0
                assert "after 4 tries" not in str(ei.value) and took < 1.5, (took, str(ei.value))
    finally:
        faulty.clear()


@pytest.mark.timing
def test_a_commit_rename_that_lands_after_the_saves_guard_is_still_taken_back(tmp_path: Path) -> None:
    # the commit rename of step 2 takes 5 s of a 1 s save: the deadline cancels the commit, the
    # take-back waits for the rename, and the save's guard (deadline + 2.5 s) cancels that wait
    # too, with the rename still running; the failed attempt's clean-up must keep it from
    # landing a step every caller was told had failed (passed before: a regression guard)
    from asyncckpt import SaveTimeoutError
    from asyncckpt.testing import OsOps

    class SlowCommit(OsOps):
        def rename(self, src: str, dst: str) -> None:
            if os.path.basename(dst) == "step_00000002":
                time.sleep(5.0)
            super().rename(src, dst)

    root = tmp_path / "ck"
    ck = Checkpointer(root, timeout=1.0, os_ops=SlowCommit())
    try:
        ck.save(1, {"w": torch.ones(4)}).result(30)
        with pytest.raises(SaveTimeoutError):
            ck.save(2, {"w": torch.full((4,), 2.0)}).result(30)
        time.sleep(5.0)  # the job goes on; the rename lands meanwhile
    finally:
        with contextlib.suppress(Exception):
            ck.close()
    assert not (root / "step_00000002").exists(), sorted(os.listdir(root))
    assert asyncckpt.load(root)["w"][0] == 1.0  # the failed save is not what a resume loads


# ---------------------------------------------------------------------- the Deadline type
def test_a_deadline_is_built_only_from_a_duration_or_a_named_point_and_phases_share_it() -> None:
    from asyncckpt.threads._deadline import Deadline

    with pytest.raises(TypeError, match=r"Deadline\.after"):
        Deadline(5.0)  # a bare float is neither: the constructor refuses it
    for bad in ("5", None, True):
        with pytest.raises(TypeError):
            Deadline.after(bad)  # type: ignore[arg-type]
    for bad_s in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            Deadline.after(bad_s)
    with pytest.raises(TypeError):
        Deadline.at_monotonic(float("nan"))
    d = Deadline.after(2.0)
    assert 1.9 < d.remaining() <= 2.0 and not d.expired
    assert Deadline.at_monotonic(d.monotonic) == d
    assert d.sub(0.5).remaining() <= 0.5 and d.sub(60.0) == d  # a phase never outlives the whole
    assert 1.4 < d.before(0.5).remaining() <= 1.5
    gone = Deadline.after(0.0)
    time.sleep(0.01)
    assert gone.expired and gone.remaining() == 0.0 and gone.before(1.0) == gone and gone.sub(1.0) == gone


# ---------------------------------------------------------------------- the exit hook
@pytest.mark.timing
def test_the_exit_hook_waits_for_the_saves_and_the_removals_within_one_deadline(tmp_path: Path) -> None:
    # a save hung in its write (it fails by its deadline plus the guard) and the removal of
    # the step retention retired stuck on a slow disk: each wait of the exit hook got the
    # timeout plus the margin again, so the hook waited for the removal long past it
    import threading

    from asyncckpt import SaveTimeoutError
    from asyncckpt.checkpointer._runtime import MARGIN_S
    from asyncckpt.testing import OsOps

    gate = threading.Event()  # released at the end: the slow calls then go on

    class Stuck(OsOps):
        def open(self, path: str, flags: int, mode: int = 0o644) -> int:
            if "step_00000003.tmp-" in path and path.endswith(".safetensors"):
                gate.wait(30)  # a disk that stops answering mid-save
            return super().open(path, flags, mode)

        def open_dir(self, name: str, dir_fd: int | None = None) -> int:
            if ".deleting-" in name:  # the retired step's directory, opened below the root
                gate.wait(30)  # and the removal of the retired step with it
            return super().open_dir(name, dir_fd)

    timeout = 2.0
    root = tmp_path / "ck"
    ck = Checkpointer(root, timeout=timeout, keep_last=1, io_threads=4, os_ops=Stuck())
    try:
        ck.save(1, {"w": torch.ones(4)}).result(30)
        ck.save(2, {"w": torch.full((4,), 2.0)}).result(30)  # retires step 1: its removal is stuck
        stuck = ck.save(3, {"w": torch.full((4,), 3.0)})  # its write is stuck
        waits_over: list[float] = []
        t0 = time.monotonic()

        def watch() -> None:  # the waits are over once the hook stops the runtime
            while not ck._rt.stopped and time.monotonic() - t0 < 30:
                time.sleep(0.01)
            waits_over.append(time.monotonic() - t0)

        threading.Thread(target=watch, daemon=True).start()
        release = threading.Timer(timeout + MARGIN_S + 1.5, gate.set)  # after the one deadline
        release.start()
        lines, _ = ck._waits.finish_at_exit()
        release.join()
        assert waits_over and waits_over[0] < timeout + MARGIN_S + 0.8, waits_over
        assert any("step 3" in line for line in lines), lines  # the failure nobody saw is told
        assert type(stuck.exception(0)) is SaveTimeoutError  # (and seen now: the real exit hook is quiet)
    finally:
        gate.set()
        with contextlib.suppress(Exception):
            ck.close()
    assert asyncckpt.load(root)["w"][0] == 2.0  # the committed step stays, and loads


# ---------------------------------------------------------------------- Publisher.drain
@pytest.mark.needs_root
def test_a_drain_stuck_behind_a_removal_raises_timeout_error_by_its_deadline(faulty: FaultFS) -> None:
    # Publisher.drain() joined the job queue without a bound: a removal stuck on a file system
    # that does not answer held a Trainer's/Lightning's teardown for as long as it took
    from asyncckpt.integrations._publish import Publisher, drop_step

    root = faulty.path("publish")
    with Checkpointer(root) as ck:
        for s in (1, 2):
            ck.save(s, {"w": torch.full((4,), float(s))}).result(60)
    faulty.set_rules([rule("rename", glob="*/step_00000001", delay_s=4.0, count=1, id="slow-rename")])
    p = Publisher("asyncckpt-test-publisher", 1.0)
    try:
        p.then(lambda: drop_step(root, 1), "removing step 1")
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="1 publishing job"):
            p.drain()
        took = time.monotonic() - t0
        assert 0.9 < took < 2.5, took
        p.drain(timeout=30)  # the job goes on in order: it completes, and a later drain sees it
        p.raise_failure()
    finally:
        p.stop()
        faulty.clear()
    assert faulty.fired("slow-rename") == 1
    left = os.listdir(root)
    assert "step_00000001" not in left and "step_00000002" in left, left  # the removal asked for, done
    assert asyncckpt.load(root)["w"][0] == 2.0  # what was not asked to go is there


# ---------------------------------------------------------------------- Storage.ensure_dir
@pytest.mark.timing
def test_storage_ensure_dir_counts_its_time_queued_on_the_pool_against_its_deadline(tmp_path: Path) -> None:
    # Storage.ensure_dir took a duration (named deadline_s) that started when a pool thread
    # ran it: queued behind a slow write, a stale-directory wait ran that long past its phase
    import asyncio
    import errno
    from concurrent.futures import ThreadPoolExecutor

    from asyncckpt import StaleDirectoryError
    from asyncckpt.roots.posix._storage import Storage
    from asyncckpt.testing import OsOps
    from asyncckpt.threads._deadline import Deadline

    target = str(tmp_path / "stale")

    class Stale(OsOps):  # another node made it; this client's view never shows it (virtiofs)
        def mkdir(self, path: str, mode: int = 0o777) -> None:
            if path == target:
                raise FileExistsError(errno.EEXIST, "File exists", path)
            super().mkdir(path, mode)

        def lstat(self, path: str) -> os.stat_result:
            if path == target:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
            return super().lstat(path)

    pool = ThreadPoolExecutor(1)
    try:
        storage = Storage(pool, Stale(), "off")

        async def go() -> float:
            busy = asyncio.ensure_future(storage.run(time.sleep, 1.0))  # the pool's one thread, busy
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            with pytest.raises(StaleDirectoryError):
                await storage.ensure_dir(target, Deadline.after(1.5))
            await busy
            return time.monotonic() - t0

        took = asyncio.run(go())
    finally:
        pool.shutdown(wait=True)
    assert 1.3 < took < 2.0, took  # by the deadline, the second queued included


# ---------------------------------------------------------------------- the mirror
@pytest.mark.timing
def test_a_follower_whose_upload_round_times_out_names_itself_not_rank_0(tmp_path: Path) -> None:
    # the node-local tier's uploads run on every rank (_nodeupload.PartUploads); a follower's own
    # failure (here: its exchange with the others timed out) was reported as rank 0's
    from datetime import timedelta

    import torch.distributed as dist

    from asyncckpt import SaveError
    from asyncckpt._info import CheckpointInfo
    from asyncckpt.saving._nodeupload import PartUploads

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    up = PartUploads(str(tmp_path), "s3://bucket/run", {"endpoint": "http://127.0.0.1:9", "access_key_id": "k",
                     "secret_access_key": "s", "region": "us-east-1"}, rank=1, world_size=2,
                     connect=lambda: store, namespace="t", keep_last_remote=None, timeout=1.0, ranks=[0, 1],
                     lease_ttl=None)  # fmt: skip
    try:
        fut = up.committed(CheckpointInfo(3, tmp_path / "step_00000003", 0)).future
        err = fut.exception(30)  # rank 0 never takes part: this rank's round times out
    finally:
        up.stop(5.0)
    assert type(err) is SaveError, err
    assert set(err.failures) == {1}, err.failures
    assert err.failures[1].exc_type == "TimeoutError", err.failures


@pytest.mark.parametrize("url", ["s3://bucket/a/../b", "s3://bucket/run?x=1", "s3://", "s3://bucket/a//b"])
def test_a_bad_mirror_url_is_refused_with_the_registrys_error_before_the_root_is_touched(
    tmp_path: Path, url: str
) -> None:
    # check_options parsed s3:// itself and let through what the store's own parse refuses:
    # the Checkpointer made and took the root first, and refused only once the mirror was built
    from asyncckpt.roots._registry import open_root

    with pytest.raises(ValueError) as want:
        open_root(url)
    root = tmp_path / "ck"
    with pytest.raises(ValueError) as got:
        Checkpointer(root, mirror=url)
    assert str(got.value) == str(want.value)
    assert not root.exists()  # refused at the call, before anything was made
