"""Faults through the real kernel path: a FUSE file system (``tests/support/faultfs.py``) that fails,
shortens, slows down or hides operations, under unmodified library code.

* the directory race of the virtiofs incident: ``mkdir`` answers EEXIST while ``stat``
  cannot see the directory for a while (8 processes racing on one path per round);
* an entry that never appears: ``StaleDirectoryError`` within the deadline;
* EIO on the shard write, EIO on fsync, ENOSPC, EIO on the commit rename: a clean
  ``SaveError``, nothing committed, the previous checkpoint loads, the next save commits;
* short writes: the checkpoint is complete and its checksums match;
* slow storage: the training loop keeps running, ``save()`` blocks only when
  ``max_pending`` saves are in flight, and staging memory stays bounded.

Everything that mounts skips, with a reason starting ``needs root/FUSE:``, where FUSE
cannot be used (not root, no /dev/fuse, mfusepy or libfuse missing, the mount fails).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same, make_state
from faultfs import FaultFS, FaultFSUnavailable, _mounted, rule, unavailable_reason

from asyncckpt import Checkpointer, SaveError, find_latest, load
from asyncckpt.format._checksum import crc32c
from asyncckpt.format._layout import META_DIR
from asyncckpt.roots.posix._ensure_dir import StaleDirectoryError, ensure_dir

WORKER = str(Path(__file__).parent / "support" / "_fault_worker.py")
STEP_LEAF = "step_00000297/rng"

# rounds of the directory race through FUSE: default run and the long (-m slow) variant
FUSE_ROUNDS, FUSE_LANES = 64, 8
FUSE_ROUNDS_SLOW, FUSE_LANES_SLOW = 500, 8
STALE_MIN_S, STALE_MAX_S = 0.05, 2.0


# ------------------------------------------------------------------------------------ fixtures
def _mount(base: Path, name: str, **kw: Any) -> FaultFS:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    fs = FaultFS(base / f"{name}-backing", base / name, **kw)
    try:
        fs.mount()
    except FaultFSUnavailable as e:
        pytest.skip(str(e))
    return fs


def _unmount(fs: FaultFS) -> None:
    proc = fs.proc
    fs.unmount()
    assert not _mounted(fs.mount_point), f"{fs.mount_point} is still mounted"
    assert proc is None or proc.poll() is not None, "the faultfs server is still running"


@pytest.fixture(scope="module")
def mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFS]:
    fs = _mount(tmp_path_factory.mktemp("fuse"), "mnt")
    try:
        yield fs
    finally:
        _unmount(fs)


@pytest.fixture
def fs(mount: FaultFS) -> Iterator[FaultFS]:
    """The shared mount with no rules and an empty event log."""
    mount.clear()
    mount.reset_events()
    yield mount
    mount.clear()


def _backing(fs: FaultFS, *parts: str) -> str:
    return os.path.join(fs.backing, *parts)


# ------------------------------------------------------------------------- the tool itself
@pytest.mark.needs_root
def test_rules_fire_by_path_glob_count_window_and_pid(fs: FaultFS) -> None:
    d = fs.path("rules")
    os.mkdir(d)
    fs.set_rules([rule("write", glob="/rules/a*.bin", error="EIO", count=1, id="once")])
    with open(os.path.join(d, "a1.bin"), "wb", buffering=0) as f:
        with pytest.raises(OSError) as ei:
            f.write(b"x" * 10)
        assert ei.value.errno == errno.EIO
        assert f.write(b"y" * 10) == 10  # count=1: fired once
    with open(os.path.join(d, "b.bin"), "wb", buffering=0) as f:
        assert f.write(b"z") == 1  # the glob does not match
    assert fs.fired("once") == 1

    # a time window: inactive, active, over
    fs.set_rules([rule("fsync", path="/rules/w", error="EIO", after_s=1.0, for_s=1.5, id="win")])
    fd = os.open(os.path.join(d, "w"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.fsync(fd)
        time.sleep(1.5)
        with pytest.raises(OSError) as ei:
            os.fsync(fd)
        assert ei.value.errno == errno.EIO
        time.sleep(1.5)
        os.fsync(fd)
    finally:
        os.close(fd)

    # only the named process sees the fault (pid from fuse_get_context, resolved to its tgid)
    code = textwrap.dedent(
        f"""
        import os, sys
        sys.stdin.readline()
        try:
            with open({os.path.join(d, "p.bin")!r}, "ab", buffering=0) as f:
                f.write(b"child")
        except OSError as e:
            sys.exit(e.errno)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    assert child.stdin is not None
    try:
        fs.set_rules([rule("write", path="p.bin", error="ENOSPC", pid=child.pid, id="pid")])
        child.stdin.write(b"go\n")
        child.stdin.close()
        assert child.wait(timeout=30) == errno.ENOSPC
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    with open(os.path.join(d, "p.bin"), "ab", buffering=0) as f:
        assert f.write(b"parent") == 6  # this process is not the named one
    assert [e["pid"] for e in fs.events() if e["id"] == "pid"] == [child.pid]

    # rename errors, slow operations
    fs.set_rules([rule("rename", path="/rules/r2", error="EIO"), rule("write", path="slow", delay_s=0.3)])
    Path(d, "r1").write_text("r")
    with pytest.raises(OSError) as ei:
        os.rename(os.path.join(d, "r1"), os.path.join(d, "r2"))
    assert ei.value.errno == errno.EIO
    t0 = time.monotonic()
    Path(d, "slow").write_bytes(b"s")
    assert time.monotonic() - t0 >= 0.28


# -------------------------------------------------------------------------- directory races
def _stale_s(i: int) -> float:
    """Stale windows spread log-uniformly over [0.05 s, 2 s] across rounds (deterministic)."""
    u = (i * 0.6180339887498949) % 1.0
    return float(STALE_MIN_S * (STALE_MAX_S / STALE_MIN_S) ** u)


def _race(
    base: Path, root: str, rounds: int, lanes: int, modes: list[str], timeout: float = 600
) -> dict[str, list[dict[str, Any]]]:
    params = base / f"race-{time.monotonic_ns()}.json"
    out = str(params.with_suffix(".out"))
    params.write_text(
        json.dumps({"root": root, "procs": 8, "rounds": rounds, "lanes": lanes, "modes": modes, "out": out})
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run(
        [sys.executable, WORKER, "race", str(params)], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    results: dict[str, list[dict[str, Any]]] = {}
    for mode in modes:
        results[mode] = [rec for p in range(8) for rec in json.loads(Path(f"{out}.{mode}.{p}.json").read_text())]
        assert len(results[mode]) == 8 * rounds
        assert not [rec for rec in results[mode] if "barrier" in rec], "the racers were not released together"
    return results


def _failures(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rec for rec in recs if not rec["ok"]]


@pytest.mark.timeout(120)
def test_coherent_fs_race_8_processes_x_500_rounds(tmp_path: Path) -> None:
    """On one kernel the race cannot fail: 0 failures for ensure_dir, and for plain makedirs too."""
    t0 = time.monotonic()
    res = _race(tmp_path, str(tmp_path / "coherent"), 500, 1, ["ensure_dir", "makedirs"])
    ens, plain = _failures(res["ensure_dir"]), _failures(res["makedirs"])
    print(
        f"\ncoherent FS, 8 procs x 500 barrier-released rounds: ensure_dir {len(ens)}/4000 failures, "
        f"plain os.makedirs {len(plain)}/4000 ({time.monotonic() - t0:.1f}s)"
    )
    assert ens == [] and plain == []


def _fuse_race(fs: FaultFS, base: Path, tag: str, rounds: int, lanes: int) -> None:
    modes = ["ensure_dir", "makedirs"]
    os.makedirs(fs.path("race", tag))
    # the leaf of each round is stale: mkdir creates it and says EEXIST, stat hides it for stale_s
    fs.set_rules(
        [
            rule("mkdir", path=f"/race/{tag}/{mode}/r{i:04d}/{STEP_LEAF}", stale_s=_stale_s(i), id=f"{mode}/{i}")
            for mode in modes
            for i in range(rounds)
        ]
    )
    t0 = time.monotonic()
    res = _race(base, fs.path("race", tag), rounds, lanes, modes)
    took = time.monotonic() - t0
    fired = {e["id"] for e in fs.events()}
    assert all(f"ensure_dir/{i}" in fired for i in range(rounds)), "the stale window did not fire in every round"
    ens, plain = _failures(res["ensure_dir"]), _failures(res["makedirs"])
    over = [rec["s"] - _stale_s(rec["round"]) for rec in res["ensure_dir"]]
    plain_types = sorted({f"{rec['type']}[{errno.errorcode.get(rec['errno'], rec['errno'])}]" for rec in plain})
    print(
        f"\nFUSE stale window {STALE_MIN_S}-{STALE_MAX_S}s, 8 procs x {rounds} rounds ({lanes} lanes, {took:.1f}s): "
        f"ensure_dir {len(ens)}/{8 * rounds} failures (slowest call {max(over):+.2f}s past its window), "
        f"plain os.makedirs(exist_ok=True) {len(plain)}/{8 * rounds} failures {plain_types}"
    )
    assert ens == [], ens[:5]
    assert plain, "the control did not fail: the injected fault is not real"
    assert any(rec["type"] == "FileExistsError" for rec in plain)  # the incident's traceback
    # a call returns soon after its window closed (backoff is capped at 0.5 s x jitter 2; slack for load)
    assert max(over) < 3.0, max(over)
    # the directories really exist on the backing store
    assert all(os.path.isdir(_backing(fs, "race", tag, "ensure_dir", f"r{i:04d}", STEP_LEAF)) for i in range(rounds))


@pytest.mark.needs_root
@pytest.mark.timeout(120)
def test_fuse_stale_window_race_ensure_dir_never_fails_plain_makedirs_does(fs: FaultFS, tmp_path: Path) -> None:
    _fuse_race(fs, tmp_path, "short", FUSE_ROUNDS, FUSE_LANES)


@pytest.mark.slow
@pytest.mark.needs_root
@pytest.mark.timeout(900)
def test_fuse_stale_window_race_8_processes_x_500_rounds(
    fs: FaultFS, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow variant (about 2 minutes): run with -m slow")
    _fuse_race(fs, tmp_path, "long", FUSE_ROUNDS_SLOW, FUSE_LANES_SLOW)


@pytest.mark.timing  # a 1 s window
@pytest.mark.needs_root
def test_entry_that_never_appears_raises_stale_directory_error_within_the_deadline(fs: FaultFS) -> None:
    os.mkdir(fs.path("never"))
    fs.set_rules([rule("mkdir", path="/never/d", stale_s=3600, id="never")])
    target = fs.path("never", "d", "e")
    t0 = time.monotonic()
    with pytest.raises(StaleDirectoryError, match="did not become visible") as ei:
        ensure_dir(target, timeout=1.0)
    took = time.monotonic() - t0
    assert ei.value.errno == errno.EEXIST and ei.value.filename == fs.path("never", "d")
    assert 0.9 < took < 1.0 + 1.0, took
    assert os.path.isdir(_backing(fs, "never", "d"))  # it exists; this client just cannot see it
    assert fs.fired("never") == 1  # it re-stats; it does not hammer mkdir


@pytest.mark.timing  # a 2 s window
@pytest.mark.needs_root
def test_save_whose_attempt_directory_never_appears_fails_within_the_timeout(fs: FaultFS) -> None:
    root = fs.path("ck_stale")
    good = make_state(1)
    with Checkpointer(root, timeout=2.0) as ck:
        ck.save(1, good).result(timeout=30)
        fs.set_rules([rule("mkdir", glob="/ck_stale/step_00000002.tmp-*", stale_s=3600, id="stale")])
        t0 = time.monotonic()
        exc = ck.save(2, make_state(2)).exception(timeout=30)
        took = time.monotonic() - t0
        assert isinstance(exc, SaveError) and exc.step == 2 and list(exc.failures) == [0], exc
        print(f"\n{type(exc).__name__} after {took:.2f}s: {exc}")
        assert took < 2.0 + 2.0, took
        with pytest.raises(SaveError):
            ck.flush()
        fs.clear()
        assert ck.latest().step == 1  # type: ignore[union-attr]
        ck.save(3, make_state(3)).result(timeout=30)
    assert find_latest(root).step == 3  # type: ignore[union-attr]


@pytest.mark.needs_root
def test_save_whose_attempt_directory_never_appears_names_eexist_and_the_path(fs: FaultFS) -> None:
    root = fs.path("ck_stale_named")
    with Checkpointer(root, timeout=2.0) as ck:
        fs.set_rules([rule("mkdir", glob="/ck_stale_named/step_00000001.tmp-*", stale_s=3600)])
        exc = ck.save(1, make_state(1)).exception(timeout=30)
        fs.clear()
        with pytest.raises(SaveError):
            ck.flush()
    assert isinstance(exc, SaveError)
    f = exc.failures[0]
    assert f.exc_type == "StaleDirectoryError" and f.errno == errno.EEXIST, f
    assert f.path is not None and f.path.startswith(os.path.join(root, "step_00000001.tmp-")), f


# ------------------------------------------------------------------------------ save faults
FAULTS = {
    "write-EIO": (rule("write", path="rank00000.safetensors", error="EIO", id="f"), errno.EIO, "rank00000.safetensors"),
    "fsync-EIO": (rule("fsync", path="rank00000.safetensors", error="EIO", id="f"), errno.EIO, "rank00000.safetensors"),
    "write-ENOSPC": (rule("write", path="step_00000002", error="ENOSPC", id="f"), errno.ENOSPC, "step_00000002"),
    "commit-rename-EIO": (rule("rename", glob="*/step_00000002", error="EIO", id="f"), errno.EIO, "step_00000002"),
}


@pytest.mark.needs_root
@pytest.mark.parametrize("fault", list(FAULTS))
def test_io_fault_fails_the_save_cleanly_and_the_next_save_commits(fs: FaultFS, fault: str) -> None:
    fault_rule, err, where = FAULTS[fault]
    name = f"ck_{fault}"
    root = fs.path(name)
    good = make_state(1, numel=64 * 1024)
    with Checkpointer(root, timeout=10) as ck:
        info = ck.save(1, good).result(timeout=30)
        fs.set_rules([fault_rule])
        t0 = time.monotonic()
        exc = ck.save(2, make_state(2, numel=64 * 1024)).exception(timeout=30)
        took = time.monotonic() - t0
        assert fs.fired("f") >= 1, "the fault did not fire"
        assert type(exc) is SaveError and exc.step == 2 and list(exc.failures) == [0], exc
        f = exc.failures[0]
        assert f.errno == err and f.path is not None and f.path.startswith(root) and where in f.path, f
        assert errno.errorcode[err] in str(exc) and f.path in str(exc)
        assert took < 10, took
        with pytest.raises(SaveError):
            ck.flush()
        # no marker: nothing of step 2 anywhere, not even a leftover attempt on the backing store
        assert sorted(n for n in os.listdir(_backing(fs, name)) if n != META_DIR) == ["step_00000001"]
        assert ck.latest().step == 1  # type: ignore[union-attr]
        assert_same(ck.load(1)["model"], good["model"])
        fs.clear()
        ck.save(2, make_state(2, numel=64 * 1024)).result(timeout=30)
        assert ck.steps() == [1, 2]
    print(f"\n{fault}: {exc} (O_DIRECT on this FUSE mount: {info.statistics.direct_io})")  # type: ignore[union-attr]


def _shard_crc_matches(root: str, step: int) -> None:
    step_dir = os.path.join(root, f"step_{step:08d}")
    manifest = json.loads(Path(step_dir, "manifest.json").read_text())
    for entry in manifest["files"]:
        data = Path(step_dir, entry["name"]).read_bytes()
        assert len(data) == entry["size"] and crc32c(data) == entry["crc32c"], entry["name"]


@pytest.mark.needs_root
@pytest.mark.parametrize(
    ("direct_io", "short", "align"),
    [("auto", 0.5, 4096), ("off", 0.37, None)],
    ids=["O_DIRECT-aligned-short-writes", "buffered-unaligned-short-writes"],
)
def test_short_writes_are_looped_and_the_checkpoint_is_complete(
    tmp_path: Path, direct_io: str, short: float, align: int | None
) -> None:
    # a direct_io mount: the kernel hands each write to the file system as it is and passes
    # its short answer back (with page-cache I/O or O_DIRECT through the page cache mount,
    # the kernel may merge, split, or turn a short O_DIRECT write into EIO)
    fs = _mount(tmp_path, "dio", direct_io=True)
    try:
        root = fs.path("ck")
        state = make_state(7, numel=300 * 1024 + 3)
        with Checkpointer(root, timeout=30, direct_io=direct_io) as ck:  # type: ignore[arg-type]
            fs.set_rules([rule("write", path="/ck/step_", short=short, short_align=align, id="short")])
            info = ck.save(1, state).result(timeout=30)
        shorts = fs.fired("short")
        fs.clear()
        assert shorts >= 3, f"only {shorts} short writes happened"
        assert info.statistics is not None and info.statistics.direct_io == (direct_io == "auto")
        _shard_crc_matches(_backing(fs, "ck"), 1)
        assert_same(load(root, 1, verify=True), state)
        print(f"\ndirect_io={direct_io}: {shorts} short writes, checkpoint complete, checksums match")
    finally:
        _unmount(fs)


# ----------------------------------------------------------------------------- slow storage
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.needs_root
@pytest.mark.timeout(120)
def test_slow_storage_does_not_stall_the_training_loop_and_memory_stays_bounded(fs: FaultFS) -> None:
    max_pending, every, steps = 2, 3, 24
    fs.set_rules([rule("write", path="/slow/", delay_s=(0.2, 0.5), id="slow")])
    model = {"w": torch.zeros(64 * 1024), "b": torch.zeros(64 * 1024)}
    step_s_idle: list[float] = []
    step_s_busy: list[float] = []
    calls: list[dict[str, Any]] = []
    arenas: set[int] = set()  # the addresses of the staging buffers seen
    free_max = 0
    rss0 = _rss()
    with Checkpointer(fs.path("slow"), timeout=60, max_pending=max_pending, keep_last=2) as ck:
        handles: list[Any] = []
        for step in range(steps):
            busy = any(not h.done() for h in handles)
            t0 = time.perf_counter()
            for t in model.values():  # the "training step"
                t.add_(1.0)
            time.sleep(0.01)
            (step_s_busy if busy else step_s_idle).append(time.perf_counter() - t0)
            staging = ck.staging_statistics()
            free_max = max(free_max, staging.slots)
            arenas.update(a.address for a in staging.free)
            if step % every == every - 1:
                in_flight = sum(not h.done() for h in handles)
                t1 = time.perf_counter()
                handles.append(ck.save(step, {"model": model, "step": step}))
                calls.append({"in_flight": in_flight, "call_s": time.perf_counter() - t1})
        infos = [h.result(timeout=60) for h in handles]
        ck.flush()
        arenas.update(a.address for a in ck.staging_statistics().free)
        assert ck.staging_statistics().allocations <= max_pending
        assert ck.steps() == [infos[-2].step, infos[-1].step]
    rss_growth = _rss() - rss0
    for c, info in zip(calls, infos, strict=True):
        assert info.statistics is not None
        c["wait_s"] = info.statistics.wait_s
    blocked = [c for c in calls if c["wait_s"] > 0.05]
    summary = (
        f"\nslow storage ({fs.fired('slow')} writes delayed 0.2-0.5s), {len(calls)} saves, max_pending={max_pending}: "
        f"saves in flight at each call {[c['in_flight'] for c in calls]}, "
        f"wait_s {[round(c['wait_s'], 2) for c in calls]}; "
        f"step time median idle {statistics.median(step_s_idle) * 1e3:.1f} ms, "
        f"during saves {statistics.median(step_s_busy) * 1e3:.1f} ms ({len(step_s_busy)}/{steps} steps); "
        f"arenas {len(arenas)}, RSS growth {rss_growth / 2**20:.1f} MiB"
    )
    print(summary)
    assert fs.fired("slow") >= len(calls)
    # the loop kept running while saves were in flight
    assert len(step_s_busy) >= steps // 2, summary
    assert statistics.median(step_s_busy) < 0.1, summary  # a 10 ms step, not held up by the writes
    # save() waited only when max_pending saves were already in flight ...
    assert all(c["in_flight"] >= max_pending for c in blocked), summary
    assert all(c["wait_s"] < 0.05 for c in calls if c["in_flight"] < max_pending), summary
    # ... and that did happen: backpressure instead of unbounded staging
    assert blocked, summary
    assert max(c["in_flight"] for c in calls) <= max_pending, summary
    # staging memory is bounded: never more than max_pending arenas, reused across saves
    assert free_max <= max_pending and len(arenas) <= max_pending, summary
    assert rss_growth < 64 * 2**20, summary
