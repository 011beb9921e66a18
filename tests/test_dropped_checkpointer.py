"""A Checkpointer dropped without close(): with nothing pending it gives its root back before
the drop returns; with saves pending it finishes them in the background and says so.
Also: an ``s3://`` root without the ``s3`` extra names the extra to install."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import make_state

from asyncckpt import Checkpointer, RootInUseError
from asyncckpt.format._layout import META_DIR
from asyncckpt.roots.posix._osops import OsOps
from asyncckpt.roots.posix._ownership import RECORD


def _asyncckpt_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncckpt")]


def test_a_dropped_checkpointer_releases_its_root_before_the_drop_returns(tmp_path: Path) -> None:
    # the outsider's reproduction: load, drop, remove the root; 20 rounds (the release used to
    # run on a thread of its own after the caller moved on: owner.json vanished under rmtree)
    before = set(_asyncckpt_threads())
    for i in range(20):
        root = tmp_path / f"ck{i}"
        with Checkpointer(root) as ck:
            ck.save(1, make_state(1)).result(30)
        Checkpointer(root).load(1)  # dropped right here
        assert not (root / META_DIR / RECORD).exists(), f"round {i}: the owner record outlived the drop"
        with Checkpointer(root):  # the root is free at once: no RootInUseError
            pass
        shutil.rmtree(root)  # nothing of the dropped one runs any more
        assert not root.exists()
    assert not set(_asyncckpt_threads()) - before, "a thread of a dropped Checkpointer outlived the drop"


def test_a_dropped_checkpointer_with_a_pending_save_finishes_it_then_releases(tmp_path: Path) -> None:
    gate = threading.Event()

    class Held(OsOps):
        def fsync(self, fd: int) -> None:
            gate.wait(30)
            super().fsync(fd)

    ck = Checkpointer(tmp_path, os_ops=Held())
    h = ck.save(1, make_state(1))
    with pytest.warns(RuntimeWarning, match=r"1 pending save\(s\).*finish(es|) in the background"):
        del ck
        gc.collect()
    with pytest.raises(RootInUseError):  # still its root: the save is still running
        Checkpointer(tmp_path)
    gate.set()
    assert h.result(timeout=30).step == 1
    end = time.monotonic() + 20
    while (tmp_path / META_DIR / RECORD).exists() and time.monotonic() < end:
        time.sleep(0.02)
    with Checkpointer(tmp_path) as again:  # released once the save finished
        assert again.steps() == [1]


def test_dropped_on_its_own_writer_thread_is_released_without_deadlock(tmp_path: Path) -> None:
    # the last reference dies in on_commit, on the writer thread: the release cannot join that
    # thread from itself, so it happens right after, from a thread of its own
    box: list[Checkpointer] = []
    done = threading.Event()

    def on_commit(info: object) -> None:
        box.clear()  # the Checkpointer's last reference
        done.set()

    ck = Checkpointer(tmp_path, on_commit=on_commit)
    box.append(ck)
    h = ck.save(1, make_state(1))
    del ck
    assert h.result(timeout=30).step == 1
    assert done.wait(30)
    end = time.monotonic() + 20
    while (tmp_path / META_DIR / RECORD).exists() and time.monotonic() < end:
        time.sleep(0.02)
    with Checkpointer(tmp_path) as again:
        assert again.steps() == [1]


def test_an_s3_root_without_the_s3_extra_says_what_to_install(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['obstore'] = None\n"  # as if obstore were not installed
        "import asyncckpt\n"
        "for kw in ({}, {'mirror': 's3://bucket/p'}):\n"
        "    root = 's3://bucket/p' if not kw else sys.argv[1]\n"
        "    try:\n"
        "        asyncckpt.Checkpointer(root, **kw)\n"
        "    except ImportError as e:\n"
        "        print(type(e).__name__, e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 2, r.stdout + r.stderr[-2000:]
    for line in lines:
        assert line.startswith(("ImportError", "ModuleNotFoundError")), line
        assert "pip install 'asyncckpt[s3]'" in line, line
