"""No signal deaths in ``asyncckpt export``, to a local file and from an ``s3://`` URL.

The command runs as a real process (a SIGBUS would show as rc -7) under a FUSE EIO
(``tests/support/faultfs.py``) on the output (of a local export and of one from a store) or on
the checkpoint it reads, and with the output on a full, small tmpfs. Each ends in exit 1 with a
message naming the fault and the file, no output file and no temporary left beside it;
an I/O error reading the checkpoint does not mark the step bad (it says nothing about the
checkpoint), and once the fault is gone the same export succeeds.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from _cli_util import Run, run_cli
from _nosigbus import BUCKET, MiB, failed_cleanly, fresh_url, fs_fixture, mount_fixture, pushed, save_local, so, tmpfs
from faultfs import FaultFS, rule
from s3fixtures import require_s3, server_fixture

require_s3()

pytestmark = [pytest.mark.timeout(120), pytest.mark.needs_root]

s3 = server_fixture(BUCKET)
mount = mount_fixture()
fs = fs_fixture()


def export(root: str | Path, out: Path, *extra: str) -> Run:
    return run_cli("export", root, "--to", out, *extra, timeout=90)


def nothing_beside(out: Path) -> None:
    """Neither the output nor any temporary (a ``.OUT.tmp-*`` file, a pulled step) is left."""
    left = sorted(n for n in os.listdir(out.parent) if n.startswith((out.name, f".{out.name}", ".asyncckpt-export")))
    assert left == [], left


def step_is_fine(root: Path, step: int) -> None:
    """``ls`` shows ``step`` complete and not marked bad."""
    r = run_cli("ls", root, "--json")
    assert r.code == 0, r.err
    (row,) = [d for d in json.loads(r.out) if d["step"] == step]
    assert row["status"] == "complete" and row["bad"] is None, row


# ------------------------------------------------------------------------------ local export
def test_export_to_a_full_file_system_exits_1_before_writing(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    save_local(root, 1)
    with tmpfs(tmp_path / "small", "8m") as mnt:
        out = mnt / "model.safetensors"
        r = export(root, out)
        failed_cleanly(r, "ENOSPC")
        assert "model.safetensors" in r.err, r.err
        nothing_beside(out)
        assert os.statvfs(mnt).f_bfree * os.statvfs(mnt).f_frsize > 7 * MiB
    step_is_fine(root, 1)


def test_export_write_eio_exits_1_and_leaves_nothing(fs: FaultFS, tmp_path: Path) -> None:
    root = tmp_path / "ck"
    save_local(root, 1)
    outdir = Path(fs.path(f"out-{uuid.uuid4().hex[:6]}"))
    outdir.mkdir()
    out = outdir / "model.safetensors"
    fs.set_rules([rule(["write", "fsync"], glob=f"/{outdir.name}/.model.safetensors.tmp-*", error="EIO", id="eio")])
    r = export(root, out)
    failed_cleanly(r, "EIO")
    assert fs.fired("eio") >= 1
    nothing_beside(out)
    step_is_fine(root, 1)
    fs.clear()
    assert export(root, out).code == 0


def test_export_read_eio_is_an_io_error_not_a_corrupt_step(fs: FaultFS, tmp_path: Path) -> None:
    """An EIO reading the shard's data is exit 1 naming the file; the step is not marked bad
    (it was a CheckpointCorruptError and a bad mark before), and exports once the disk answers."""
    root = Path(fs.path(f"ck-{uuid.uuid4().hex[:6]}"))
    save_local(root, 1)
    out = tmp_path / "model.safetensors"
    # the first read (the header, with the kernel's read-ahead) passes: the data's reads fail
    fs.set_rules([rule("read", glob=f"/{root.name}/step_00000001/rank00000.safetensors", error="EIO", skip=1,
                       id="eio")])
    r = export(root, out)
    failed_cleanly(r, "EIO")
    assert "rank00000.safetensors" in r.err and "corrupt" not in r.err.lower(), r.err
    assert fs.fired("eio") >= 1
    nothing_beside(out)
    fs.clear()
    step_is_fine(root, 1)
    assert export(root, out).code == 0


# ---------------------------------------------------------------------------- s3:// export
@pytest.mark.parametrize("fault", ["EIO", "ENOSPC"])
def test_export_from_a_url_under_a_fault_exits_1_and_leaves_nothing(
    fault: str, fs: FaultFS, s3: Any, tmp_path: Path
) -> None:
    """A remote export streams the store's objects into OUT: a fault of OUT's disk (EIO
    writing it, or no room for it) is exit 1, and neither OUT nor a temporary is left."""
    url = fresh_url()
    pushed(tmp_path, s3.endpoint, url, step=2)
    with contextlib.ExitStack() as stack:
        if fault == "EIO":
            outdir = Path(fs.path(f"rout-{uuid.uuid4().hex[:6]}"))
            outdir.mkdir()
            written = f"/{outdir.name}/.model.safetensors.tmp-*"
            fs.set_rules([rule(["write", "fsync"], glob=written, error="EIO", id="eio")])
        else:
            outdir = stack.enter_context(tmpfs(tmp_path / "small", "8m"))
        out = outdir / "model.safetensors"
        r = export(url, out, *so(s3.endpoint))
        failed_cleanly(r, fault)
        nothing_beside(out)
        if fault == "EIO":
            assert fs.fired("eio") >= 1
            fs.clear()
            r = export(url, out, *so(s3.endpoint))
            assert r.code == 0, r.err
