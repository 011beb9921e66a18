"""``asyncckpt.roots.posix._fileio``: space reserved before the first byte, exact reads, whole writes,
every failure an ``OSError`` naming the file (real file systems: the test's disk, a full tmpfs)."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncckpt import CheckpointCorruptError
from asyncckpt.roots.posix._fileio import read_exact, reserve, write_all

MiB = 1024 * 1024


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root/mount: mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"needs root/mount: cannot mount tmpfs: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_reserve_allocates_the_whole_file(tmp_path: Path) -> None:
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        reserved = reserve(fd, 3 * MiB + 5, path)
        st = os.fstat(fd)
        assert st.st_size == 3 * MiB + 5
        if reserved:
            assert st.st_blocks * 512 >= 3 * MiB + 5  # allocated, not a sparse file
        assert reserve(fd, 0, path)
    finally:
        os.close(fd)


@pytest.mark.needs_root
def test_reserve_on_a_full_disk_is_enospc_naming_the_file_before_any_byte(tmpfs: Path) -> None:
    path = str(tmpfs / "big")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with pytest.raises(OSError) as ei:
            reserve(fd, 8 * MiB, path)
        assert ei.value.errno == errno.ENOSPC and ei.value.filename == path
        assert "reserving 8388608 bytes" in str(ei.value)
        fits = str(tmpfs / "fits")
        fd2 = os.open(fits, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            assert reserve(fd2, 1 * MiB, fits)  # tmpfs has fallocate
        finally:
            os.close(fd2)
    finally:
        os.close(fd)


def test_read_exact_and_write_all(tmp_path: Path) -> None:
    path = str(tmp_path / "f")
    data = os.urandom(MiB + 3)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, memoryview(data), 10, path)
        buf = bytearray(len(data))
        read_exact(fd, memoryview(buf), 10, path)
        assert buf == data
        with pytest.raises(CheckpointCorruptError, match="3 bytes early"):
            read_exact(fd, memoryview(bytearray(len(data) + 3)), 10, path)  # a truncated file is corrupt
    finally:
        os.close(fd)
    ro = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as ei:
            write_all(ro, memoryview(b"x"), 0, path)  # EBADF: an OSError naming the file
        assert ei.value.errno == errno.EBADF and ei.value.filename == path
    finally:
        os.close(ro)
