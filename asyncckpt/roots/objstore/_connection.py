"""One configured connection to ``s3://bucket/prefix``, and every request run through it.

:class:`Connection` validates the URL and the options, builds obstore clients whose own
retries and request timeouts end within a time budget, validates keys, and runs each request
with :meth:`~Connection._retrying`: bounded by a ``Deadline`` (``threads._deadline``; the
public methods of the operation classes still take the ``time.monotonic()`` point as a float
and make it one at their entry), retried with jittered exponential backoff while time
remains, every failure typed by
:class:`~._errormap.ErrorMap`. It is the base of the operation classes (reads, deletes,
uploads, conditional writes) that :class:`~._client.ObjectStore` combines; its ``_``-members
are for those subclasses. :func:`gather_or_cancel` runs a group of requests that succeed or
fail together.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import errno
import logging
import os
import random
import time
from collections.abc import Mapping
from concurrent.futures import Executor
from typing import Any

from obstore.store import S3Store

from ..._errors import ObjectStoreError, ObjectStoreTimeoutError
from ...threads._deadline import Deadline
from .._scheme import split_url
from ._errormap import ErrorMap, retryable, status_of
from ._forkguard import check_not_forked
from ._s3uploads import S3Credentials, UploadsClient

log = logging.getLogger("asyncckpt")

MiB = 1024 * 1024
#: Smallest part S3 accepts (all but the last); the default part is 64 MiB.
MIN_PART = 5 * MiB
DEFAULT_PART = 64 * MiB
#: Most parts of one multipart upload (S3's limit).
MAX_PARTS = 10_000
#: Part of a file streamed to or from the store (put_from/get_to): 9 of them in memory at most.
STREAM_PART = 16 * MiB


class Connection:
    """An object-store location ``s3://bucket/prefix``; keys are relative to the prefix.

    ``storage_options`` are obstore S3 config keys (``endpoint``, ``region``,
    ``access_key_id``, ``secret_access_key``, ``session_token``, ...); missing ones come from
    the standard ``AWS_*`` environment/config chain. ``allow_http`` is implied by an
    ``http://`` endpoint. Construction does no I/O.
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
        self.bucket, self.prefix = split_url(url)
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
        self._errors = ErrorMap(opts)
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

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, endpoint={self._endpoint!r}, storage_options=<redacted>)"

    __str__ = __repr__

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
            bad = ValueError(f"invalid storage_options for {self.url}: {self._errors.summary(e)}")
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

    def stream_part(self, size: int) -> int:
        """The part (and range) size of a transfer through ``put_from``/``get_to``:
        at most ``STREAM_PART`` (or ``part_size`` if smaller), more only where an object of
        ``size`` bytes would need over ``MAX_PARTS`` parts. Its memory is
        ``max_concurrency + 1`` such parts."""
        least = -(-size // MAX_PARTS)
        return max(MIN_PART, min(self.part_size, STREAM_PART), -(-least // MiB) * MiB)

    def _full_key(self, key: str) -> str:
        """``key`` as the bucket names it (under the store's prefix)."""
        return f"{self.prefix}/{key}" if self.prefix else key

    def _relative(self, path: str) -> str:
        """A bucket's path under the store's prefix as a key relative to it (see :meth:`_full_key`)."""
        if self.prefix and path.startswith(self.prefix + "/"):
            return path[len(self.prefix) + 1 :]
        return path

    def _translate(self, e: BaseException, key: str, what: str) -> ObjectStoreError:
        """Our typed error for an obstore/OS failure of ``what`` on ``key``."""
        return self._errors.translate(e, self.object_url(key), what)

    async def _bounded(self, aw: Any, deadline: Deadline, key: str, what: str) -> Any:
        """Await ``aw`` (a coroutine or obstore's already-running future) until ``deadline``."""
        left = deadline.remaining()
        if left <= 0:
            _discard(aw)
            raise ObjectStoreTimeoutError(errno.ETIMEDOUT, f"{what}: the deadline had passed", self.object_url(key))
        try:
            return await asyncio.wait_for(aw, left)
        except (asyncio.TimeoutError, TimeoutError):
            raise ObjectStoreTimeoutError(
                errno.ETIMEDOUT, f"{what}: not finished within the deadline", self.object_url(key)
            ) from None

    async def _retrying(self, deadline: Deadline, key: str, what: str, fn: Any) -> Any:
        """Run ``await fn(budget_s)`` until it succeeds, fails for good, or the deadline.

        Errors are raised outside the ``except`` block so the obstore exception (whose text
        may quote a server's echo of our credentials) is not even the ``__context__``.
        """
        check_not_forked()
        delay = 0.2
        tries = 0
        answered: ObjectStoreError | None = None  # the last failure the store answered with a status
        while True:
            tries += 1
            left = deadline.monotonic - time.monotonic()  # below 0 once passed: _bounded raises
            try:
                return await self._bounded(fn(left), deadline, key, what)
            except ObjectStoreTimeoutError:
                if answered is not None:
                    # a retry ran into the deadline after the store had kept answering with
                    # errors: that failure, not the clock, is the cause worth reporting
                    raise answered from None
                raise
            except Exception as e:  # noqa: BLE001 - translated and re-raised typed
                err = self._translate(e, key, what)
                fatal = not retryable(err, e)
                status = status_of(str(e))
            if fatal:
                raise err
            if status is not None:
                answered = err
            pause = delay * (0.5 + random.random())
            if deadline.remaining() <= pause + 0.5:
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


def as_bytes(data: Any, writable: bool = False) -> memoryview:
    """``data`` as a 1-D byte view (no copy); a clear error for a non-buffer, a non-contiguous
    buffer, or (``writable``) a read-only one."""
    try:
        mv = memoryview(data)
    except TypeError:
        raise TypeError(f"expected a buffer (memoryview, bytearray, ...), not {type(data).__name__}") from None
    if not mv.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if writable and mv.readonly:
        raise ValueError("destination buffer is read-only")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


def _discard(aw: Any) -> None:
    """Drop an awaitable that will not be awaited, without a 'never awaited' warning."""
    if asyncio.isfuture(aw):
        aw.cancel()
    elif hasattr(aw, "close"):
        aw.close()
