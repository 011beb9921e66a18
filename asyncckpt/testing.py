"""The documented test seams: the save path's fault-injection hook and a read-only view of the staging buffers.

``Checkpointer(root, os_ops=...)`` takes an :class:`OsOps` whose methods are the blocking OS
calls the save path makes (``mkdir``, ``open``, ``pwrite``, ``fallocate``, ``fsync``,
``rename``, ``unlink``, ...). Subclass it and override one call to make it raise (``ENOSPC``,
``EIO``), stall or record, standing in for a file system that fails there; the library's own
logic is never replaced. Not for production use: the default makes the real calls.

:meth:`Checkpointer.staging_statistics` returns a :class:`StagingStatistics` (its free buffers
as :class:`StagingBuffer`): the read-only view tests take of the staging buffers.
"""

from __future__ import annotations

from ._info import StagingBuffer, StagingStatistics
from .roots.posix._osops import DEFAULT_OPS, OsOps

__all__ = ["DEFAULT_OPS", "OsOps", "StagingBuffer", "StagingStatistics"]
