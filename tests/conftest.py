"""Shared helpers: deterministic states and exact structural comparison."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncckpt.roots.posix._osops import OsOps

#: Workers, the FUSE and S3 fixtures and the test utilities live in tests/support (its
#: __init__ says what each is for): on the import path, so test files import them by name.
SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

# pytest-xdist's workers must collect the same test ids, and some ids are the repr of a set
# (tests/test_values.py), whose order follows the string hash: one hash seed for every
# worker (they inherit the environment of the process that starts them).
os.environ.setdefault("PYTHONHASHSEED", "0")


#: The test files that take longest (measured with --durations=0 on a 2-core machine), longest
#: first. Under pytest-xdist (`make test`: whole files per worker, in collection order) they
#: start first, so that no long file starts last and runs alone; the other files keep their order.
#: test_distributed.py (4 s save deadlines) starts beside files that mostly wait, not beside
#: test_sharded_state.py, the other CPU-heavy multi-rank file.
LONGEST_FIRST = (
    "test_distributed.py",
    "test_crash_loop.py",
    "test_tier.py",
    "test_s3_checkpointer.py",
    "test_sharded_state.py",
    "test_torchtitan_2d.py",
    "test_exit_paths.py",
    "test_s3_lease.py",
    "test_cli_hostile.py",
    "test_s3_traffic.py",
    "test_placement.py",
    "test_retention_readers.py",
    "test_no_sigbus_export.py",
    "test_acceptance.py",
    "test_dcp_storage.py",
    "test_objstore.py",
    "test_remote.py",
    "test_interrupts.py",
    "test_export_sharded.py",
)


def pytest_sessionfinish() -> None:
    """Stop the SeaweedFS this process shared among its object-store test modules and the
    warm server that forked its rank workers, if any."""
    s3fixtures = sys.modules.get("s3fixtures")
    if s3fixtures is not None:
        s3fixtures.close_shared()
    warm = sys.modules.get("_warm")
    if warm is not None:
        warm.close()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent when the tests run in one process
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: Any) -> None:
    """A worker that died mid-test leaves no traceback: say what the kernel saw (an OOM kill,
    a segfault) on the failure's own line, which CI's summary repeats."""
    from _crashinfo import kernel_notes

    report.longrepr = f"{report.longrepr}; {kernel_notes()}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker, put the longest files first (every worker sorts alike)."""
    if not hasattr(config, "workerinput"):
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


def make_state(seed: int, n: int = 4, numel: int = 1024) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n)},
        "extra": {"step": seed, "tag": f"s{seed}"},
    }


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact equality including container types, dict key types, dtypes and shapes."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        # compare bytes, so NaNs and -0.0 count too
        assert torch.equal(_raw(a), _raw(b)), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), (path, list(a.keys()), list(b.keys()))
        for k in a:
            assert type(k) is type(next(kk for kk in b if kk == k)), (path, k)
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b and type(a) is type(b), (path, a, b)


class FaultOps(OsOps):
    """Stands in for the OS call only: raise ``exc`` on the n-th matching operation."""

    def __init__(self) -> None:
        self.rules: list[tuple[str, str, OSError, int]] = []  # (op, path substring, error, remaining)
        self.calls: list[tuple[str, str]] = []
        self._fd_paths: dict[int, str] = {}

    def fail(self, op: str, err: int, where: str = "", times: int = 10**9) -> None:
        self.rules.append((op, where, OSError(err, os.strerror(err)), times))

    def clear(self) -> None:
        self.rules.clear()

    def _check(self, op: str, path: str) -> None:
        self.calls.append((op, path))
        for i, (rop, where, exc, left) in enumerate(self.rules):
            if rop == op and where in path and left > 0:
                self.rules[i] = (rop, where, exc, left - 1)
                raise OSError(exc.errno, exc.strerror)

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        self._check("open", path)
        fd = super().open(path, flags, mode)
        self._fd_paths[fd] = path
        return fd

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        self._check("write", self._fd_paths.get(fd, ""))
        return super().pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        self._check("fsync", self._fd_paths.get(fd, ""))
        super().fsync(fd)

    def close(self, fd: int) -> None:
        path = self._fd_paths.pop(fd, "")
        try:
            self._check("close", path)
        finally:
            super().close(fd)

    def rename(self, src: str, dst: str) -> None:
        self._check("rename", dst)
        super().rename(src, dst)

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        self._check("mkdir", path)
        super().mkdir(path, mode)

    def fsync_dir(self, path: str) -> None:
        self._check("fsync_dir", path)
        super().fsync_dir(path)


@pytest.fixture
def fault_ops() -> FaultOps:
    return FaultOps()


@pytest.fixture
def small_tmpfs(tmp_path: Any) -> Iterator[str]:
    """A real 8 MiB tmpfs (real ENOSPC); skipped where mounting is not possible."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root/mount: mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"needs root/mount: cannot mount tmpfs: {r.stderr.decode().strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
