"""Telling a store that is out of space from one that is failing.

A store out of space does not always say so: MinIO answers 507 ``XMinioStorageFull`` (which
``ObjectStore`` maps to :class:`~asyncckpt.ObjectStoreFullError` itself), but
SeaweedFS answers every write with ``500 InternalError`` once no volume has room - also when
the room is held by deleted objects it has not reclaimed yet (it frees them only when it
vacuums a volume) - while reads and deletes go on working. Such a failure would read as "the
store is unavailable (EIO)" and send a user looking for a network fault.

:func:`explain` asks the store, once a write has failed for good: a tiny write (a few bytes
under the root's ``.asyncckpt/``) refused too, while a read (a LIST) answers, means the
store takes no writes at all: out of space (or read-only, which the message says too). Only
then is the failure an ``ObjectStoreFullError`` (ENOSPC) naming the cause; otherwise the
original error stands. Costs nothing unless a write already failed; bounded by a deadline.
"""

from __future__ import annotations

import errno
import time
import uuid

from ..._errors import ObjectStoreError, ObjectStoreFullError, ObjectStoreUnavailableError
from ...format._layout import META_DIR
from ._client import ObjectStore

#: Seconds the diagnosis may take at most (a tiny write and a LIST).
PROBE_S = 10.0
_PROBE = b"asyncckpt: is there room for a write?"


async def explain(store: ObjectStore, err: ObjectStoreUnavailableError, deadline: float) -> ObjectStoreError:
    """What to raise for ``err``, a write the store refused through every retry: ``err``
    itself, or an :class:`ObjectStoreFullError` when the store refuses even a tiny write
    while it answers a read (module docstring). Never raises the probe's own failures."""
    if isinstance(err, ObjectStoreFullError) or "status code: 500" not in str(err):
        return err  # named already, or not the plain refusal (503 is throttling, 502/504 a gateway)
    now = time.monotonic()
    until = min(deadline - 0.5, now + PROBE_S)  # within the caller's deadline, with a margin
    if until - now < 1.0:
        return err  # no time left to ask
    key = f"{META_DIR}/probe-{uuid.uuid4().hex}"
    try:
        await store.put_file(key, memoryview(_PROBE), now + 0.6 * (until - now))
    except ObjectStoreUnavailableError:
        try:
            await store.list(f"{META_DIR}/", until)
        except ObjectStoreError:
            return err  # reads fail too: the store is down, not full
        full = ObjectStoreFullError(
            errno.ENOSPC,
            f"the store is out of space: it refuses every write, a {len(_PROBE)}-byte one too, while it answers "
            "reads (full, or holding deleted objects whose space it has not reclaimed yet - SeaweedFS frees it "
            f"only when it vacuums a volume - or read-only); {err.strerror}",
            err.filename,
        )
        full.__cause__ = err
        return full
    except ObjectStoreError:
        return err
    try:
        await store.delete([key], until)
    except ObjectStoreError:
        pass  # a probe left under .asyncckpt/: harmless, never a checkpoint
    return err
