"""The newest resumable checkpoint of a root, whichever its kind: ``asyncckpt.find_latest``,
and the one description of a found step (:func:`describe`).

One path for every root: the root is opened by the registry (``open_root``), its newest
resumable step found by the root's own look (``Root.resumable``: the rule of
``format._stepstates``, a stable listing, known-bad steps passed over, an I/O fault raised),
and described from the manifest that look read. Torch-free; obstore is imported only for an
``s3://`` URL.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping

from .._info import CheckpointInfo, RemoteCheckpointInfo
from ..format._layout import step_dir_name
from ..format._manifest import Manifest
from ._registry import open_root
from ._root import Root


def describe(root: Root, m: Manifest) -> CheckpointInfo | RemoteCheckpointInfo:
    """The info of committed step ``m`` (its manifest) of ``root``: the one place a found
    checkpoint is described. A store's is a :class:`RemoteCheckpointInfo` (``url``: the
    step's prefix, ``attempt``); any other root's a :class:`CheckpointInfo` whose ``path`` is
    the step's directory (``Root.locate``: absolute) on a file system, else the step's name
    with ``url`` where it is (as a save's info on that root names it)."""
    where = root.locate(m.step)
    if root.caps.kind == "objstore":
        return RemoteCheckpointInfo(m.step, where, m.nbytes, m.world_size, m.created, m.attempt, m.run)
    on_files = root.caps.kind == "posix"
    return CheckpointInfo(m.step, pathlib.Path(where if on_files else step_dir_name(m.step)), m.nbytes, m.world_size,
                          m.created, url=None if on_files else where, run=m.run)  # fmt: skip


def latest_in(root: Root) -> CheckpointInfo | RemoteCheckpointInfo | None:
    """The newest resumable checkpoint of ``root`` described (:func:`describe`), or ``None``."""
    found = root.resumable(newest=True)
    return describe(root, found[-1]) if found else None


def find_latest(
    root: str | os.PathLike[str], *, storage_options: Mapping[str, str] | None = None
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
    opened = open_root(root, storage_options=storage_options)
    try:
        return latest_in(opened)
    finally:
        opened.close()
