"""No signal deaths: a disk or file-system fault during a transfer is a typed error, never SIGBUS.

Every path that moves a checkpoint between a local file system and an object store - the
tier upload of a training process, ``push``, ``pull``, ``asyncckpt.remote.pull()``, and
``export`` from an ``s3://`` URL (tests/test_no_sigbus_export.py has the local export) - runs
in a real subprocess (a SIGBUS would kill it, rc -7, not pytest) under

* an EIO from the FUSE fault file system (``tests/support/faultfs.py``) on the file being read or
  written, and
* a full, small tmpfs (real ENOSPC),

against a real SeaweedFS. Each must end in a typed error (CLI exit 1 naming the fault), leave
nothing half-written that looks complete (no ``step_N`` directory, no remote manifest, no
output file), and leave the process alive; once the fault is gone the same command succeeds.
Mounting skips with a reason starting ``needs root/``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli_util import REPO, run_cli
from _nosigbus import (
    BUCKET,
    MiB,
    alive,
    failed_cleanly,
    fresh_url,
    fs_fixture,
    manifests,
    mount_fixture,
    no_step_dirs,
    pushed,
    save_local,
    so,
    state,
    tmpfs,
)
from faultfs import FaultFS, rule
from s3fixtures import proxy_fixture, require_s3, server_fixture

require_s3()

from asyncckpt import load  # noqa: E402

WORKER = str(Path(__file__).parent / "support" / "_sigbus_worker.py")
pytestmark = [pytest.mark.timeout(120), pytest.mark.needs_root]

s3 = server_fixture(BUCKET)
proxy = proxy_fixture()
mount = mount_fixture()
fs = fs_fixture()


@pytest.fixture
def url() -> str:
    return fresh_url()


def worker(mode: str, root: Path, url: str, endpoint: str, cue: Path | None = None,
           timeout: float = 100) -> tuple[int, list[dict[str, Any]], str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(REPO / "tests"),
                                                                     os.environ.get("PYTHONPATH")])))
    args = [sys.executable, WORKER, mode, str(root), url, endpoint] + ([str(cue)] if cue else [])
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    lines = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    return r.returncode, lines, r.stderr


def phase(lines: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [ln for ln in lines if ln["phase"] == name]
    assert found, (name, lines)
    return found[0]


# -------------------------------------------------------------------------------- tier upload
def test_tier_upload_read_eio_is_a_save_error_and_the_training_process_lives(
    fs: FaultFS, s3: Any, url: str, tmp_path: Path
) -> None:
    """The outsiders' 3/3: an EIO while the mirror reads a committed shard for upload killed
    the training process (rc -7). Now the upload fails with a ``SaveError`` whose cause is the
    EIO naming the file, nothing is committed on the store, and the next step uploads."""
    root = Path(fs.path(f"tier-{uuid.uuid4().hex[:6]}"))
    cue = tmp_path / "go-on"
    fs.set_rules([rule("read", glob=f"/{root.name}/step_00000001/rank00000.safetensors",
                       error="EIO", id="eio")])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with subprocess.Popen([sys.executable, WORKER, "tier", str(root), url, s3.endpoint, str(cue)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            assert proc.stdout is not None
            lines = []
            for line in proc.stdout:
                lines.append(json.loads(line))
                if lines[-1]["phase"] == "flush 1":
                    break
            else:
                proc.wait(timeout=30)
                alive(proc.returncode)
            flush1 = phase(lines, "flush 1")
            assert not flush1["ok"] and flush1["type"] == "SaveError", lines
            assert flush1["cause_errno"] == errno.EIO, flush1
            assert "rank00000.safetensors" in flush1["message"], flush1
            assert fs.fired("eio") >= 1
            assert manifests(s3.endpoint, url) == []  # nothing committed remotely
            fs.clear()
            cue.touch()
            out, err = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
    lines += [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    alive(proc.returncode)
    assert phase(lines, "save 2")["ok"] and phase(lines, "flush 2")["ok"], (lines, err[-2000:])
    assert phase(lines, "alive")["ok"]
    assert manifests(s3.endpoint, url) == ["step_00000002/manifest.json"]


def test_tier_upload_with_the_disk_full_and_a_save_that_does_not_fit(s3: Any, url: str, tmp_path: Path) -> None:
    """A full disk cannot stop an upload (it only reads); the next save that does not fit
    fails with ENOSPC as a ``SaveError``, nothing of it reaches the store, the process lives."""
    with tmpfs(tmp_path / "small", "16m") as mnt:
        root = mnt / "root"
        cue = tmp_path / "go-on"
        cue.touch()
        code, lines, err = worker("tier", root, url, s3.endpoint, cue)
        alive(code)
        assert phase(lines, "save 1")["ok"] and phase(lines, "flush 1")["ok"], (lines, err[-2000:])
        save2 = phase(lines, "save 2")
        assert not save2["ok"] and save2["type"] == "SaveError" and "ENOSPC" in save2["message"], save2
        assert phase(lines, "alive")["ok"]
        assert manifests(s3.endpoint, url) == ["step_00000001/manifest.json"]


# ------------------------------------------------------------------------------------- push
def test_push_read_eio_exits_1_commits_nothing_and_a_rerun_succeeds(fs: FaultFS, s3: Any, url: str) -> None:
    root = Path(fs.path(f"push-{uuid.uuid4().hex[:6]}"))
    save_local(root, 3)
    fs.set_rules([rule("read", glob=f"/{root.name}/step_00000003/rank00000.safetensors", error="EIO", id="eio")])
    r = run_cli("push", root, url, *so(s3.endpoint))
    failed_cleanly(r, "EIO")
    assert "rank00000.safetensors" in r.err, r.err
    assert fs.fired("eio") >= 1
    assert manifests(s3.endpoint, url) == []
    fs.clear()
    r = run_cli("push", root, url, *so(s3.endpoint))
    assert r.code == 0, r.err
    assert manifests(s3.endpoint, url) == ["step_00000003/manifest.json"]


def test_push_from_a_full_file_system_succeeds(s3: Any, url: str, tmp_path: Path) -> None:
    """A push only reads: a root whose file system is full pushes as any other."""
    with tmpfs(tmp_path / "small", "16m") as mnt:
        save_local(mnt / "root", 4)
        with open(mnt / "filler", "wb") as f:  # fill what is left
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * MiB)
        r = run_cli("push", mnt / "root", url, *so(s3.endpoint))
        assert r.code == 0, r.err
        assert manifests(s3.endpoint, url) == ["step_00000004/manifest.json"]


# ------------------------------------------------------------------------------------- pull
def test_pull_into_a_full_file_system_exits_1_before_downloading(
    s3: Any, proxy: Any, url: str, tmp_path: Path
) -> None:
    """The outsiders' 12/12: a pull onto a disk too small for the step died of SIGBUS. Now the
    space is reserved before the first byte (tmpfs has ``fallocate``): ENOSPC, exit 1, not
    one GET of the shard sent, nothing left in ROOT."""
    pushed(tmp_path, s3.endpoint, url)
    with tmpfs(tmp_path / "small", "8m") as mnt:
        r = run_cli("pull", url, mnt / "root", *so(proxy.endpoint))
        failed_cleanly(r, "ENOSPC")
        assert "rank00000.safetensors" in r.err, r.err
        no_step_dirs(mnt / "root")
        assert os.statvfs(mnt).f_bfree * os.statvfs(mnt).f_frsize > 7 * MiB  # the attempt was removed
        shard_gets = [s.path for s in proxy.seen if s.method == "GET" and s.path.endswith(".safetensors")]
        assert shard_gets == []


def test_pull_write_eio_exits_1_and_a_rerun_succeeds(fs: FaultFS, s3: Any, url: str, tmp_path: Path) -> None:
    pushed(tmp_path, s3.endpoint, url)
    root = Path(fs.path(f"pull-{uuid.uuid4().hex[:6]}"))
    fs.set_rules([rule(["read", "write"], glob=f"/{root.name}/step_00000005.tmp-*/rank00000.safetensors",
                       error="EIO", id="eio")])
    r = run_cli("pull", url, root, *so(s3.endpoint))
    failed_cleanly(r, "EIO")
    assert fs.fired("eio") >= 1
    no_step_dirs(root)
    fs.clear()
    r = run_cli("pull", url, root, *so(s3.endpoint))
    assert r.code == 0, r.err
    torch.testing.assert_close(load(root)["w"], state(5)["w"], rtol=0, atol=0)


@pytest.mark.parametrize("fault", ["EIO", "ENOSPC"])
def test_remote_pull_api_raises_a_typed_error_and_the_process_lives(
    fault: str, fs: FaultFS, s3: Any, url: str, tmp_path: Path
) -> None:
    """``asyncckpt.remote.pull()``, the README's step before a resume, in the caller's process."""
    pushed(tmp_path, s3.endpoint, url)
    with contextlib.ExitStack() as stack:
        if fault == "EIO":
            root = Path(fs.path(f"api-{uuid.uuid4().hex[:6]}"))
            fs.set_rules([rule(["read", "write"], glob=f"/{root.name}/step_*.tmp-*/rank00000.safetensors",
                               error="EIO")])
        else:
            root = stack.enter_context(tmpfs(tmp_path / "small", "8m")) / "root"
        code, lines, err = worker("pull", root, url, s3.endpoint)
        alive(code)
        got = phase(lines, "pull")
        assert not got["ok"], got
        assert got["errno"] == getattr(errno, fault), (got, err[-2000:])
        assert phase(lines, "alive")["ok"]
        no_step_dirs(root)
