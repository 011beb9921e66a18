"""asyncckpt: checkpoint PyTorch training without stopping, and never lose a run to the save.

``Checkpointer.save()`` returns as soon as the state is copied into reusable staging
buffers; a background writer thread (one asyncio loop) writes safetensors shards, fsyncs
them, and commits a checksummed manifest atomically. Failures reach the caller on the
handle, at the next ``save()``, and at ``flush()``/``close()``. ``find_latest()`` and
``load()`` resume from the newest complete checkpoint.

The names below are imported on first use (PEP 562), so ``import asyncckpt`` and the
torch-free parts (:mod:`asyncckpt.reading`, the ``asyncckpt`` command) never import torch
until a torch-backed name such as ``Checkpointer`` or ``load`` is touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    ConditionalWriteUnsupportedError,
    CoordinationLost,
    ObjectIntegrityError,
    ObjectNotFoundError,
    ObjectStoreError,
    ObjectStoreFullError,
    ObjectStorePermissionError,
    ObjectStoreTimeoutError,
    ObjectStoreUnavailableError,
    RankFailure,
    RanksFailedError,
    RanksTimeoutError,
    RootInUseError,
    RootNotWritableError,
    SaveError,
    SaveTimeoutError,
    StateChangedError,
)

if TYPE_CHECKING:
    from ._info import CheckpointerStatistics, CheckpointInfo, SaveStatistics
    from .checkpointer._facade import Checkpointer
    from .checkpointer._loader import load
    from .format._lifecycle import SaveState
    from .integrations.dcp import import_dcp
    from .ranks._every_rank import on_every_rank
    from .roots._find import find_latest
    from .roots.posix._ensure_dir import StaleDirectoryError, ensure_dir
    from .saving._handle import SaveHandle

__version__ = "0.1.0"

#: Public name -> the private module that defines it (imported when first asked for).
_LAZY = {
    "Checkpointer": ".checkpointer._facade",
    "load": ".checkpointer._loader",
    "find_latest": ".roots._find",
    "SaveHandle": ".saving._handle",
    "CheckpointerStatistics": "._info",
    "CheckpointInfo": "._info",
    "SaveStatistics": "._info",
    "SaveState": ".format._lifecycle",
    "ensure_dir": ".roots.posix._ensure_dir",
    "StaleDirectoryError": ".roots.posix._ensure_dir",
    "on_every_rank": ".ranks._every_rank",
    "import_dcp": ".integrations.dcp",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "Checkpointer",
    "CheckpointerStatistics",
    "ConditionalWriteUnsupportedError",
    "CoordinationLost",
    "ObjectIntegrityError",
    "ObjectNotFoundError",
    "ObjectStoreError",
    "ObjectStoreFullError",
    "ObjectStorePermissionError",
    "ObjectStoreTimeoutError",
    "ObjectStoreUnavailableError",
    "RankFailure",
    "RanksFailedError",
    "RanksTimeoutError",
    "RootInUseError",
    "RootNotWritableError",
    "SaveError",
    "SaveHandle",
    "SaveState",
    "SaveStatistics",
    "SaveTimeoutError",
    "StaleDirectoryError",
    "StateChangedError",
    "__version__",
    "ensure_dir",
    "find_latest",
    "import_dcp",
    "load",
    "on_every_rank",
]
