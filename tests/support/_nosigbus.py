"""What the no-signal-death tests share (tests/test_no_sigbus.py, tests/test_no_sigbus_export.py):
a FUSE fault mount, small tmpfs mounts, a checkpoint larger than them, the CLI's storage
options, and the checks every fault ends with (the process alive, exit 1 naming the fault)."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli_util import Run, run_cli, so
from faultfs import FaultFS, mounted
from s3fixtures import data_keys

from asyncckpt import Checkpointer

BUCKET = "nosigbus"
MiB = 1024 * 1024


# ------------------------------------------------------------------------------------ fixtures
def mount_fixture() -> Any:
    """A module-scoped fixture ``mount``: a fault FS mounted for the module (skips where FUSE cannot)."""

    @pytest.fixture(scope="module")
    def mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFS]:
        base = tmp_path_factory.mktemp("fuse")
        with mounted(base / "backing", base / "mnt", skip_unavailable=True) as fs:
            yield fs

    return mount


def fs_fixture() -> Any:
    """A fixture ``fs``: the module's ``mount`` with no rules and an empty event log."""

    @pytest.fixture
    def fs(mount: FaultFS) -> Iterator[FaultFS]:
        mount.clear()
        mount.reset_events()
        yield mount
        mount.clear()

    return fs


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` at ``path`` (ENOSPC when full)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("needs root/mount: mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"needs root/mount: cannot mount tmpfs: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fresh_url() -> str:
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:10]}"


def state(step: int, mib: int = 12) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "b": torch.arange(10) + step, "step": step}


def save_local(root: Path, step: int) -> None:
    with Checkpointer(root) as ck:
        ck.save(step, state(step)).result(timeout=60)


def pushed(tmp_path: Path, endpoint: str, url: str, step: int = 5) -> None:
    """Step ``step`` saved locally (elsewhere) and pushed to ``url``."""
    src = tmp_path / f"src-{uuid.uuid4().hex[:6]}"
    save_local(src, step)
    r = run_cli("push", src, url, *so(endpoint))
    assert r.code == 0, r.err


def alive(code: int) -> None:
    """The process ended by itself, not by a signal (SIGBUS is -7)."""
    assert code >= 0, f"killed by {signal.Signals(-code).name}"


def failed_cleanly(r: Run, errname: str) -> None:
    alive(r.code)
    assert r.code == 1, (r.code, r.out, r.err)
    assert os.strerror(getattr(errno, errname)) in r.err, r.err
    assert "Traceback" not in r.err, r.err


def no_step_dirs(root: Path) -> None:
    """Nothing under ``root`` looks like (or will become) a checkpoint."""
    left = [n for n in os.listdir(root) if n.startswith("step_")] if root.exists() else []
    assert left == [], left


def manifests(endpoint: str, url: str) -> list[str]:
    return [k for k in data_keys(endpoint, url) if k.endswith("manifest.json")]
