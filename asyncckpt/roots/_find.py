"""The newest resumable checkpoint of a root, whichever its kind: ``asyncckpt.find_latest``.

Torch-free; obstore is imported only for an ``s3://`` URL.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .._info import CheckpointInfo
from ._scheme import is_url
from .posix._discovery import newest_complete

if TYPE_CHECKING:
    from .objstore._remote import RemoteCheckpointInfo


def find_latest(
    root: str | os.PathLike[str], *, storage_options: dict[str, str] | None = None
) -> CheckpointInfo | RemoteCheckpointInfo | None:
    """The newest resumable checkpoint under ``root``, or ``None`` if there is none.

    Incomplete, corrupt-looking and leftover directories are skipped, and so is a step known
    bad (a verification or a load found its data corrupt: ``asyncckpt ls`` shows why). Safe against a
    writer retiring checkpoints meanwhile: ``None`` means no complete checkpoint was there
    across a stable listing. Raises ``CheckpointReadError`` for a root or a newer step it
    cannot read (an I/O fault is never taken for an incomplete step).
    ``root`` may be an ``s3://bucket/prefix`` URL (a :class:`RemoteCheckpointInfo` then;
    see :mod:`asyncckpt.remote`), with ``storage_options`` for its store.
    """
    if is_url(root):
        from .objstore._remote import find_latest as find_latest_remote  # obstore: only for a URL

        return find_latest_remote(str(root), storage_options=storage_options)
    return newest_complete(root)
