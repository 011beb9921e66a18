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

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ._info import RemoteCheckpointInfo
from .format._layout import check_step
from .roots._scheme import is_url
from .roots.objstore._remote import DEFAULT_DEADLINE_S, RemoteStep, open_store, scan

__all__ = ["PushResult", "RemoteCheckpointInfo", "RemoteStep", "find_latest", "is_url", "load", "pull", "push",
           "scan"]


@dataclass(frozen=True)
class PushResult:
    """What :func:`push` did to one step: ``"pushed"``, or ``"present"`` (already committed
    remotely with these very manifest bytes: nothing uploaded)."""

    step: int
    status: Literal["pushed", "present"]
    url: str
    nbytes: int
    seconds: float


def find_latest(
    url: str, *, storage_options: Mapping[str, str] | None = None, deadline_s: float = 300.0
) -> RemoteCheckpointInfo | None:
    """The newest resumable checkpoint under ``url`` (``s3://bucket/prefix``), or ``None``:
    :func:`asyncckpt.find_latest` of the URL (the same look, the same rules), every request
    within ``deadline_s``."""
    from .roots._find import latest_in
    from .roots._registry import open_root

    if not is_url(url):
        raise ValueError(f"not an object-store URL (s3://bucket/prefix): {url!r}")
    root = open_root(url, storage_options=storage_options, deadline_s=deadline_s)
    try:
        found = latest_in(root)
    finally:
        root.close()
    assert found is None or isinstance(found, RemoteCheckpointInfo)
    return found


def push(
    root: str | os.PathLike[str],
    url: str,
    *,
    steps: str | int | Iterable[int] | None = None,
    storage_options: Mapping[str, str] | None = None,
    keep_last: int | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
    part_size: int | None = None,
) -> list[PushResult]:
    """Upload committed local checkpoints under ``root`` to ``url`` (``s3://bucket/prefix``)
    with the object-store commit protocol: every file under ``step_N/a-<attempt>/`` (its
    CRC-32C checked against the manifest as it goes up), then the local manifest, unchanged,
    created once as ``step_N/manifest.json``: the commit point (``roots._transfer``). Holds
    the prefix's lease while it runs.

    ``steps``: ``None`` every complete local step, ``"latest"`` the newest, or a step / list of
    steps. Idempotent: a step already committed remotely with the same manifest is skipped
    (``status="present"``). A local file whose CRC-32C differs from its manifest is never
    committed (``CheckpointCorruptError`` naming it). ``keep_last``: afterwards retire complete
    remote steps beyond the newest ``keep_last``. Everything within ``deadline_s``.
    """
    from .roots._transfer import copy_steps
    from .roots.objstore._root import ObjectRoot
    from .roots.posix._root import PosixRoot

    kwargs: dict[str, Any] = {} if part_size is None else {"part_size": part_size}
    store = open_store(url, storage_options, **kwargs)
    done = copy_steps(PosixRoot(root), ObjectRoot.over(store, deadline_s=deadline_s), steps, role="asyncckpt push",
                      keep_last=keep_last, deadline_s=deadline_s)  # fmt: skip
    return [PushResult(c.step, "pushed" if c.status == "copied" else "present", c.where, c.nbytes, c.seconds)
            for c in done]  # fmt: skip


def pull(
    url: str,
    root: str | os.PathLike[str],
    *,
    step: int | None = None,
    storage_options: Mapping[str, str] | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> tuple[int, str]:
    """Download the newest (or ``step``) complete checkpoint under ``url`` into local ``root``
    (created if missing) as a committed checkpoint a ``Checkpointer`` resumes from: written
    as ``step_N.tmp-<attempt>/``, each file's space reserved before its bytes come, every
    file CRC-32C checked and fsynced, the manifest last, renamed to ``step_N``
    (``roots._transfer``). Takes the root's ownership for the call (``RootInUseError`` if a
    Checkpointer owns it). Returns ``(step, "pulled")`` or ``(step, "present")`` when
    ``root`` already holds that very commit."""
    from .roots._transfer import copy_steps
    from .roots.objstore._root import ObjectRoot
    from .roots.posix._root import PosixRoot

    if step is not None:
        check_step(step)
    os.makedirs(os.fspath(root), exist_ok=True)
    src = ObjectRoot(url, storage_options, deadline_s)
    done = copy_steps(src, PosixRoot(root), "latest" if step is None else step, role="asyncckpt pull",
                      deadline_s=deadline_s)  # fmt: skip
    return done[0].step, "pulled" if done[0].status == "copied" else "present"


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
    from .format._state_prefixes import check_strip_prefixes
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
