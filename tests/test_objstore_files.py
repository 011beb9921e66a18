"""Files to and from the store without mapping them: ``ObjectStore.put_from`` / ``get_to``.

Against a real SeaweedFS: an upload reads its source part by part as the upload takes them
(memory stays ``max_concurrency + 1`` parts whatever the size, measured with tracemalloc), its
CRC-32C is that of the bytes sent, and a read error of the source is raised as the very
``OSError`` it was - not retried, not turned into a store error - with no incomplete multipart
upload left behind. A download hands each range to a writer and returns the CRC-32C of the
whole; the writer's ``OSError`` comes back as it was.
"""

from __future__ import annotations

import asyncio
import errno
import os
import time
import tracemalloc
import uuid
from typing import Any

import pytest
from s3fixtures import get, opts, require_s3, server_fixture

require_s3()

from asyncckpt.format._checksum import crc32c  # noqa: E402
from asyncckpt.roots.objstore._client import ObjectStore  # noqa: E402
from asyncckpt.roots.objstore._connection import MAX_PARTS, MiB  # noqa: E402
from asyncckpt.roots.posix._fileio import read_exact, reserve, write_all  # noqa: E402

BUCKET = "objfiles"
PART = 5 * MiB
pytestmark = pytest.mark.timeout(90)

s3 = server_fixture(BUCKET)


def store(endpoint: str, **kw: Any) -> tuple[ObjectStore, str]:
    url = f"s3://{BUCKET}/t-{uuid.uuid4().hex[:8]}"
    return ObjectStore(url, opts(endpoint), part_size=PART, **kw), url


def deadline(s: float = 60) -> float:
    return time.monotonic() + s


def test_stream_part_stays_small_and_within_the_part_limit() -> None:
    st = ObjectStore("s3://b/p")
    assert st.stream_part(0) == 16 * MiB and st.stream_part(100 * 2**30) == 16 * MiB
    big = 500 * 2**30
    part = st.stream_part(big)
    assert part % MiB == 0 and -(-big // part) <= MAX_PARTS and part < 16 * MiB * 4
    assert ObjectStore("s3://b/p", part_size=PART).stream_part(1) == PART


def test_put_from_reads_part_by_part_in_bounded_memory(s3: Any, tmp_path: Any) -> None:
    data = os.urandom(41 * MiB + 123)
    path = tmp_path / "src"
    path.write_bytes(data)
    st, url = store(s3.endpoint, max_concurrency=2)
    fd = os.open(path, os.O_RDONLY)
    reads = []

    def read(offset: int, view: memoryview) -> None:
        reads.append((offset, view.nbytes))
        read_exact(fd, view, offset, str(path))

    tracemalloc.start()
    try:
        info = asyncio.run(st.put_from("obj", len(data), read, deadline()))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        os.close(fd)
    assert info.crc32c == crc32c(data) and info.size == len(data) and info.parts == 9
    assert get(s3.endpoint, url, "obj") == data
    assert reads == [(o, min(PART, len(data) - o)) for o in range(0, len(data), PART)]  # once each, in order
    assert peak < (2 + 2) * PART, peak / MiB  # max_concurrency + 1 parts (+ slack), never the file


def test_put_from_raises_the_sources_error_untouched_and_leaves_no_upload(s3: Any) -> None:
    st, _ = store(s3.endpoint, max_concurrency=2)
    size = 30 * MiB
    calls = []
    failure = OSError(errno.EIO, "Input/output error (reading it to upload)", "/disk/rank00000.safetensors")

    def read(offset: int, view: memoryview) -> None:
        calls.append(offset)
        if offset >= 2 * PART:
            raise failure
        view[:] = b"\1" * view.nbytes

    with pytest.raises(OSError) as ei:
        asyncio.run(st.put_from("obj", size, read, deadline()))
    assert ei.value is failure  # not an ObjectStoreError, not retried
    assert calls == [0, PART, 2 * PART]
    assert asyncio.run(st.list("", deadline())) == []
    assert asyncio.run(st.list_uploads("", deadline())) == []


def test_put_from_of_one_part_and_of_nothing(s3: Any) -> None:
    st, url = store(s3.endpoint)
    for size in (0, 1, PART):
        data = os.urandom(size)

        def read(offset: int, view: memoryview, data: bytes = data) -> None:
            view[:] = data[offset : offset + view.nbytes]

        info = asyncio.run(st.put_from(f"o{size}", size, read, deadline()))
        assert info.crc32c == crc32c(data) and info.parts == 1
        assert get(s3.endpoint, url, f"o{size}") == data


def test_get_to_writes_every_range_and_returns_the_crc(s3: Any, tmp_path: Any) -> None:
    data = os.urandom(23 * MiB + 7)
    st, _ = store(s3.endpoint, max_concurrency=3)
    asyncio.run(st.put_file("obj", memoryview(data), deadline()))
    path = str(tmp_path / "dst")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        reserve(fd, len(data), path)
        got = asyncio.run(st.get_to("obj", len(data), lambda o, v: write_all(fd, v, o, path), deadline()))
    finally:
        os.close(fd)
    assert got == crc32c(data)
    with open(path, "rb") as f:
        assert f.read() == data

    failure = OSError(errno.ENOSPC, "No space left on device", path)

    def full(offset: int, view: memoryview) -> None:
        raise failure

    with pytest.raises(OSError) as ei:
        asyncio.run(st.get_to("obj", len(data), full, deadline()))
    assert ei.value is failure


def test_get_to_returns_only_once_no_write_is_running(s3: Any) -> None:
    """A failed range cancels the others, but a write already running is waited for: the
    caller closes its file when get_to raises, and a late pwrite to a reused descriptor
    number would land in another file."""
    st, _ = store(s3.endpoint, max_concurrency=3)
    asyncio.run(st.put_file("obj", memoryview(os.urandom(3 * PART)), deadline()))
    running: list[int] = []
    finished: list[int] = []

    def write(offset: int, view: memoryview) -> None:
        if offset == PART:
            until = time.monotonic() + 5
            while 0 not in running and time.monotonic() < until:  # fail while range 0 is being written
                time.sleep(0.01)
            raise OSError(errno.ENOSPC, "No space left on device", "/disk/f")
        running.append(offset)
        time.sleep(1.0)  # a slow disk: still writing when the other range fails
        finished.append(offset)

    async def go() -> tuple[list[int], list[int]]:
        with pytest.raises(OSError):
            await st.get_to("obj", 3 * PART, write, deadline())
        return list(running), list(finished)  # at once (asyncio.run's end would wait for the threads)

    started, done = asyncio.run(go())
    assert 0 in started and sorted(done) == sorted(started)
