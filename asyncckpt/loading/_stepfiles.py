"""The files of one complete step as a load reads them: each opened once, read by name.

:class:`StepFiles` is all the loaders (``_load.load_files``, ``_load_global``) know of where
a step lives: a file's path or URL (for messages), its size as the manifest lists it, a
source to read ranges of (``_pread.Source``), the whole of a small file, and ``close``.
:class:`ReaderFiles` serves it from any root's :class:`~asyncckpt.roots._root.StepReader`
(``Root.open_reader``): a file descriptor where the medium has one (a POSIX directory: the
kernel's ``preadv`` and ``mmap``), else ranged reads through the reader (a store's ranged
GETs, memory). One loader, every root.
"""

from __future__ import annotations

import os
from typing import Protocol

from .._errors import CheckpointCorruptError, CheckpointNotFoundError
from ..format._checksum import crc32c
from ..format._manifest import MANIFEST, Manifest
from ..roots._root import StepReader
from ._pread import Source


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


class _ReaderRange:
    """One file of a step read by ranges through its reader (a ``_pread.RangeSource``)."""

    def __init__(self, reader: StepReader, name: str, order: int) -> None:
        self.reader, self.name, self.order = reader, name, order
        self.threads = reader.in_flight

    def read_exact(self, views: list[memoryview], offset: int) -> None:
        self.reader.readv(self.name, offset, views)


class ReaderFiles:
    """The files of the step ``reader`` holds open, each opened at most once; :meth:`close`
    closes the reader."""

    def __init__(self, reader: StepReader) -> None:
        self.reader, self.manifest = reader, reader.manifest
        self._sources: dict[str, Source] = {}

    def path(self, name: str) -> str:
        return self.reader.locate(name)

    def size(self, name: str) -> int:
        try:
            return self.manifest.file(name).size
        except CheckpointCorruptError:
            raise CheckpointCorruptError(f"manifest does not list {name}", self.path(MANIFEST)) from None

    def source(self, name: str) -> Source:
        if name not in self._sources:
            self.size(name)
            fd = self.reader.fileno(name)
            self._sources[name] = _ReaderRange(self.reader, name, len(self._sources)) if fd is None else fd
        return self._sources[name]

    def read(self, name: str, expected_crc: int | None) -> bytes:
        size = self.size(name)
        raw = self.reader.read(name, 0, size)
        if expected_crc is not None and crc32c(raw) != expected_crc:
            raise CheckpointCorruptError("checksum mismatch", self.path(name))
        return raw

    def close(self) -> None:
        self._sources.clear()
        self.reader.close()


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
