"""Conditional writes that tell who won, the probe that the store enforces them, the store's clock.

:class:`ConditionalWrites` adds to the reads of a store:

* :meth:`~ConditionalWrites.create_once` - a conditional create (``If-None-Match: *``, one PUT)
  that tells who won even when the response was lost: after *every* outcome the object is
  read back and compared with our bytes (which carry our attempt id).
* :meth:`~ConditionalWrites.replace_if` - a compare-and-swap (``If-Match: <ETag>``, one PUT),
  read back the same way: what the root lease (``_lease``) is renewed and taken over with.
* :meth:`~ConditionalWrites.probe` - with a throwaway key under the prefix's ``.asyncckpt/``
  metadata directory, that the store enforces conditional creates; a store that silently
  overwrites raises :class:`ConditionalWriteUnsupportedError` - no silent race.
* :meth:`~ConditionalWrites.server_time` - the store's clock, from a scratch object's
  ``last_modified``.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import errno
import logging
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import obstore
import obstore.exceptions as obx

from ..._errors import (
    ConditionalWriteUnsupportedError,
    ObjectNotFoundError,
    ObjectStoreError,
    ObjectStorePermissionError,
    ObjectStoreTimeoutError,
)
from ...format._layout import META_DIR
from ...threads._deadline import Deadline
from ._connection import MiB
from ._forkguard import check_not_forked
from ._reads import ObjectInfo, Reads

log = logging.getLogger("asyncckpt")

#: Largest object a single (conditional) PUT may carry on AWS.
MAX_SINGLE_PUT = 5 * 1024 * MiB
#: Least time left for deleting a probe's scratch object; with less it is left (harmless).
_SCRATCH_MIN_S = 0.05


@dataclass(frozen=True)
class CreateResult:
    """Outcome of :meth:`ConditionalWrites.create_once` / :meth:`ConditionalWrites.replace_if`:
    ``won`` iff the stored bytes are ours; ``stored`` is what the object holds (the winner's
    bytes when we lost; ``b""`` when it is gone), ``info`` its ETag and modification time as
    read back (``None`` when it is gone)."""

    won: bool
    stored: bytes
    attempts: int
    info: ObjectInfo | None = None


class ConditionalWrites(Reads):
    """The conditional writes of an object store (see the module docstring)."""

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
                    await self._bounded(obstore.put_async(self._store, key, b"second", mode="create"),
                                        Deadline.at_monotonic(deadline), key, "conditional-create probe")
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
            await self._retrying(Deadline.at_monotonic(deadline), key, "clock write",
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
            await self._bounded(obstore.delete_async(self._store, key), Deadline.at_monotonic(deadline), key,
                                "scratch clean-up")
        except Exception as e:  # noqa: BLE001 - harmless, see above
            log.debug("could not delete scratch object %s: %s", key, self._errors.scrub(str(e)))

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
        check_not_forked()
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
                    Deadline.at_monotonic(deadline), key, what,
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
