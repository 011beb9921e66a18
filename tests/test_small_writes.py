"""The small files of a save (tree, manifest) are each one call on the I/O pool, and the
shard's end (truncate, fsync, close) one more: a hop between the writer loop and a pool thread
costs more than these calls on a busy machine (issue 32). Failures keep their exact errors,
name the file, leak no descriptor and lose nothing committed."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import FaultOps, assert_same, make_state

from asyncckpt import Checkpointer, SaveError, load
from asyncckpt.roots.posix._file_writes import CHUNK
from asyncckpt.roots.posix._osops import OsOps
from asyncckpt.roots.posix._storage import Storage
from asyncckpt.threads._iopool import IOPool


class CountingPool(IOPool):
    """An I/O pool that counts the calls submitted to it."""

    def __init__(self) -> None:
        super().__init__(2, "test-io")
        self.submitted = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def _write(storage: Storage, path: str, data: bytes) -> Any:
    async def go() -> Any:
        return await storage.write_bytes(path, data)

    return asyncio.run(go())


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("size", [0, 1, 4097, CHUNK])
def test_a_small_file_is_one_call_on_the_pool(tmp_path: Path, size: int) -> None:
    pool = CountingPool()
    try:
        storage = Storage(pool, OsOps(), "auto")
        data = os.urandom(size)
        res = _write(storage, str(tmp_path / "f"), data)
        assert (tmp_path / "f").read_bytes() == data
        assert res.size == size and not res.direct
        import crc32c

        assert res.crc32c == crc32c.crc32c(data)
        assert pool.submitted == 1
        with pytest.raises(FileExistsError):  # created exclusively
            _write(storage, str(tmp_path / "f"), b"again")
    finally:
        pool.shutdown()


@pytest.mark.parametrize("op", ["write", "fsync"])
def test_a_failed_small_write_names_the_file_and_closes_it(tmp_path: Path, op: str) -> None:
    pool = CountingPool()
    ops = FaultOps()
    try:
        storage = Storage(pool, ops, "auto")
        ops.fail(op, errno.EIO, where="f", times=1)
        before = _open_fds()
        with pytest.raises(OSError) as got:
            _write(storage, str(tmp_path / "f"), b"x" * 100)
        assert got.value.errno == errno.EIO and got.value.filename == str(tmp_path / "f")
        assert _open_fds() == before
        assert [c for c, _ in ops.calls].count(op) == 1  # a failed fsync is never retried
    finally:
        pool.shutdown()


FAULTS = [
    ("write", "manifest"),
    ("fsync", "manifest"),
    ("fsync", "rank00000.json"),
    ("close", "rank00000.safetensors"),
    ("fsync", "rank00000.safetensors"),
]


@pytest.mark.parametrize(("op", "where"), FAULTS)
def test_a_save_whose_small_file_or_shard_end_fails_loses_nothing(tmp_path: Path, op: str, where: str) -> None:
    ops = FaultOps()
    with Checkpointer(tmp_path, os_ops=ops) as ck:
        ck.save(1, make_state(1)).result(timeout=30)
        before = _open_fds()
        ops.fail(op, errno.EIO, where=where, times=1)
        with pytest.raises(SaveError) as got:
            ck.save(2, make_state(2)).result(timeout=30)
        assert "EIO" in str(got.value) or "Input/output error" in str(got.value), str(got.value)[:2000]
        assert where in str(got.value)
        assert _open_fds() == before
        with pytest.raises(SaveError):
            ck.flush()
        ops.clear()
        assert ck.steps() == [1]
        assert_same(load(tmp_path, 1), make_state(1))
        ck.save(3, make_state(3)).result(timeout=30)  # the next save commits
        assert ck.steps() == [1, 3]


@pytest.mark.parametrize(
    "size",
    [4096, 2**20 - 1, 2**20, 2**20 + 1, 2**20 + CHUNK, 2**20 + CHUNK + 4097, 3 * CHUNK],
)
def test_a_shard_of_any_size_is_written_whole_with_its_crc(tmp_path: Path, size: int) -> None:
    """Sizes around the first (probe) piece and the chunk edges: every byte lands where it
    belongs, the CRC is the file's, and O_DIRECT was used where the file system takes it."""
    import mmap

    import crc32c

    from asyncckpt.format._header import round_up

    pool = IOPool(2, "test-io")
    buf = mmap.mmap(-1, round_up(size))
    try:
        data = os.urandom(size)
        buf[:size] = data
        storage = Storage(pool, OsOps(), "auto")

        async def go() -> Any:
            return await storage.write_file(str(tmp_path / "shard"), memoryview(buf), size)

        res = asyncio.run(go())
        assert (tmp_path / "shard").read_bytes() == data
        assert res.size == size and res.crc32c == crc32c.crc32c(data)
    finally:
        pool.shutdown()
        buf.close()
