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
from faultfs import FaultFS, mounted, rule

import asyncckpt
from asyncckpt import Checkpointer, CheckpointReadError


@pytest.mark.timing
@pytest.mark.needs_root
def test_flush_gives_its_save_wait_only_what_the_deferred_guard_left_of_its_timeout(
    faulty: FaultFS, tmp_path: Path
) -> None:
    # flush(timeout) first releases the deferred copies (a guard that may wait up to the end of
    # the timeout), then waits for the saves: that wait got the whole timeout again, so a flush
    # could take twice what it was given. Here the deferred copy reads a weight mapped from a
    # file whose first page takes 1.5 s to come in (a slow file system), and the save's write
    # never ends (its shard's open stalls): the guard takes 1.5 s of flush(2.0), and the save
    # wait gets the 0.5 s left (with the bug 2 s more: a flush of 3.5 s)
    import mmap
    import threading

    from asyncckpt.testing import OsOps

    gate = threading.Event()

    class StalledWrite(OsOps):
        def open(self, path: str, flags: int, mode: int = 0o644) -> int:
            if "step_00000001.tmp-" in path and path.endswith(".safetensors"):
                gate.wait(30)  # a disk that stops answering mid-save, until the test ends
            return super().open(path, flags, mode)

    n = 256 * 1024  # 1 MiB of float32
    weights = faulty.path("weights.bin")
    with open(weights, "wb") as f:
        f.write(torch.arange(n, dtype=torch.float32).numpy().tobytes())
    fd = os.open(weights, os.O_RDONLY)
    try:  # a private (copy-on-write) mapping: its pages are read from the file at first touch
        mapped = mmap.mmap(fd, n * 4, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    w = torch.nn.Parameter(torch.frombuffer(mapped, dtype=torch.float32))
    opt = torch.optim.SGD([w], lr=0.1)
    faulty.set_rules([rule("read", glob="*/weights.bin", delay_s=1.5, count=1, id="slow-page")])
    ck = Checkpointer(tmp_path / "ck", os_ops=StalledWrite())
    try:
        t0 = time.monotonic()
        ck.save(1, {"w": w}, until=opt)  # returns at once: the copy of w runs in the background
        t1 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"save\(s\) still running") as ei:
            ck.flush(2.0)
        took = time.monotonic() - t1
        # the slow page was read by the background copy, after save() returned: the guard
        # inside flush() waited for it (at least 1.5 s - (t1 - t0))
        assert t1 - t0 < 0.5 and faulty.fired("slow-page") == 1, (t1 - t0, faulty.fired("slow-page"))
        assert took < 2.7, (took, str(ei.value))
        gate.set()
        ck.flush(30)  # the save goes on and commits
    finally:
        gate.set()
        faulty.clear()
        with contextlib.suppress(Exception):
            ck.close()
        del opt, w
        with contextlib.suppress(BufferError):
            mapped.close()  # nothing of the mount stays mapped (it is unmounted at the module's end)
    assert torch.equal(asyncckpt.load(tmp_path / "ck")["w"], torch.arange(n, dtype=torch.float32))


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFS]:
    base = tmp_path_factory.mktemp("deadlines")
    # direct: every read reaches it
    with mounted(base / "backing", base / "mnt", direct_io=True, skip_unavailable=True) as fs:
        yield fs


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


def test_call_by_returns_the_calls_outcome_or_gives_up_on_a_call_that_does_not_return_by_its_deadline() -> None:
    import threading

    from asyncckpt.threads._deadline import CallTimeout, Deadline, call_by

    assert call_by(lambda: 7, Deadline.after(5.0), "t") == 7
    with pytest.raises(KeyError):  # the call's own error, as it raised it
        call_by(lambda: {}["x"], Deadline.after(5.0), "t")

    def own_timeout() -> None:
        raise TimeoutError("the call's own")

    with pytest.raises(TimeoutError, match="the call's own") as ei:
        call_by(own_timeout, Deadline.after(5.0), "t")
    assert type(ei.value) is TimeoutError  # never taken for the deadline's
    gate = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(CallTimeout, match="blocked"):
        call_by(lambda: gate.wait(30), Deadline.after(0.2), "blocked")
    took = time.monotonic() - t0
    gate.set()  # the call left behind ends on its own thread
    assert 0.15 < took < 5.0, took
    with pytest.raises(CallTimeout):  # a deadline already passed: no wait at all
        call_by(lambda: time.sleep(1.0), Deadline.after(0.0), "late")


# ---------------------------------------------------------------------- the exit hook
_EXIT_JOB = """
import atexit, sys, threading, time
import torch
from asyncckpt import Checkpointer
from asyncckpt.testing import OsOps

root, timeout, margin, limit = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
gate = threading.Event()  # released after the one deadline: the slow calls then go on
hook_started = threading.Event()

class Stuck(OsOps):
    def open(self, path, flags, mode=0o644):
        if "step_00000003.tmp-" in path and path.endswith(".safetensors"):
            gate.wait(30)  # a disk that stops answering mid-save
        return super().open(path, flags, mode)

    def open_dir(self, name, dir_fd=None):
        if ".deleting-" in name:  # the retired step's directory, opened below the root
            gate.wait(30)  # and the removal of the retired step with it
        return super().open_dir(name, dir_fd)

ck = Checkpointer(root, timeout=timeout, keep_last=1, io_threads=4, os_ops=Stuck())
ck.save(1, {"w": torch.ones(4)}).result(30)
ck.save(2, {"w": torch.full((4,), 2.0)}).result(30)  # retires step 1: its removal is stuck
ck.save(3, {"w": torch.full((4,), 3.0)})  # its write is stuck; the job ends without close()

def release():
    hook_started.wait(60)
    time.sleep(timeout + margin + 1.5)  # past the one deadline
    gate.set()

def watch():  # the hook marks the Checkpointer closed once its waits are over, then stops it
    hook_started.wait(60)
    late = time.monotonic() + limit
    while not ck.closed:
        if late is not None and time.monotonic() > late:
            print(f"still-waiting {time.monotonic():.3f}", flush=True)
            late = None
        time.sleep(0.002)
    print(f"waits-over {time.monotonic():.3f}", flush=True)

threading.Thread(target=release, daemon=True).start()
threading.Thread(target=watch, daemon=True).start()

@atexit.register  # after asyncckpt's own hook: so it runs right before it
def before_the_hook():
    print(f"hook-starts {time.monotonic():.3f}", flush=True)
    hook_started.set()
"""


@pytest.mark.timing
def test_the_exit_hook_waits_for_the_saves_and_the_removals_within_one_deadline(tmp_path: Path) -> None:
    # a save hung in its write (it fails by its deadline plus the guard) and the removal of
    # the step retention retired stuck on a slow disk: each wait of the exit hook got the
    # timeout plus the margin again, so the hook waited for the removal long past it. A real
    # process that saves and exits without close(); it prints when the hook starts and when
    # its waits are over (the Checkpointer reads closed)
    import subprocess
    import sys

    from asyncckpt.checkpointer._runtime import MARGIN_S

    timeout = 2.0
    limit = timeout + MARGIN_S + 0.8  # the one deadline, and a loaded machine's slack
    root = tmp_path / "ck"
    script = tmp_path / "job.py"
    script.write_text(_EXIT_JOB)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent), *sys.path]))
    r = subprocess.run([sys.executable, str(script), str(root), str(timeout), str(MARGIN_S), str(limit)],
                       capture_output=True, text=True, timeout=90, env=env)  # fmt: skip
    said = dict(line.split() for line in r.stdout.splitlines() if line.split()[0] in
                ("hook-starts", "waits-over", "still-waiting"))  # fmt: skip
    assert "still-waiting" not in said, f"the exit hook still waited {limit}s after it started: {r.stderr[-3000:]}"
    assert {"hook-starts", "waits-over"} <= set(said), (r.returncode, r.stdout, r.stderr[-3000:])
    waits_over = float(said["waits-over"]) - float(said["hook-starts"])
    assert waits_over < limit, (waits_over, r.stderr[-3000:])
    # the failure nobody saw is told, and the process exits non-zero
    failed = [line for line in r.stderr.splitlines() if "save of step 3" in line]
    assert failed and "failed: SaveTimeoutError" in failed[0], r.stderr[-3000:]
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
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
def test_a_follower_that_hears_no_upload_verdict_names_rank_0_and_its_own_failure(tmp_path: Path) -> None:
    # the node-local tier's uploads run on every rank (_nodeupload.PartUploads); a follower sends
    # its outcome to rank 0 and waits for the verdict. Rank 0 never answers here, and the
    # follower's own upload failed (nothing listens on the store's port): both are named, each
    # as its rank's (an earlier protocol named only rank 0, then only the follower)
    from datetime import timedelta

    import torch.distributed as dist

    from asyncckpt import SaveError
    from asyncckpt._info import CheckpointInfo
    from asyncckpt.saving._nodeupload import PartUploads

    (tmp_path / "step_00000003").mkdir()
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    up = PartUploads(str(tmp_path), "s3://bucket/run", {"endpoint": "http://127.0.0.1:9", "access_key_id": "k",
                     "secret_access_key": "s", "region": "us-east-1"}, rank=1, world_size=2,
                     connect=lambda probe=True: store, namespace="t", keep_last_remote=None, timeout=1.0, ranks=[0, 1],
                     lease_ttl=None)  # fmt: skip
    t0 = time.monotonic()
    try:
        fut = up.committed(CheckpointInfo(3, tmp_path / "step_00000003", 0)).future
        err = fut.exception(30)  # rank 0 never takes part
    finally:
        up.stop(5.0)
    took = time.monotonic() - t0
    assert type(err) is SaveError, err
    assert set(err.failures) == {0, 1}, err.failures
    assert err.failures[0].exc_type == "TimeoutError" and "did not publish" in err.failures[0].message, err.failures
    assert err.failures[1].exc_type != "TimeoutError", err.failures  # its own upload's error, as it was
    assert took < 1.0 + 5.0 + 3.0, took  # the round's timeout and the grace for rank 0's verdict


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
