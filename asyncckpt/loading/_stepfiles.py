"""The files of one complete step as a load reads them: each opened once, read by name.

:class:`StepFiles` is all the loaders (``_load.load_files``, ``_load_global``) know of where
a step lives: a file's path or URL (for messages), its size as the manifest lists it, a
source to read ranges of (``_readinto.Source``), the whole of a small file, and ``close``.
:class:`PinnedFiles` serves a pinned local step directory (``_discovery``: a retirement that
starts after a file was opened cannot touch the read); ``_remote_load.StoreFiles`` serves a
step on an object store with ranged GETs. One loader, two places to read from.
"""

from __future__ import annotations

import os
from typing import Protocol

from .._errors import CheckpointCorruptError, CheckpointNotFoundError
from ..format._checksum import crc32c
from ..format._manifest import MANIFEST, Manifest
from ..roots.posix._discovery import PinnedStep
from ._readinto import Source


class NoSuchShard(CheckpointNotFoundError):
    """The step exists but holds no shard for the rank asked for (no fallback for that)."""


class StepFiles(Protocol):
    """The files of one complete step (see the module docstring)."""

    manifest: Manifest

    def path(self, name: str) -> str:
        """Where ``name`` is, for messages (a path or a URL)."""
        ...

    def size(self, name: str) -> int:
        """``name``'s size as the manifest lists it (``CheckpointCorruptError`` if unlisted)."""
        ...

    def source(self, name: str) -> Source:
        """``name`` opened for ranged reads (once; closed by :meth:`close`)."""
        ...

    def read(self, name: str, expected_crc: int | None) -> bytes:
        """The whole of ``name``; ``CheckpointCorruptError`` unless it has its listed size
        (and, given ``expected_crc``, that CRC-32C)."""
        ...

    def close(self) -> None:
        """Release every source opened."""
        ...


class PinnedFiles:
    """The files of a pinned local step directory, opened at most once each, closed together."""

    def __init__(self, pinned: PinnedStep, manifest: Manifest) -> None:
        self.pinned, self.manifest = pinned, manifest
        self.fds: dict[str, int] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.pinned.path, name)

    def size(self, name: str) -> int:
        try:
            return self.manifest.file(name).size
        except CheckpointCorruptError:
            raise CheckpointCorruptError(f"manifest does not list {name}", self.path(MANIFEST)) from None

    def source(self, name: str) -> int:
        if name not in self.fds:
            self.fds[name] = self.pinned.open_file(name, self.size(name))
        return self.fds[name]

    def read(self, name: str, expected_crc: int | None) -> bytes:
        size = self.size(name)
        raw = read_all(self.source(name), size)
        if len(raw) != size or (expected_crc is not None and crc32c(raw) != expected_crc):
            raise CheckpointCorruptError("checksum mismatch", self.path(name))
        return raw

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def read_all(fd: int, size: int) -> bytes:
    """Up to ``size`` bytes of ``fd`` from its start (fewer if the file ends first)."""
    chunks = []
    pos = 0
    while pos < size:
        b = os.pread(fd, size - pos, pos)
        if not b:
            break
        chunks.append(b)
        pos += len(b)
    return b"".join(chunks)
