"""The race-tolerant ensure_dir against the stale-cache fault of the virtiofs incident.

The fault is injected at the OS call (the only thing mocked): ``mkdir`` creates the
directory and then reports EEXIST, as when another client won the race, while ``stat``
keeps answering ENOENT for a window, as a stale negative dentry would."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from asyncckpt.roots.posix._ensure_dir import StaleDirectoryError, ensure_dir
from asyncckpt.roots.posix._osops import OsOps


class StaleOps(OsOps):
    """mkdir → EEXIST after creating; stat/lstat → ENOENT for ``stale_s`` afterwards."""

    def __init__(self, stale_s: float, forever: bool = False) -> None:
        self.stale_s = stale_s
        self.forever = forever
        self.hidden: dict[str, float] = {}
        self.mkdirs = 0

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        self.mkdirs += 1
        try:
            os.mkdir(path, mode)
        except FileExistsError:
            pass
        self.hidden[path] = float("inf") if self.forever else time.monotonic() + self.stale_s
        raise FileExistsError(errno.EEXIST, "File exists", path)

    def _hide(self, path: str) -> None:
        if self.hidden.get(path, 0) > time.monotonic():
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)

    def stat(self, path: str) -> os.stat_result:
        self._hide(path)
        return os.stat(path)

    def lstat(self, path: str) -> os.stat_result:
        self._hide(path)
        return os.lstat(path)


def _plain_makedirs_with_fault(path: str, stale_s: float) -> None:
    """What os.makedirs(exist_ok=True) does, through the same faulty OS calls."""
    ops = StaleOps(stale_s)
    try:
        ops.mkdir(path)
    except OSError:
        try:
            isdir = os.path.stat.S_ISDIR(ops.stat(path).st_mode)  # type: ignore[attr-defined]
        except OSError:
            isdir = False  # genericpath.isdir swallows every stat error
        if not isdir:
            raise


@pytest.mark.timing  # a sub-second bound
def test_plain_makedirs_fails_under_the_fault_and_ensure_dir_succeeds(tmp_path: Path) -> None:
    target = str(tmp_path / "ckpt" / "epoch_1_step_297" / "rng")
    os.makedirs(os.path.dirname(target))
    with pytest.raises(FileExistsError):  # the fault is real: this is the incident's traceback
        _plain_makedirs_with_fault(target, 0.2)
    ops = StaleOps(0.2)
    t0 = time.monotonic()
    ensure_dir(target + "2", timeout=5, ops=ops)
    assert os.path.isdir(target + "2") and 0.15 < time.monotonic() - t0 < 2


def test_creates_missing_parents(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c"
    ensure_dir(target)
    assert target.is_dir()
    ensure_dir(target)  # idempotent


@pytest.mark.timing  # a sub-second bound
def test_real_file_raises_not_a_directory_at_once(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    t0 = time.monotonic()
    with pytest.raises(NotADirectoryError):
        ensure_dir(f, timeout=30)
    assert time.monotonic() - t0 < 0.1
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(NotADirectoryError):
        ensure_dir(link, timeout=30)
    good = tmp_path / "linked"
    good.symlink_to(tmp_path)
    ensure_dir(good)  # a symlink to a directory is a directory


@pytest.mark.timing  # a sub-second bound
def test_entry_that_never_appears_fails_clearly_within_the_deadline(tmp_path: Path) -> None:
    ops = StaleOps(0, forever=True)
    t0 = time.monotonic()
    with pytest.raises(StaleDirectoryError, match="did not become visible") as ei:
        ensure_dir(str(tmp_path / "d"), timeout=0.5, ops=ops)
    assert isinstance(ei.value, FileExistsError) and ei.value.errno == errno.EEXIST
    assert 0.45 < time.monotonic() - t0 < 1.5
    assert ops.mkdirs == 1  # it re-stats, it does not hammer mkdir


def test_other_errors_propagate(tmp_path: Path) -> None:
    class RO(OsOps):
        def mkdir(self, path: str, mode: int = 0o777) -> None:
            raise OSError(errno.EROFS, "Read-only file system", path)

    with pytest.raises(OSError) as ei:
        ensure_dir(str(tmp_path / "new"), ops=RO())
    assert ei.value.errno == errno.EROFS
    ensure_dir(str(tmp_path), ops=RO())  # EROFS on an existing directory is success


def _race_worker(args: tuple[str, int, bool, float]) -> tuple[int, int]:
    root, rounds, robust, stale_s = args
    ok = fail = 0
    for i in range(rounds):
        path = os.path.join(root, f"round{i:04d}", "step_00000297", "rng")
        ops = StaleOps(stale_s) if stale_s else OsOps()
        try:
            if robust:
                ensure_dir(path, timeout=10, ops=ops)
            elif stale_s:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                _plain_makedirs_with_fault(path, stale_s)
            else:
                os.makedirs(path, exist_ok=True)
            ok += 1
        except OSError:
            fail += 1
    return ok, fail


@pytest.mark.timeout(120)
def test_seed_incident_eight_processes_racing(tmp_path: Path) -> None:
    procs, rounds = 8, 300
    ctx = mp.get_context("spawn")
    with ctx.Pool(procs) as pool:
        coherent = pool.map(_race_worker, [(str(tmp_path / "coherent"), rounds, True, 0.0)] * procs)
        robust = pool.map(_race_worker, [(str(tmp_path / "robust"), rounds, True, 0.01)] * procs)
        plain = pool.map(_race_worker, [(str(tmp_path / "plain"), rounds, False, 0.01)] * procs)
    n = procs * rounds
    c_fail, r_fail, p_fail = (sum(f for _, f in res) for res in (coherent, robust, plain))
    print(f"\nmkdir race, {procs} procs x {rounds} rounds: coherent ensure_dir {c_fail}/{n} failures, "
          f"stale-cache ensure_dir {r_fail}/{n}, stale-cache plain makedirs {p_fail}/{n}")
    assert c_fail == 0 and r_fail == 0
    assert p_fail > 0  # the control proves the injected fault is real
