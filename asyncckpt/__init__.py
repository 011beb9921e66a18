"""asyncckpt: checkpoint PyTorch training without stopping, and never lose a run to the save.

``Checkpointer.save()`` returns as soon as the state is copied into reusable staging
buffers; a background writer thread (one asyncio loop) writes safetensors shards, fsyncs
them, and commits a checksummed manifest atomically. Failures reach the caller on the
handle, at the next ``save()``, and at ``flush()``/``close()``. ``find_latest()`` and
``load()`` resume from the newest complete checkpoint.
"""

from ._checkpointer import Checkpointer, load
from ._discovery import find_latest
from ._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    RankFailure,
    RootInUseError,
    RootNotWritableError,
    SaveError,
    SaveTimeoutError,
)
from ._handle import SaveHandle
from ._info import CheckpointerStatistics, CheckpointInfo, SaveStatistics
from ._lifecycle import SaveState

__version__ = "0.1.0"

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "Checkpointer",
    "CheckpointerStatistics",
    "RankFailure",
    "RootInUseError",
    "RootNotWritableError",
    "SaveError",
    "SaveHandle",
    "SaveState",
    "SaveStatistics",
    "SaveTimeoutError",
    "__version__",
    "find_latest",
    "load",
]
