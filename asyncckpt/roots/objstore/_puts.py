"""Uploading an object, from a caller's buffer or a local file, checked after it is stored.

:class:`Puts` adds to the reads and deletes of a store:

* :meth:`~Puts.put_file` - an object from a caller's buffer with no copy: a multipart upload
  with ``part_size`` parts, ``max_concurrency`` in flight (bounded memory: obstore sends
  straight from the buffer), CRC-32C of the source computed alongside.
* :meth:`~Puts.put_from` - an object from a local file, read (``pread``) part by part as the
  upload takes them: memory stays ``max_concurrency + 1`` parts of ``stream_part`` bytes, a
  read error is raised as the ``OSError`` it is (never a SIGBUS, as an ``mmap`` of the file
  would turn it into; never retried).

Afterwards the stored size is checked (``verify="size"``) or the object read back and its
CRC-32C compared (``verify="readback"``). obstore cannot send ``x-amz-checksum-crc32c`` (it
offers only SHA-256 and CRC-64/NVME), so the server does not check our CRC-32C; the manifest's
CRC-32C, verified on load, is the end-to-end check. A failed or timed-out put aborts every
incomplete multipart upload of its key (keys are attempt-unique, so no other writer's upload
can match).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import obstore

from ..._errors import ObjectIntegrityError, ObjectStoreError
from ...format._checksum import crc32c, crc32c_combine
from ...threads._deadline import Deadline
from ._connection import as_bytes
from ._deletes import Deletes
from ._reads import Reads

log = logging.getLogger("asyncckpt")

# abort requests of failed multipart uploads that outlived the upload's deadline (kept alive)
_aborting: set[asyncio.Task[None]] = set()


@dataclass(frozen=True)
class PutInfo:
    """What :meth:`Puts.put_file` stored."""

    key: str
    size: int
    crc32c: int
    e_tag: str | None
    parts: int


class Puts(Reads, Deletes):
    """The uploads of an object store (see the module docstring)."""

    async def put_file(
        self, key: str, data: memoryview, deadline: float, *, verify: Literal["size", "readback"] = "size"
    ) -> PutInfo:
        """Store ``data`` (a 1-D contiguous byte buffer, sent without a copy) as ``key``.

        Overwrites ``key`` (callers give each attempt its own keys). Multipart above
        ``part_size``; the parts go out ``max_concurrency`` at a time. Raises a typed
        :class:`ObjectStoreError` on failure, after aborting the key's incomplete uploads.
        """
        self._check_key(key)
        mv = as_bytes(data)
        size = mv.nbytes
        crc_fut = asyncio.ensure_future(self._in_thread(crc32c, mv))

        async def attempt(budget: float) -> Any:
            store = self._make_store(budget)
            if size <= self.part_size:
                return await obstore.put_async(store, key, mv, use_multipart=False)
            chunks = [mv[i : i + self.part_size] for i in range(0, size, self.part_size)]
            return await obstore.put_async(
                store, key, chunks, use_multipart=True, chunk_size=self.part_size,
                max_concurrency=self.max_concurrency,
            )

        async def crc() -> int:
            got: int = await crc_fut
            return got

        try:
            return await self._put(key, size, self.part_size, attempt, crc, Deadline.at_monotonic(deadline), verify)
        finally:
            if not crc_fut.done():
                crc_fut.cancel()

    async def put_from(
        self, key: str, size: int, read: Callable[[int, memoryview], None], deadline: float,
        *, verify: Literal["size", "readback"] = "size",
    ) -> PutInfo:
        """Store the ``size`` bytes that ``read(offset, buffer)`` fills (a local file read with
        ``pread``; called on the I/O executor) as ``key``, read one :meth:`stream_part` at a
        time as the upload takes them: memory stays ``max_concurrency + 1`` parts whatever
        the size. ``PutInfo.crc32c`` is that of the bytes sent.

        An exception of ``read`` (an ``OSError`` of the local disk) ends the upload and is
        raised as it is, never retried as a store failure; the key's incomplete uploads are
        aborted. Store failures raise as in :meth:`put_file`.
        """
        self._check_key(key)
        part = self.stream_part(size)

        def fill(offset: int, n: int) -> tuple[bytearray, int]:
            buf = bytearray(n)  # a fresh buffer per part: obstore holds it until the part is sent
            read(offset, memoryview(buf))
            return buf, crc32c(buf)

        local: list[BaseException] = []  # the source's failure, if any
        sent = [0]  # CRC-32C of the bytes the last attempt that read them all sent

        async def crc() -> int:
            return sent[0]

        if size <= part:  # one PUT: read once, before any request; every try sends these bytes
            body, sent[0] = await self._in_thread(fill, 0, size)

            async def single(budget: float) -> Any:
                return await obstore.put_async(self._make_store(budget), key, body, use_multipart=False)

            return await self._put(key, size, part, single, crc, Deadline.at_monotonic(deadline), verify)

        async def parts() -> AsyncIterator[bytearray]:
            total = 0
            for offset in range(0, size, part):
                n = min(part, size - offset)
                try:
                    buf, c = await self._in_thread(fill, offset, n)
                except Exception as e:
                    local.append(e)
                    raise
                total = crc32c_combine(total, c, n)
                yield buf
            sent[0] = total  # an upload completes only after this: the successful try's CRC

        async def multi(budget: float) -> Any:
            try:
                return await obstore.put_async(self._make_store(budget), key, parts(), use_multipart=True,
                                               chunk_size=part, max_concurrency=self.max_concurrency)
            except Exception:
                if local:
                    return None  # not the store's failure: raised below, not retried
                raise

        return await self._put(key, size, part, multi, crc, Deadline.at_monotonic(deadline), verify, local)

    async def _put(
        self, key: str, size: int, part: int, attempt: Callable[[float], Awaitable[Any]],
        sent_crc: Callable[[], Awaitable[int]], deadline: Deadline, verify: Literal["size", "readback"],
        local: list[BaseException] | None = None,
    ) -> PutInfo:
        """Run the upload ``attempt`` (retried within the deadline), then check what the store
        holds (its size, or its CRC read back against ``sent_crc()``, that of the bytes sent).
        A failure aborts the key's incomplete multipart uploads; one of the local source
        (``local``) is raised as it is."""
        parts = max(1, -(-size // part))
        try:
            result = await self._retrying(deadline, key, "upload", attempt)
            if local:
                raise local[0]
        except BaseException:
            if parts > 1:
                await self._abort_after_failure(key, deadline)
            raise
        crc = await sent_crc()
        if verify == "readback":
            got = await self.crc32c_of(key, size, deadline.monotonic)
            if got != crc:
                raise ObjectIntegrityError(errno.EIO, f"read-back CRC-32C {got:08x} != {crc:08x} sent",
                                           self.object_url(key))
        else:
            info = await self.head(key, deadline.monotonic)
            if info.size != size:
                raise ObjectIntegrityError(errno.EIO, f"stored size {info.size} != {size} sent",
                                           self.object_url(key))
        return PutInfo(key, size, crc, result.get("e_tag") if isinstance(result, dict) else None, parts)

    async def _abort_after_failure(self, key: str, deadline: Deadline) -> None:
        """Abort every incomplete upload of ``key``: waited for until the failed upload's
        ``deadline`` (never past it), then left to run on (bounded by its own 20 s; a
        cancellation does not stop it either). What it does not abort, the root's sweep does."""
        if self._uploads is None:
            log.warning("cannot abort incomplete uploads of %s: no static credentials for housekeeping",
                        self.object_url(key))
            return
        task = asyncio.ensure_future(self._abort_logged(key, time.monotonic() + 20.0))
        _aborting.add(task)
        task.add_done_callback(_aborting.discard)
        await asyncio.wait({task}, timeout=deadline.remaining())

    async def _abort_logged(self, key: str, deadline: float) -> None:
        try:
            n = await self.abort_uploads(key, exact=True, deadline=deadline)
            if n:
                log.info("aborted %d incomplete upload(s) of %s", n, self.object_url(key))
        except ObjectStoreError as e:
            log.warning("could not abort incomplete uploads of %s: %s", self.object_url(key), e)
