"""Staging buffers and ``fork()``: a forked child (a DataLoader worker) gets zero pages where
the parent's staging buffers are, instead of sharing them copy-on-write.

Shared, every page the parent's next save copied into faulted and was copied while the child
lived (0.70 s instead of 0.025 s for 256 MiB on the 2-core VM; huge pages were split for
good). The tests check the mechanism, not the time: the child reads zeros where the parent's
buffer holds the last save's bytes, the parent's buffer is untouched by the child, and saves
go on through it, on 4 KiB and on huge pages.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same

from asyncckpt import Checkpointer, load

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork") or sys.platform != "linux", reason="MADV_WIPEONFORK is Linux's"
)


def _free_buffer(ck: Checkpointer) -> Any:
    """The one free staging buffer, once the settled save gave it back (bounded wait)."""
    deadline = time.monotonic() + 10.0
    while not (free := ck.staging_statistics().free):
        assert time.monotonic() < deadline, "the staging buffer never came back"
        time.sleep(0.01)
    (buffer,) = free
    return buffer


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.rand(1 << 18, generator=g) + 1.0, "b": torch.arange(1, 9)}  # no zero bytes at the head


@pytest.mark.parametrize("huge", [False, True])
def test_a_forked_child_sees_zeros_where_the_staging_buffer_is(tmp_path: Path, huge: bool) -> None:
    with Checkpointer(tmp_path, huge_pages=huge) as ck:
        ck.save(1, _state(1)).result(timeout=60)
        addr, n = _free_buffer(ck).address, 4096  # the buffer the save used (once it is back)
        parent_bytes = ctypes.string_at(addr, n)
        assert parent_bytes.strip(b"\0")  # the shard's header and data are there
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: reads the range, writes into it, reports what it read
            try:
                os.close(read)
                seen = ctypes.string_at(addr, n)
                ctypes.memset(addr, 0xAB, n)
                os.write(write, b"zeros" if seen == b"\0" * n else b"shared")
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            report = f.read()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert report == b"zeros"
        assert ctypes.string_at(addr, n) == parent_bytes  # the child's write stayed in the child
        state = _state(2)
        ck.save(2, state).result(timeout=60)  # the same buffer serves the next save
        assert ck.staging_statistics().allocations == 1
    assert_same(load(tmp_path, 2), state)
