"""The object-store client (S3 and S3-compatible stores) on ``obstore``: :class:`ObjectStore`.

:class:`ObjectStore` is what an object-store backend of the commit protocol needs, as async
methods for the writer's event loop, each bounded by an absolute ``deadline``
(``time.monotonic()`` seconds). It is one class built from parts, each in its own module:

* ``_connection`` - the location, options and obstore client, key checks, and every request
  bounded by its deadline and retried (:class:`~._connection.Connection`, the base);
* ``_reads`` - HEAD, GET, parallel ranged GETs into buffers or a writer, CRC-32C, listing;
* ``_deletes`` - bulk deletes, empty "directories", incomplete multipart uploads;
* ``_puts`` - uploads from a buffer or a local file, verified (``put_file``, ``put_from``);
* ``_conditional`` - conditional create and compare-and-swap that tell who won
  (``create_once``, ``replace_if``), the probe that the store enforces them, its clock.

Throttling (503 SlowDown), 5xx and connection errors are retried with jittered exponential
backoff by obstore within the time left to the deadline, and once more by us for the whole
operation while time remains. Every failure is an :class:`ObjectStoreError` (a
``CheckpointError`` and an ``OSError`` with an errno and the object's URL as filename).
Credentials are never in a message or a repr: every error text is scrubbed of the secret
values of the storage options (``_errormap``), and the obstore exception is not chained.

:meth:`ObjectStore.open` builds the store and probes (with a throwaway key under the
prefix's ``.asyncckpt/`` metadata directory) that it enforces conditional creates; a store
that silently overwrites raises :class:`ConditionalWriteUnsupportedError` - no silent race.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ._conditional import ConditionalWrites
from ._puts import Puts


class ObjectStore(ConditionalWrites, Puts):
    """An object-store location ``s3://bucket/prefix``; keys are relative to the prefix.

    ``storage_options`` are obstore S3 config keys (``endpoint``, ``region``,
    ``access_key_id``, ``secret_access_key``, ``session_token``, ...); missing ones come from
    the standard ``AWS_*`` environment/config chain. ``allow_http`` is implied by an
    ``http://`` endpoint. Construction does no I/O; use :meth:`open` to also probe the store.
    """

    @classmethod
    async def open(cls, url: str, storage_options: Mapping[str, str] | None = None, *, deadline: float | None = None,
                   **kwargs: Any) -> ObjectStore:
        """Build the store and check it enforces conditional creates (see :meth:`probe`)."""
        store = cls(url, storage_options, **kwargs)
        await store.probe(deadline if deadline is not None else time.monotonic() + 60.0)
        return store
