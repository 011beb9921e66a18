"""The object-store storage layer (S3 and S3-compatible stores) on ``obstore``.

:class:`ObjectStore` is what an object-store backend of the commit protocol needs, as async
methods for the writer's event loop, each bounded by an absolute ``deadline``
(``time.monotonic()`` seconds):

* :meth:`ObjectStore.put_file` - an object from a caller's buffer with no copy: a multipart
  upload with ``part_size`` parts, ``max_concurrency`` in flight (bounded memory: obstore
  sends straight from the buffer), CRC-32C of the source computed alongside; afterwards the
  stored size is checked (``verify="size"``) or the object read back and its CRC-32C
  compared (``verify="readback"``). obstore cannot send ``x-amz-checksum-crc32c`` (it offers
  only SHA-256 and CRC-64/NVME), so the server does not check our CRC-32C; the manifest's
  CRC-32C, verified on load, is the end-to-end check. A failed or timed-out put aborts
  every incomplete multipart upload of its key (keys are attempt-unique, so no other
  writer's upload can match).
* :meth:`ObjectStore.put_from` - an object from a local file, read (``pread``) part by part
  as the upload takes them: memory stays ``max_concurrency + 1`` parts of
  :meth:`~ObjectStore.stream_part` bytes, a read error is raised as the ``OSError`` it is
  (never a SIGBUS, as an ``mmap`` of the file would turn it into; never retried).
* :meth:`ObjectStore.create_once` - a conditional create (``If-None-Match: *``, one PUT) that
  tells who won even when the response was lost: after *every* outcome the object is read
  back and compared with our bytes (which carry our attempt id).
* :meth:`ObjectStore.replace_if` - a compare-and-swap (``If-Match: <ETag>``, one PUT), read
  back the same way: what the root lease (``_lease``) is renewed and taken over with.
* :meth:`ObjectStore.get_range_into` - parallel ranged GETs into a caller's buffer;
  :meth:`ObjectStore.get_to` - the same handed range by range to a writer (a local file's
  ``pwrite``), with the CRC-32C of the whole.
* :meth:`ObjectStore.list`, :meth:`ObjectStore.head`, :meth:`ObjectStore.delete`,
  :meth:`ObjectStore.list_uploads`, :meth:`ObjectStore.abort_uploads`.

Throttling (503 SlowDown), 5xx and connection errors are retried with jittered exponential
backoff by obstore within the time left to the deadline, and once more by us for the whole
operation while time remains. Every failure is an :class:`ObjectStoreError` (a
``CheckpointError`` and an ``OSError`` with an errno and the object's URL as filename).
Credentials are never in a message or a repr: every error text is scrubbed of the secret
values of the storage options, and the obstore exception is not chained.

:meth:`ObjectStore.open` builds the store and probes (with a throwaway key under the
prefix's ``.asyncckpt/`` metadata directory) that it enforces conditional creates; a store
that silently overwrites raises :class:`ConditionalWriteUnsupportedError` - no silent race.
"""

from __future__ import annotations

import asyncio
import atexit
import builtins
import datetime as _dt
import errno
import logging
import os
import random
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

try:
    import obstore
    import obstore.exceptions as obx
    from obstore.store import S3Store
except ImportError as _missing:  # an optional dependency: say which extra brings it
    raise ImportError(
        "asyncckpt: s3:// roots, mirror= and asyncckpt.remote need the s3 extra: "
        f"pip install 'asyncckpt[s3]' (obstore could not be imported: {_missing})"
    ) from _missing

from ..._errors import (
    ConditionalWriteUnsupportedError,
    ObjectIntegrityError,
    ObjectNotFoundError,
    ObjectStoreError,
    ObjectStoreFullError,
    ObjectStorePermissionError,
    ObjectStoreTimeoutError,
    ObjectStoreUnavailableError,
)
from ...format._checksum import crc32c, crc32c_combine
from ...format._layout import META_DIR
from ._s3uploads import S3Credentials, Upload, UploadsClient, UploadsError

log = logging.getLogger("asyncckpt")
T = TypeVar("T")

MiB = 1024 * 1024
#: Smallest part S3 accepts (all but the last); the default part is 64 MiB.
MIN_PART = 5 * MiB
DEFAULT_PART = 64 * MiB
#: Largest object a single (conditional) PUT may carry on AWS.
MAX_SINGLE_PUT = 5 * 1024 * MiB
#: Most parts of one multipart upload (S3's limit).
MAX_PARTS = 10_000
#: Seconds :meth:`ObjectStore.remove_dirs` may take at most (best effort housekeeping).
DIRS_S = 5.0
#: Part of a file streamed to or from the store (put_from/get_to): 9 of them in memory at most.
STREAM_PART = 16 * MiB

#: Storage-option keys whose values are secrets (also any key naming a secret/token/password).
_SECRET_KEYS = {"access_key_id", "secret_access_key", "session_token", "token", "aws_access_key_id",
                "aws_secret_access_key", "aws_session_token"}
_SECRET_HINT = re.compile(r"secret|token|password|credential|access_key", re.I)
_STATUS = re.compile(r"status code: (\d{3})|HTTP (\d{3})")
#: Least time left for deleting a probe's scratch object; with less it is left (harmless).
_SCRATCH_MIN_S = 0.05
# abort requests of failed multipart uploads that outlived the upload's deadline (kept alive)
_aborting: set[asyncio.Task[None]] = set()
#: What stores answer when they are out of space (MinIO, Ceph, SeaweedFS's own words).
_FULL = re.compile(r"InsufficientStorage|XMinioStorageFull|StorageFull|QuotaExceeded|No space left on device|"
                   r"no free volumes|No writable volumes")


#: The process whose obstore (tokio) runtime is running; a forked child cannot use it.
_RUNTIME_PID: int | None = None


def _check_not_forked() -> None:
    """Raise ``RuntimeError`` in a forked child of a process that already made requests:
    obstore's runtime threads do not survive fork, so every request would just time out."""
    global _RUNTIME_PID
    pid = os.getpid()
    if _RUNTIME_PID is None:
        _RUNTIME_PID = pid
        atexit.register(let_runtime_settle)
    elif _RUNTIME_PID != pid:
        raise RuntimeError(
            "object-store I/O in a forked child of a process that already used it: obstore's runtime "
            "does not survive fork(); start such processes with the 'spawn' or 'forkserver' method"
        )


#: How long the process waits at exit (interpreter still intact) for obstore's runtime threads.
EXIT_SETTLE_S = 0.2


def let_runtime_settle() -> None:
    """At exit, before the interpreter is torn down: a short wait that lets obstore's tokio
    worker threads finish what they still do with Python objects. Without it a short-lived
    process that used the store sometimes dies of SIGABRT during finalization after all its
    work succeeded (measured: 2 of 40 ``asyncckpt push`` + ``ls`` processes exited -6; with it 0 of 120; the
    same class of bug as lancedb/lancedb#4175)."""
    if _RUNTIME_PID == os.getpid():
        time.sleep(EXIT_SETTLE_S)


@dataclass(frozen=True)
class PutInfo:
    """What :meth:`ObjectStore.put_file` stored."""

    key: str
    size: int
    crc32c: int
    e_tag: str | None
    parts: int


@dataclass(frozen=True)
class ObjectInfo:
    """One object as listed or HEADed (``key`` relative to the store's prefix)."""

    key: str
    size: int
    e_tag: str | None
    last_modified: _dt.datetime


@dataclass(frozen=True)
class CreateResult:
    """Outcome of :meth:`ObjectStore.create_once` / :meth:`ObjectStore.replace_if`: ``won``
    iff the stored bytes are ours; ``stored`` is what the object holds (the winner's bytes
    when we lost; ``b""`` when it is gone), ``info`` its ETag and modification time as read
    back (``None`` when it is gone)."""

    won: bool
    stored: bytes
    attempts: int
    info: ObjectInfo | None = None


class _Transient(Exception):
    """Internal: a failure worth retrying the whole operation for."""

    def __init__(self, err: ObjectStoreError) -> None:
        super().__init__(str(err))
        self.err = err


def _parse_url(url: str) -> tuple[str, str, str]:
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ValueError(f"object-store URL must look like s3://bucket/prefix, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError("object-store URL must not carry a query or fragment (pass storage_options=)")
    prefix = parts.path.strip("/")
    if any(seg in ("", ".", "..") for seg in prefix.split("/")) and prefix:
        raise ValueError(f"object-store prefix has an empty or relative segment: {prefix!r}")
    return parts.scheme, parts.netloc, prefix


class ObjectStore:
    """An object-store location ``s3://bucket/prefix``; keys are relative to the prefix.

    ``storage_options`` are obstore S3 config keys (``endpoint``, ``region``,
    ``access_key_id``, ``secret_access_key``, ``session_token``, ...); missing ones come from
    the standard ``AWS_*`` environment/config chain. ``allow_http`` is implied by an
    ``http://`` endpoint. Construction does no I/O; use :meth:`open` to also probe the store.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, str] | None = None,
        *,
        part_size: int = DEFAULT_PART,
        max_concurrency: int = 8,
        min_bandwidth: float = 1 * MiB,
        max_retries: int = 8,
        unsigned_payload: bool = True,
        executor: Executor | None = None,
    ) -> None:
        if not isinstance(url, str):
            raise TypeError(f"url must be a str, not {type(url).__name__}")
        _, self.bucket, self.prefix = _parse_url(url)
        opts = dict(storage_options or {})
        for k, v in opts.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError("storage_options must map str to str")
        if not isinstance(part_size, int) or part_size < MIN_PART:
            raise ValueError(f"part_size must be an int >= {MIN_PART} (S3's minimum part)")
        if not isinstance(max_concurrency, int) or not 1 <= max_concurrency <= 64:
            raise ValueError("max_concurrency must be an int in 1..64")
        if min_bandwidth <= 0:
            raise ValueError("min_bandwidth must be > 0")
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self._executor = executor
        self._secrets = sorted(
            {v for k, v in opts.items() if v and (k.lower() in _SECRET_KEYS or _SECRET_HINT.search(k))}
            | {v for k, v in os.environ.items() if len(v) >= 8 and k.upper() in
               ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")},
            key=len,
            reverse=True,
        )
        endpoint = opts.get("endpoint") or opts.get("aws_endpoint") or os.environ.get("AWS_ENDPOINT_URL")
        self._config: dict[str, Any] = dict(opts)
        self._config.setdefault("unsigned_payload", "true" if unsigned_payload else "false")
        # one request may not take longer than a part at the minimum bandwidth (+ set-up)
        self._request_timeout = part_size / min_bandwidth + 30.0
        self._client: dict[str, Any] = {"connect_timeout": _dt.timedelta(seconds=5)}
        if endpoint and endpoint.startswith("http://"):
            self._client["allow_http"] = True
        self._max_retries = max_retries
        self._endpoint = endpoint
        self._store = self._make_store(180.0)
        region = opts.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        key_id = opts.get("access_key_id") or os.environ.get("AWS_ACCESS_KEY_ID")
        secret = opts.get("secret_access_key") or os.environ.get("AWS_SECRET_ACCESS_KEY")
        token = opts.get("session_token") or opts.get("token") or os.environ.get("AWS_SESSION_TOKEN")
        self._uploads: UploadsClient | None = None
        if key_id and secret:
            self._uploads = UploadsClient(
                self.bucket, region or "us-east-1", S3Credentials(key_id, secret, token), endpoint
            )

    @classmethod
    async def open(cls, url: str, storage_options: Mapping[str, str] | None = None, *, deadline: float | None = None,
                   **kwargs: Any) -> ObjectStore:
        """Build the store and check it enforces conditional creates (see :meth:`probe`)."""
        store = cls(url, storage_options, **kwargs)
        await store.probe(deadline if deadline is not None else time.monotonic() + 60.0)
        return store

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r}, endpoint={self._endpoint!r}, storage_options=<redacted>)"

    __str__ = __repr__

    # -- helpers ---------------------------------------------------------------------------

    def _make_store(self, budget_s: float) -> S3Store:
        """An obstore client whose retries and requests all end within ``budget_s``."""
        # obstore gives up at 80% of the budget, so its own error (with the HTTP status)
        # surfaces before our deadline guard has to cancel the request
        budget = max(0.5, 0.8 * budget_s)
        client = dict(self._client, timeout=_dt.timedelta(seconds=min(self._request_timeout, budget)))
        retry = {
            "max_retries": self._max_retries,
            "retry_timeout": _dt.timedelta(seconds=min(170.0, budget)),
            "backoff": {"init_backoff": _dt.timedelta(milliseconds=100), "max_backoff": _dt.timedelta(seconds=5),
                        "base": 2},
        }
        try:
            return S3Store(
                self.bucket,
                prefix=self.prefix or None,
                config=self._config,  # type: ignore[arg-type] # user keys, checked by obstore at run time
                client_options=client,  # type: ignore[arg-type] # a ClientConfig built as a dict
                retry_config=retry,  # type: ignore[arg-type] # a RetryConfig built as a dict
            )
        except Exception as e:  # noqa: BLE001 - obstore's text may quote option values
            bad = ValueError(f"invalid storage_options for {self.url}: {self._summary(e)}")
        raise bad  # outside the except block: obstore's exception must not be the context

    def object_url(self, key: str) -> str:
        return f"{self.url}/{key}"

    @staticmethod
    def _check_key(key: str, *, prefix: bool = False) -> str:
        """``key`` relative to the store: no leading slash, no empty, ``.`` or ``..`` segment."""
        if not isinstance(key, str):
            raise TypeError(f"object key must be a str, not {type(key).__name__}")
        if prefix and key == "":
            return key
        segs = (key[:-1] if prefix and key.endswith("/") else key).split("/")
        if not key or any(seg in ("", ".", "..") for seg in segs) or any(ord(c) < 32 for c in key):
            raise ValueError(f"invalid object key {key!r}")
        return key

    def _scrub(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "<redacted>")
        return re.sub(r"(Signature=|Credential=|X-Amz-Signature=|X-Amz-Credential=)[^\s,&\"]+", r"\1<redacted>",
                      text)

    def _summary(self, e: BaseException) -> str:
        # obstore messages end in a long "Debug source:" dump; keep the first lines only
        text = str(e).split("\n\nDebug source:")[0].strip()
        lines = [ln for ln in text.splitlines() if ln.strip()][:3]
        return self._scrub(f"{type(e).__name__}: {' | '.join(lines)}"[:600])

    def _translate(self, e: BaseException, key: str, what: str) -> ObjectStoreError:
        """Our typed error for an obstore/OS failure of ``what`` on ``key``."""
        url = self.object_url(key)
        msg = f"{what} failed ({self._summary(e)})"
        if isinstance(e, ObjectStoreError):
            return e
        if isinstance(e, FileNotFoundError):
            return ObjectNotFoundError(errno.ENOENT, f"{what}: no such object", url)
        if isinstance(e, (obx.PermissionDeniedError, obx.UnauthenticatedError)):
            return ObjectStorePermissionError(errno.EACCES, msg, url)
        status = _status_of(str(e))
        if status in (401, 403):
            return ObjectStorePermissionError(errno.EACCES, msg, url)
        if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
            return ObjectStoreTimeoutError(errno.ETIMEDOUT, msg, url)
        if status == 507 or _FULL.search(str(e)):
            return ObjectStoreFullError(errno.ENOSPC, f"{what} failed: the store is out of space ({self._summary(e)})",
                                        url)
        return ObjectStoreUnavailableError(errno.EIO, msg, url)

    def _retryable(self, err: ObjectStoreError, e: BaseException) -> bool:
        if isinstance(err, (ObjectNotFoundError, ObjectStorePermissionError, ObjectIntegrityError)):
            return False
        if isinstance(e, (obx.InvalidPathError, obx.NotSupportedError, obx.UnknownConfigurationKeyError)):
            return False
        status = _status_of(str(e))
        return status is None or status >= 500 or status in (408, 409, 429)

    async def _bounded(self, aw: Any, deadline: float, key: str, what: str) -> Any:
        """Await ``aw`` (a coroutine or obstore's already-running future) until ``deadline``."""
        left = deadline - time.monotonic()
        if left <= 0:
            _discard(aw)
            raise ObjectStoreTimeoutError(errno.ETIMEDOUT, f"{what}: the deadline had passed", self.object_url(key))
        try:
            return await asyncio.wait_for(aw, left)
        except (asyncio.TimeoutError, TimeoutError):
            raise ObjectStoreTimeoutError(
                errno.ETIMEDOUT, f"{what}: not finished within the deadline", self.object_url(key)
            ) from None

    async def _retrying(self, deadline: float, key: str, what: str, fn: Any) -> Any:
        """Run ``await fn(budget_s)`` until it succeeds, fails for good, or the deadline.

        Errors are raised outside the ``except`` block so the obstore exception (whose text
        may quote a server's echo of our credentials) is not even the ``__context__``.
        """
        _check_not_forked()
        delay = 0.2
        tries = 0
        answered: ObjectStoreError | None = None  # the last failure the store answered with a status
        while True:
            tries += 1
            left = deadline - time.monotonic()
            fatal = False
            try:
                return await self._bounded(fn(left), deadline, key, what)
            except ObjectStoreTimeoutError:
                if answered is not None:
                    # a retry ran into the deadline after the store had kept answering with
                    # errors: that failure, not the clock, is the cause worth reporting
                    raise answered from None
                raise
            except _Transient as t:
                err = t.err
            except Exception as e:  # noqa: BLE001 - translated and re-raised typed
                err = self._translate(e, key, what)
                fatal = not self._retryable(err, e)
                status = _status_of(str(e))
            else:  # pragma: no cover - the return above
                status = None
            if fatal:
                raise err
            if status is not None:
                answered = err
            pause = delay * (0.5 + random.random())
            if time.monotonic() + pause + 0.5 >= deadline:
                if status is None and not isinstance(err, ObjectStoreTimeoutError):
                    # no answer from the store before the deadline (a hang, a dead server):
                    # the deadline is what ended it
                    err = ObjectStoreTimeoutError(
                        errno.ETIMEDOUT, f"{what}: deadline passed after {tries} attempt(s); last: {err.strerror}",
                        self.object_url(key),
                    )
                raise err
            if tries >= 6:
                raise err
            log.debug("%s on %s failed (%s); retrying in %.2fs", what, self.object_url(key), err, pause)
            await asyncio.sleep(pause)
            delay = min(delay * 2, 5.0)

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- probe -------------------------------------------------------------------------------

    async def probe(self, deadline: float) -> None:
        """Check that a second conditional create of a key fails; raise
        :class:`ConditionalWriteUnsupportedError` if the store overwrote instead."""
        token = uuid.uuid4().hex
        key = f"{META_DIR}/probe-{token}"
        first = f"first {token}".encode()
        try:
            enforced = (await self.create_once(key, first, deadline)).won
            if enforced:
                try:
                    await self._bounded(obstore.put_async(self._store, key, b"second", mode="create"), deadline, key,
                                        "conditional-create probe")
                    enforced = False
                except (obx.AlreadyExistsError, obx.PreconditionError):
                    pass
            if enforced:
                enforced = await self.get_bytes(key, deadline) == first
            if not enforced:
                raise ConditionalWriteUnsupportedError(
                    errno.ENOTSUP,
                    "the store does not enforce conditional creates (If-None-Match: *): a second create of "
                    "the same key succeeded, so two writers could both commit a step; use a store that "
                    "supports conditional writes (AWS S3 since 2024-08, MinIO, SeaweedFS, GCS, Azure)",
                    self.object_url(key),
                )
        except ObjectStoreError:
            raise
        except Exception as e:  # noqa: BLE001 - typed, raised below without the obstore context
            failure: ObjectStoreError | None = self._translate(e, key, "conditional-create probe")
        else:
            failure = None
        finally:
            await self._drop_scratch(key, deadline)
        if failure is not None:
            raise failure

    async def server_time(self, deadline: float) -> _dt.datetime:
        """The store's clock now: the ``last_modified`` of a fresh object written under the
        prefix's metadata directory (then deleted). Compare it only with other
        ``last_modified`` values of this store, never with local time; both have the store's
        resolution (1 s on S3 and SeaweedFS)."""
        key = f"{META_DIR}/clock-{uuid.uuid4().hex}"
        try:
            await self._retrying(deadline, key, "clock write",
                                 lambda _b: obstore.put_async(self._store, key, b"clock", use_multipart=False))
            return (await self.head(key, deadline)).last_modified
        finally:
            await self._drop_scratch(key, deadline)

    async def _drop_scratch(self, key: str, deadline: float) -> None:
        """Delete a probe or clock object, best effort within ``deadline`` (the caller's: a
        stray one under ``.asyncckpt/`` is harmless, a call that overran its deadline is not)."""
        if deadline - time.monotonic() < _SCRATCH_MIN_S:
            log.debug("no time left to delete scratch object %s", self.object_url(key))
            return
        try:
            await self._bounded(obstore.delete_async(self._store, key), deadline, key, "scratch clean-up")
        except Exception as e:  # noqa: BLE001 - harmless, see above
            log.debug("could not delete scratch object %s: %s", key, self._scrub(str(e)))

    # -- writes ------------------------------------------------------------------------------

    async def put_file(
        self, key: str, data: memoryview, deadline: float, *, verify: Literal["size", "readback"] = "size"
    ) -> PutInfo:
        """Store ``data`` (a 1-D contiguous byte buffer, sent without a copy) as ``key``.

        Overwrites ``key`` (callers give each attempt its own keys). Multipart above
        ``part_size``; the parts go out ``max_concurrency`` at a time. Raises a typed
        :class:`ObjectStoreError` on failure, after aborting the key's incomplete uploads.
        """
        self._check_key(key)
        mv = _as_bytes(data)
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
            return await self._put(key, size, self.part_size, attempt, crc, deadline, verify)
        finally:
            if not crc_fut.done():
                crc_fut.cancel()

    def stream_part(self, size: int) -> int:
        """The part (and range) size of a transfer through :meth:`put_from`/:meth:`get_to`:
        at most ``STREAM_PART`` (or ``part_size`` if smaller), more only where an object of
        ``size`` bytes would need over ``MAX_PARTS`` parts. Its memory is
        ``max_concurrency + 1`` such parts."""
        least = -(-size // MAX_PARTS)
        return max(MIN_PART, min(self.part_size, STREAM_PART), -(-least // MiB) * MiB)

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

            return await self._put(key, size, part, single, crc, deadline, verify)

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

        return await self._put(key, size, part, multi, crc, deadline, verify, local)

    async def _put(
        self, key: str, size: int, part: int, attempt: Callable[[float], Awaitable[Any]],
        sent_crc: Callable[[], Awaitable[int]], deadline: float, verify: Literal["size", "readback"],
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
            got = await self.crc32c_of(key, size, deadline)
            if got != crc:
                raise ObjectIntegrityError(errno.EIO, f"read-back CRC-32C {got:08x} != {crc:08x} sent",
                                           self.object_url(key))
        else:
            info = await self.head(key, deadline)
            if info.size != size:
                raise ObjectIntegrityError(errno.EIO, f"stored size {info.size} != {size} sent",
                                           self.object_url(key))
        return PutInfo(key, size, crc, result.get("e_tag") if isinstance(result, dict) else None, parts)

    async def _abort_after_failure(self, key: str, deadline: float) -> None:
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
        await asyncio.wait({task}, timeout=max(0.0, deadline - time.monotonic()))

    async def _abort_logged(self, key: str, deadline: float) -> None:
        try:
            n = await self.abort_uploads(key, exact=True, deadline=deadline)
            if n:
                log.info("aborted %d incomplete upload(s) of %s", n, self.object_url(key))
        except ObjectStoreError as e:
            log.warning("could not abort incomplete uploads of %s: %s", self.object_url(key), e)

    async def create_once(self, key: str, body: bytes, deadline: float) -> CreateResult:
        """Create ``key`` holding ``body`` unless it exists; tell whether ours is stored.

        ``body`` must be unique to the caller (the manifest carries the attempt id). After
        any outcome - success, "already exists", an error, a lost response - the object is
        read back: our bytes mean we won (even if the create "failed"), other bytes mean we
        lost, no object means the create did not land and it is tried again until the
        deadline. Raises :class:`ObjectStoreTimeoutError` with ``outcome_unknown`` if the
        deadline passes first.
        """
        return await self._conditional_put(key, body, None, deadline)

    async def replace_if(self, key: str, body: bytes, e_tag: str, deadline: float) -> CreateResult:
        """Overwrite ``key`` with ``body`` only if it still has ETag ``e_tag`` (``If-Match``,
        one PUT): a compare-and-swap. ``body`` must be unique to the caller and differ from
        what the object holds.

        Read back after every outcome, like :meth:`create_once`: our bytes mean we won (a
        lost response included); the object unchanged (still ``e_tag``) means the update did
        not land and it is tried again until the deadline; other bytes, or no object, mean
        another writer changed it first (``won`` false). Raises
        :class:`ObjectStoreTimeoutError` with ``outcome_unknown`` if the deadline passes first.
        """
        if not isinstance(e_tag, str) or not e_tag:
            raise ValueError("e_tag must be a non-empty str")
        return await self._conditional_put(key, body, e_tag, deadline)

    async def _conditional_put(self, key: str, body: bytes, e_tag: str | None, deadline: float) -> CreateResult:
        """One conditional PUT (``If-None-Match: *`` when ``e_tag`` is None, else ``If-Match``)
        repeated until a read-back tells what the object holds (see the two callers)."""
        self._check_key(key)
        if not isinstance(body, bytes):
            raise TypeError("body must be bytes")
        _check_not_forked()
        if len(body) > MAX_SINGLE_PUT:
            raise ValueError("a conditional write is one PUT: body must be <= 5 GiB")
        what = "conditional create" if e_tag is None else "conditional update"
        mode: Any = "create" if e_tag is None else {"e_tag": e_tag}
        tries = 0
        delay = 0.1
        last: str = "no attempt made"
        while True:
            tries += 1
            err: ObjectStoreError | None = None
            try:
                await self._bounded(
                    obstore.put_async(self._make_store(deadline - time.monotonic()), key, body, mode=mode),
                    deadline, key, what,
                )
                last = "written"
            except ObjectStoreTimeoutError:
                last = "timed out"
            except obx.AlreadyExistsError:
                last = "already exists"
            except obx.PreconditionError:
                last = "precondition failed"
            except Exception as e:  # noqa: BLE001 - ambiguous: the read-back below decides
                err = self._translate(e, key, what)
                last = str(err)
            if isinstance(err, ObjectStorePermissionError):
                raise err
            found: tuple[bytes, ObjectInfo] | None = None
            gone = False
            try:
                found = await self.get_object(key, max(deadline, time.monotonic() + 0.001))
            except ObjectNotFoundError:
                gone = True
            except ObjectStoreTimeoutError:
                last = "read-back timed out"
            except ObjectStoreError as e:
                last = str(e)
            if found is not None:
                stored, info = found
                if stored == body or e_tag is None or info.e_tag != e_tag:
                    return CreateResult(won=stored == body, stored=stored, attempts=tries, info=info)
                # still the version we meant to replace: the update did not land, try again
            elif gone and e_tag is not None:
                return CreateResult(won=False, stored=b"", attempts=tries, info=None)
            pause = delay * (0.5 + random.random())
            if time.monotonic() + pause >= deadline:
                err_t = ObjectStoreTimeoutError(
                    errno.ETIMEDOUT,
                    f"{what}: outcome unknown at the deadline after {tries} attempt(s) (last: {last}); "
                    "read the object to find out whether it landed",
                    self.object_url(key),
                )
                err_t.outcome_unknown = True
                raise err_t
            await asyncio.sleep(pause)
            delay = min(delay * 2, 2.0)

    async def delete(self, keys: Sequence[str], deadline: float) -> None:
        """Delete ``keys`` (bulk requests; missing keys are fine)."""
        keys = [self._check_key(k) for k in keys]
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            await self._retrying(deadline, batch[0] if batch else "", "delete",
                                 lambda _b, batch=batch: obstore.delete_async(self._store, batch))

    async def remove_dirs(self, dirs: Sequence[str], deadline: float) -> bool:
        """Best effort: delete the "directories" ``dirs`` (each written ``dir/``; deepest
        first) in one bulk request, so a store that keeps the empty directories of deleted
        objects does not list and walk them for ever. obstore sends each as the key ``dir``
        (no trailing slash): SeaweedFS then removes that directory if it is empty (never if
        not), taking a bulk request's keys in order; elsewhere no object has such a key (the
        names are a step's or an attempt's, never an object's): a no-op. Returns whether the
        store answered; a failure is logged, never raised (the objects are gone already)."""
        for d in dirs:
            if not d.endswith("/"):
                raise ValueError(f"not a directory key: {d!r}")
            self._check_key(d, prefix=True)
        if not dirs:
            return True
        until = min(deadline, time.monotonic() + DIRS_S)  # housekeeping: never worth a long wait
        try:
            await self._bounded(obstore.delete_async(self._make_store(until - time.monotonic()), list(dirs)), until,
                                dirs[0], "delete directories")
        except Exception as e:  # noqa: BLE001 - housekeeping, see above
            log.debug("could not delete directories under %s: %s", self.object_url(dirs[0]), self._summary(e))
            return False
        return True

    # -- reads -------------------------------------------------------------------------------

    async def head(self, key: str, deadline: float) -> ObjectInfo:
        """Size, ETag and modification time of ``key`` (:class:`ObjectNotFoundError` if absent)."""
        self._check_key(key)
        meta = await self._retrying(deadline, key, "head", lambda _b: obstore.head_async(self._store, key))
        return _info(meta, self.prefix)

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
            return bytes(await res.bytes_async()), _info(res.meta, self.prefix)

        got: tuple[bytes, ObjectInfo] = await self._retrying(deadline, key, "get", fetch)
        return got

    async def get_range_into(self, key: str, offset: int, out: memoryview, deadline: float,
                             *, range_size: int | None = None) -> None:
        """Fill ``out`` with the bytes of ``key`` from ``offset``: parallel ranged GETs of at
        most ``range_size`` (default ``part_size``), ``max_concurrency`` in flight, each
        copied once into ``out``. A short object raises :class:`ObjectIntegrityError`."""
        self._check_key(key)
        dst = _as_bytes(out, writable=True)
        if offset < 0:
            raise ValueError("offset must be >= 0")
        step = range_size or self.part_size
        sem = asyncio.Semaphore(self.max_concurrency)

        async def one(start: int) -> None:
            n = min(step, dst.nbytes - start)
            async with sem:
                got = await self._retrying(
                    deadline, key, "ranged get",
                    lambda _b: obstore.get_range_async(self._store, key, start=offset + start, length=n),
                )
            src = memoryview(got)
            if src.nbytes != n:
                raise ObjectIntegrityError(
                    errno.EIO, f"range at {offset + start} returned {src.nbytes} bytes, expected {n}",
                    self.object_url(key),
                )
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
                got = await self._retrying(
                    deadline, key, "ranged get",
                    lambda _b: obstore.get_range_async(self._store, key, start=start, length=n),
                )
                src = memoryview(got)
                if src.nbytes != n:
                    raise ObjectIntegrityError(
                        errno.EIO, f"range at {start} returned {src.nbytes} bytes, expected {n}", self.object_url(key)
                    )
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
        dsts = [_as_bytes(v, writable=True) for v in views]
        total = sum(d.nbytes for d in dsts)
        if offset < 0:
            raise ValueError("offset must be >= 0")
        if total == 0:
            return
        got = await self._retrying(
            deadline, key, "ranged get",
            lambda _b: obstore.get_range_async(self._store, key, start=offset, length=total),
        )
        src = memoryview(got)
        if src.nbytes != total:
            raise ObjectIntegrityError(
                errno.EIO, f"range at {offset} returned {src.nbytes} bytes, expected {total}", self.object_url(key)
            )
        at = 0
        for d in dsts:
            d[:] = src[at : at + d.nbytes]
            at += d.nbytes

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
                out.extend(_info(m, self.prefix) for m in chunk)
            return sorted(out, key=lambda i: i.key)

        result: list[ObjectInfo] = await self._retrying(deadline, prefix, "list", run)
        return result

    async def list_dirs(self, prefix: str, deadline: float) -> builtins.list[str]:
        """The names of the "directories" right below ``prefix`` (a LIST with delimiter ``/``):
        ``step_00000300`` for ``P/step_00000300/...``; unsorted."""
        self._check_key(prefix, prefix=True)

        async def run(_b: float) -> builtins.list[str]:
            res = await obstore.list_with_delimiter_async(self._store, prefix or None)
            out = []
            for p in res["common_prefixes"]:
                rel = str(p)
                if self.prefix and rel.startswith(self.prefix + "/"):
                    rel = rel[len(self.prefix) + 1 :]
                if prefix and rel.startswith(prefix):
                    rel = rel[len(prefix) :]
                out.append(rel.strip("/"))
            return out

        result: builtins.list[str] = await self._retrying(deadline, prefix, "list", run)
        return result

    # -- multipart housekeeping --------------------------------------------------------------

    @property
    def can_list_uploads(self) -> bool:
        """Whether incomplete multipart uploads can be listed and aborted (static credentials)."""
        return self._uploads is not None

    def _full_key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    async def list_uploads(self, prefix: str, deadline: float) -> builtins.list[Upload]:
        """Incomplete multipart uploads whose key starts with ``prefix`` (keys relative)."""
        self._check_key(prefix, prefix=True)
        _check_not_forked()
        if self._uploads is None:
            raise ObjectStoreError(errno.ENOTSUP, "listing multipart uploads needs static credentials",
                                   self.object_url(prefix))
        client = self._uploads
        full = self._full_key(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        failure: ObjectStoreError | None = None
        try:
            ups: builtins.list[Upload] = await self._bounded(
                self._in_thread(client.list_uploads, full), deadline, prefix, "list uploads"
            )
        except ObjectStoreError:
            raise
        except (UploadsError, OSError) as e:
            failure = ObjectStoreUnavailableError(errno.EIO, self._scrub(str(e)), self.object_url(prefix))
        if failure is not None:
            raise failure
        return [Upload(u.key[strip:], u.upload_id, u.initiated) for u in ups]

    async def abort_uploads(self, prefix: str, *, exact: bool = False, deadline: float) -> int:
        """Abort incomplete uploads under ``prefix`` (only of key ``prefix`` if ``exact``);
        return how many. Call only for keys no live writer is uploading to."""
        ups = [u for u in await self.list_uploads(prefix, deadline) if not exact or u.key == prefix]
        for u in ups:
            await self.abort_upload(u.key, u.upload_id, deadline)
        return len(ups)

    async def abort_upload(self, key: str, upload_id: str, deadline: float) -> None:
        """Abort one incomplete upload of ``key`` (one already gone counts as aborted)."""
        self._check_key(key)
        _check_not_forked()
        if self._uploads is None:
            raise ObjectStoreError(errno.ENOTSUP, "aborting multipart uploads needs static credentials",
                                   self.object_url(key))
        failure: ObjectStoreError | None = None
        try:
            await self._bounded(self._in_thread(self._uploads.abort, self._full_key(key), upload_id),
                                deadline, key, "abort upload")
        except ObjectStoreError:
            raise
        except (UploadsError, OSError) as e:
            failure = ObjectStoreUnavailableError(errno.EIO, self._scrub(str(e)), self.object_url(key))
        if failure is not None:
            raise failure


async def gather_or_cancel(coros: list[Any]) -> None:
    """Run ``coros`` concurrently; the first failure cancels the rest, and none is left
    running when this returns or raises (no orphaned request outlives its operation)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _discard(aw: Any) -> None:
    """Drop an awaitable that will not be awaited, without a 'never awaited' warning."""
    if asyncio.isfuture(aw):
        aw.cancel()
    elif hasattr(aw, "close"):
        aw.close()


def _status_of(text: str) -> int | None:
    m = _STATUS.search(text)
    if not m:
        return None
    return int(next(g for g in m.groups() if g))


def _as_bytes(data: Any, writable: bool = False) -> memoryview:
    try:
        mv = memoryview(data)
    except TypeError:
        raise TypeError(f"expected a buffer (memoryview, bytearray, ...), not {type(data).__name__}") from None
    if not mv.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if writable and mv.readonly:
        raise ValueError("destination buffer is read-only")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


def _info(meta: Any, prefix: str) -> ObjectInfo:
    path = str(meta["path"])
    if prefix and path.startswith(prefix + "/"):
        path = path[len(prefix) + 1 :]
    return ObjectInfo(path, int(meta["size"]), meta.get("e_tag"), meta["last_modified"])
