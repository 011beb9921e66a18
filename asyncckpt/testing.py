"""The documented test seams: the fault-injection hook of the save path.

``Checkpointer(root, os_ops=...)`` takes an :class:`OsOps` whose methods are the blocking OS
calls the save path makes (``mkdir``, ``open``, ``pwrite``, ``fallocate``, ``fsync``,
``rename``, ``unlink``, ...). Subclass it and override one call to make it raise (``ENOSPC``,
``EIO``), stall or record, standing in for a file system that fails there; the library's own
logic is never replaced. Not for production use: the default makes the real calls.
"""

from __future__ import annotations

from .roots.posix._storage import DEFAULT_OPS, OsOps

__all__ = ["DEFAULT_OPS", "OsOps"]
