"""Deleting what is stored or half-stored: objects, empty "directories", incomplete multipart uploads.

:class:`Deletes` adds to a :class:`~._connection.Connection` the bulk :meth:`~Deletes.delete`,
the best-effort :meth:`~Deletes.remove_dirs`, and the housekeeping of incomplete multipart
uploads (:meth:`~Deletes.list_uploads`, :meth:`~Deletes.abort_uploads`,
:meth:`~Deletes.abort_upload`) through our own SigV4 client (``_s3uploads``: obstore has no
such call), which needs static credentials (:attr:`~Deletes.can_list_uploads`).
"""

from __future__ import annotations

import builtins
import errno
import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import obstore

from ..._errors import ObjectStoreError, ObjectStoreUnavailableError
from ...threads._deadline import Deadline
from ._connection import Connection
from ._forkguard import check_not_forked
from ._s3uploads import Upload, UploadsClient, UploadsError

log = logging.getLogger("asyncckpt")
T = TypeVar("T")

#: Seconds :meth:`Deletes.remove_dirs` may take at most (best effort housekeeping).
DIRS_S = 5.0


class Deletes(Connection):
    """The delete requests of an object store (see the module docstring)."""

    async def delete(self, keys: Sequence[str], deadline: float) -> None:
        """Delete ``keys`` (bulk requests; missing keys are fine)."""
        keys = [self._check_key(k) for k in keys]
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            await self._retrying(Deadline.at_monotonic(deadline), batch[0] if batch else "", "delete",
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
            await self._bounded(obstore.delete_async(self._make_store(until - time.monotonic()), list(dirs)),
                                Deadline.at_monotonic(until), dirs[0], "delete directories")
        except Exception as e:  # noqa: BLE001 - housekeeping, see above
            log.debug("could not delete directories under %s: %s", self.object_url(dirs[0]), self._errors.summary(e))
            return False
        return True

    @property
    def can_list_uploads(self) -> bool:
        """Whether incomplete multipart uploads can be listed and aborted (static credentials)."""
        return self._uploads is not None

    async def list_uploads(self, prefix: str, deadline: float) -> builtins.list[Upload]:
        """Incomplete multipart uploads whose key starts with ``prefix`` (keys relative)."""
        self._check_key(prefix, prefix=True)
        full = self._full_key(prefix)
        ups = await self._sigv4(prefix, deadline, "listing", "list uploads", lambda c: c.list_uploads(full))
        return [Upload(self._relative(u.key), u.upload_id, u.initiated) for u in ups]

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
        full = self._full_key(key)
        await self._sigv4(key, deadline, "aborting", "abort upload", lambda c: c.abort(full, upload_id))

    async def _sigv4(self, key: str, deadline: float, doing: str, what: str, call: Callable[[UploadsClient], T]) -> T:
        """``call`` our SigV4 client (on the I/O executor, within ``deadline``) for ``what`` on
        ``key``; its failures raised as :class:`ObjectStoreUnavailableError`, scrubbed."""
        check_not_forked()
        if self._uploads is None:
            raise ObjectStoreError(errno.ENOTSUP, f"{doing} multipart uploads needs static credentials",
                                   self.object_url(key))
        failure: ObjectStoreError | None = None
        try:
            got: T = await self._bounded(self._in_thread(call, self._uploads), Deadline.at_monotonic(deadline), key,
                                         what)
        except ObjectStoreError:
            raise
        except (UploadsError, OSError) as e:
            failure = ObjectStoreUnavailableError(errno.EIO, self._errors.scrub(str(e)), self.object_url(key))
        if failure is not None:
            raise failure
        return got
