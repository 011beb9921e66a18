"""Reading from the store: HEAD, whole small objects, ranged reads into buffers or a writer, listing.

:class:`Reads` adds to a :class:`~._connection.Connection` the requests that change nothing:
:meth:`~Reads.head`, :meth:`~Reads.get_object` (bytes and ETag from one GET), parallel ranged
GETs into a caller's buffer (:meth:`~Reads.get_range_into`, :meth:`~Reads.get_range_scatter`)
or handed range by range to a writer with the CRC-32C of the whole (:meth:`~Reads.get_to`),
:meth:`~Reads.crc32c_of` in bounded memory, and :meth:`~Reads.list` / :meth:`~Reads.list_dirs`.
A short object raises :class:`ObjectIntegrityError`.
"""

from __future__ import annotations

import asyncio
import builtins
import datetime as _dt
import errno
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import obstore

from ..._errors import ObjectIntegrityError
from ...format._checksum import crc32c, crc32c_combine
from ...threads._deadline import Deadline
from ._connection import Connection, MiB, as_bytes, gather_or_cancel


@dataclass(frozen=True)
class ObjectInfo:
    """One object as listed or HEADed (``key`` relative to the store's prefix)."""

    key: str
    size: int
    e_tag: str | None
    last_modified: _dt.datetime


class Reads(Connection):
    """The read requests of an object store (see the module docstring)."""

    async def head(self, key: str, deadline: float) -> ObjectInfo:
        """Size, ETag and modification time of ``key`` (:class:`ObjectNotFoundError` if absent)."""
        self._check_key(key)
        meta = await self._retrying(Deadline.at_monotonic(deadline), key, "head",
                                    lambda _b: obstore.head_async(self._store, key))
        return self._object_info(meta)

    def _object_info(self, meta: Any) -> ObjectInfo:
        """An obstore ``ObjectMeta`` as our record."""
        path = self._relative(str(meta["path"]))
        return ObjectInfo(path, int(meta["size"]), meta.get("e_tag"), meta["last_modified"])

    async def get_bytes(self, key: str, deadline: float, limit: int = 64 * MiB) -> bytes:
        """The whole of a small object (at most ``limit`` bytes)."""
        return (await self.get_object(key, deadline, limit))[0]

    async def get_object(self, key: str, deadline: float, limit: int = 64 * MiB) -> tuple[bytes, ObjectInfo]:
        """The whole of a small object (at most ``limit`` bytes) and its ETag, size and time,
        from one GET (so the ETag is that of these very bytes)."""
        self._check_key(key)

        async def fetch(_b: float) -> tuple[bytes, ObjectInfo]:
            res = await obstore.get_async(self._store, key)
            if res.meta["size"] > limit:
                raise ObjectIntegrityError(errno.EFBIG, f"object larger than {limit} bytes", self.object_url(key))
            return bytes(await res.bytes_async()), self._object_info(res.meta)

        got: tuple[bytes, ObjectInfo] = await self._retrying(Deadline.at_monotonic(deadline), key, "get", fetch)
        return got

    async def get_range_into(self, key: str, offset: int, out: memoryview, deadline: float,
                             *, range_size: int | None = None) -> None:
        """Fill ``out`` with the bytes of ``key`` from ``offset``: parallel ranged GETs of at
        most ``range_size`` (default ``part_size``), ``max_concurrency`` in flight, each
        copied once into ``out``. A short object raises :class:`ObjectIntegrityError`."""
        self._check_key(key)
        dst = as_bytes(out, writable=True)
        if offset < 0:
            raise ValueError("offset must be >= 0")
        step = range_size or self.part_size
        sem = asyncio.Semaphore(self.max_concurrency)

        async def one(start: int) -> None:
            n = min(step, dst.nbytes - start)
            async with sem:
                src = await self._get_range(key, offset + start, n, deadline)
            dst[start : start + n] = src

        await gather_or_cancel([one(s) for s in range(0, dst.nbytes, step)])

    async def get_to(self, key: str, size: int, write: Callable[[int, memoryview], None], deadline: float) -> int:
        """Read the ``size`` bytes of ``key`` by parallel ranged GETs of :meth:`stream_part`
        bytes (``max_concurrency`` in flight), handing each range to ``write(offset, data)``
        on the I/O executor as it arrives (a local file's ``pwrite``); return the CRC-32C of
        the object's bytes. Memory: ``max_concurrency`` ranges. A short object raises
        :class:`ObjectIntegrityError`; an exception of ``write`` (an ``OSError`` of the local
        disk) is raised as it is, and the ranges not yet fetched are cancelled. No call of
        ``write`` is still running when this returns or raises."""
        self._check_key(key)
        step = self.stream_part(size)
        sem = asyncio.Semaphore(self.max_concurrency)
        crcs: dict[int, int] = {}

        def put(start: int, data: memoryview) -> int:
            write(start, data)
            return crc32c(data)

        async def one(start: int) -> None:
            n = min(step, size - start)
            async with sem:
                src = await self._get_range(key, start, n, deadline)
                # cancelled (another range failed), still wait for this write to end: the caller
                # closes its file once get_to returns, and a late pwrite to a reused descriptor
                # number would land in some other file
                fut = asyncio.ensure_future(self._in_thread(put, start, src))
                try:
                    crcs[start] = await asyncio.shield(fut)
                except asyncio.CancelledError:
                    await asyncio.wait([fut])
                    if not fut.cancelled():
                        fut.exception()  # retrieved: the failure that cancelled us is reported
                    raise

        await gather_or_cancel([one(s) for s in range(0, size, step)])
        crc = 0
        for start in sorted(crcs):
            crc = crc32c_combine(crc, crcs[start], min(step, size - start))
        return crc

    async def get_range_scatter(self, key: str, offset: int, views: Sequence[memoryview], deadline: float) -> None:
        """One ranged GET of ``key`` from ``offset`` filling ``views`` in order (consecutive in
        the object), each copied into once. A short object raises :class:`ObjectIntegrityError`."""
        self._check_key(key)
        dsts = [as_bytes(v, writable=True) for v in views]
        total = sum(d.nbytes for d in dsts)
        if offset < 0:
            raise ValueError("offset must be >= 0")
        if total == 0:
            return
        src = await self._get_range(key, offset, total, deadline)
        at = 0
        for d in dsts:
            d[:] = src[at : at + d.nbytes]
            at += d.nbytes

    async def _get_range(self, key: str, start: int, n: int, deadline: float) -> memoryview:
        """One ranged GET (retried) of the ``n`` bytes of ``key`` from ``start``; a short
        answer raises :class:`ObjectIntegrityError`."""
        got = await self._retrying(Deadline.at_monotonic(deadline), key, "ranged get",
                                   lambda _b: obstore.get_range_async(self._store, key, start=start, length=n))
        src = memoryview(got)
        if src.nbytes != n:
            raise ObjectIntegrityError(errno.EIO, f"range at {start} returned {src.nbytes} bytes, expected {n}",
                                       self.object_url(key))
        return src

    async def crc32c_of(self, key: str, size: int, deadline: float) -> int:
        """CRC-32C of the first ``size`` bytes of ``key``, read in windows of bounded memory."""
        crc = 0
        # scratch of two parts, read as max_concurrency smaller ranges: memory stays bounded
        window = 2 * self.part_size
        piece = max(MiB, window // self.max_concurrency)
        buf = bytearray(min(window, size))
        for start in range(0, size, window):
            n = min(window, size - start)
            view = memoryview(buf)[:n]
            await self.get_range_into(key, start, view, deadline, range_size=piece)
            crc = await self._in_thread(crc32c, view, crc)
        return crc

    async def list(self, prefix: str, deadline: float, *, start_after: str | None = None) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (relative to the store), by key;
        with ``start_after``, only those whose key sorts after it (S3's ``start-after``:
        the store skips what lies below, empty "directories" included)."""
        self._check_key(prefix, prefix=True)

        async def run(_b: float) -> list[ObjectInfo]:
            out: list[ObjectInfo] = []
            stream = obstore.list(self._store, prefix or None, offset=start_after, chunk_size=1000)
            async for chunk in stream:
                out.extend(self._object_info(m) for m in chunk)
            return sorted(out, key=lambda i: i.key)

        result: list[ObjectInfo] = await self._retrying(Deadline.at_monotonic(deadline), prefix, "list", run)
        return result

    async def list_dirs(self, prefix: str, deadline: float) -> builtins.list[str]:
        """The names of the "directories" right below ``prefix`` (a LIST with delimiter ``/``):
        ``step_00000300`` for ``P/step_00000300/...``; unsorted."""
        self._check_key(prefix, prefix=True)

        async def run(_b: float) -> builtins.list[str]:
            res = await obstore.list_with_delimiter_async(self._store, prefix or None)
            out = []
            for p in res["common_prefixes"]:
                rel = self._relative(str(p))
                if prefix and rel.startswith(prefix):
                    rel = rel[len(prefix) :]
                out.append(rel.strip("/"))
            return out

        result: builtins.list[str] = await self._retrying(Deadline.at_monotonic(deadline), prefix, "list", run)
        return result

