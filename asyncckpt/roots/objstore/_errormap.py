"""Mapping an obstore or OS failure to our typed :class:`ObjectStoreError`, scrubbed of secrets.

:class:`ErrorMap` knows the secret values of one store's storage options (and of the ``AWS_*``
credential variables) and removes them, and any signature or credential of a presigned URL,
from every error text it writes. :meth:`ErrorMap.translate` picks the error type (not found,
permission, timeout, out of space, unavailable); :func:`retryable` says whether a failure is
worth another try of the whole operation.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
from collections.abc import Mapping

import obstore.exceptions as obx

from ..._errors import (
    ObjectIntegrityError,
    ObjectNotFoundError,
    ObjectStoreError,
    ObjectStoreFullError,
    ObjectStorePermissionError,
    ObjectStoreTimeoutError,
    ObjectStoreUnavailableError,
)

#: Storage-option keys whose values are secrets (also any key naming a secret/token/password).
_SECRET_KEYS = {"access_key_id", "secret_access_key", "session_token", "token", "aws_access_key_id",
                "aws_secret_access_key", "aws_session_token"}
_SECRET_HINT = re.compile(r"secret|token|password|credential|access_key", re.I)
_STATUS = re.compile(r"status code: (\d{3})|HTTP (\d{3})")
#: What stores answer when they are out of space (MinIO, Ceph, SeaweedFS's own words).
_FULL = re.compile(r"InsufficientStorage|XMinioStorageFull|StorageFull|QuotaExceeded|No space left on device|"
                   r"no free volumes|No writable volumes")


class ErrorMap:
    """The error texts and types of one store whose storage options are ``options``."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self._secrets = sorted(
            {v for k, v in options.items() if v and (k.lower() in _SECRET_KEYS or _SECRET_HINT.search(k))}
            | {v for k, v in os.environ.items() if len(v) >= 8 and k.upper() in
               ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")},
            key=len,
            reverse=True,
        )

    def scrub(self, text: str) -> str:
        """``text`` without any secret value or presigned-URL signature/credential."""
        for s in self._secrets:
            text = text.replace(s, "<redacted>")
        return re.sub(r"(Signature=|Credential=|X-Amz-Signature=|X-Amz-Credential=)[^\s,&\"]+", r"\1<redacted>",
                      text)

    def summary(self, e: BaseException) -> str:
        """A short, scrubbed one-line account of ``e``."""
        # obstore messages end in a long "Debug source:" dump; keep the first lines only
        text = str(e).split("\n\nDebug source:")[0].strip()
        lines = [ln for ln in text.splitlines() if ln.strip()][:3]
        return self.scrub(f"{type(e).__name__}: {' | '.join(lines)}"[:600])

    def translate(self, e: BaseException, url: str, what: str) -> ObjectStoreError:
        """Our typed error for an obstore/OS failure of ``what`` on the object at ``url``."""
        msg = f"{what} failed ({self.summary(e)})"
        if isinstance(e, ObjectStoreError):
            return e
        if isinstance(e, FileNotFoundError):
            return ObjectNotFoundError(errno.ENOENT, f"{what}: no such object", url)
        if isinstance(e, (obx.PermissionDeniedError, obx.UnauthenticatedError)):
            return ObjectStorePermissionError(errno.EACCES, msg, url)
        status = status_of(str(e))
        if status in (401, 403):
            return ObjectStorePermissionError(errno.EACCES, msg, url)
        if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
            return ObjectStoreTimeoutError(errno.ETIMEDOUT, msg, url)
        if status == 507 or _FULL.search(str(e)):
            return ObjectStoreFullError(errno.ENOSPC, f"{what} failed: the store is out of space ({self.summary(e)})",
                                        url)
        return ObjectStoreUnavailableError(errno.EIO, msg, url)


def retryable(err: ObjectStoreError, e: BaseException) -> bool:
    """Whether the failure ``e`` (translated to ``err``) may pass on another try."""
    if isinstance(err, (ObjectNotFoundError, ObjectStorePermissionError, ObjectIntegrityError)):
        return False
    if isinstance(e, (obx.InvalidPathError, obx.NotSupportedError, obx.UnknownConfigurationKeyError)):
        return False
    status = status_of(str(e))
    return status is None or status >= 500 or status in (408, 409, 429)


def status_of(text: str) -> int | None:
    """The HTTP status an obstore error text names, if any."""
    m = _STATUS.search(text)
    if not m:
        return None
    return int(next(g for g in m.groups() if g))
