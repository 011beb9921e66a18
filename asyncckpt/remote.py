"""Checkpoints on S3-compatible object stores: push, pull, find and load them.

``push(root, "s3://bucket/prefix")`` uploads committed local checkpoints with the
object-store commit protocol (data objects under attempt-unique keys, then a conditional
create of the manifest as the commit point); ``pull(url, root)`` downloads one into a local
root as a committed checkpoint a ``Checkpointer`` resumes from; ``find_latest(url)`` and
``load(url)`` read straight from the store, verified. :func:`asyncckpt.find_latest` and
:func:`asyncckpt.load` accept ``s3://`` URLs and come here.

``storage_options`` are obstore S3 keys (``endpoint``, ``region``, ``access_key_id``,
``secret_access_key``, ``session_token``); missing ones come from the ``AWS_*`` environment.
Credentials never appear in errors or logs. Everything here is torch-free except :func:`load`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from .roots._scheme import is_url
from .roots.objstore._remote import (
    DEFAULT_DEADLINE_S,
    PushResult,
    RemoteCheckpointInfo,
    RemoteStep,
    find_latest,
    pull,
    push,
    scan,
)

__all__ = ["PushResult", "RemoteCheckpointInfo", "RemoteStep", "find_latest", "is_url", "load", "pull", "push",
           "scan"]


def load(
    url: str,
    step: int | None = None,
    *,
    into: Any = None,
    verify: bool = True,
    rank: int | None = None,
    strip_prefixes: Sequence[str] = (),
    per_rank: Literal["error", "rank0"] = "error",
    verify_first: bool = False,
    storage_options: Mapping[str, str] | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> Any:
    """Load the newest (or ``step``) complete checkpoint under ``url`` as :func:`asyncckpt.load`
    loads a local one: the same rules and arguments (``rank``, ``per_rank``, ``into=`` read
    straight into and checksummed as the bytes land, ``verify_first``), DTensors assembled or
    resharded onto ``into``'s, by ranged GETs (CRC-32C verified), all within ``deadline_s``."""
    from .checkpointer._loader import check_load_args, read
    from .format._structure import check_strip_prefixes
    from .roots._registry import open_root

    prefixes = check_strip_prefixes(strip_prefixes)
    check_load_args(step, rank, per_rank, verify_first)
    if not is_url(url):
        raise ValueError(f"not an object-store URL (s3://bucket/prefix): {url!r}")
    root = open_root(url, storage_options=storage_options, deadline_s=deadline_s)
    try:
        return read(root, step, into=into, verify=verify, rank=rank, strip_prefixes=prefixes, per_rank=per_rank,
                    verify_first=verify_first, deadline_s=deadline_s)
    finally:
        root.close()
