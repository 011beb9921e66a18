"""The one registry of roots: :func:`open_root` turns a path or URL into a
:class:`~asyncckpt.roots._root.Root`, by the only scheme check of the package
(``_scheme.is_url`` for ``s3://``, :data:`~asyncckpt.roots._memory.SCHEME` for memory).

The object-store root is imported only for a URL (it imports obstore), so a local root costs
no more than the POSIX code."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ._memory import SCHEME as MEMORY_SCHEME
from ._memory import MemoryRoot
from ._root import Root
from ._scheme import SCHEME as S3_SCHEME
from ._scheme import is_url
from .posix._root import PosixRoot

#: The schemes :func:`open_root` knows, beside a local path.
SCHEMES = (S3_SCHEME, MEMORY_SCHEME)


def is_local(where: object) -> bool:
    """Whether ``where`` names a local directory (a path, not a URL of a known scheme)."""
    return isinstance(where, (str, os.PathLike)) and not (
        is_url(where) or (isinstance(where, str) and where.startswith(MEMORY_SCHEME)))  # fmt: skip


def open_root(
    where: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, str] | None = None,
    deadline_s: float | None = None,
) -> Root:
    """The root at ``where``: ``s3://bucket/prefix`` (an S3-compatible store; ``storage_options``
    as for ``Checkpointer``, each call bounded by ``deadline_s``), ``memory://name`` (this
    process's memory), or a local directory path. Makes no I/O and takes no ownership.

    ``TypeError`` for anything but a str or path; ``ValueError`` for an empty one, a URL of an
    unknown scheme, or options that mean nothing for a local root."""
    if not isinstance(where, (str, os.PathLike)):
        raise TypeError(f"a root is a path or an s3:// / memory:// URL str, not {type(where).__name__}")
    text = os.fspath(where)
    if not text:
        raise ValueError("a root must not be empty")
    if is_url(text):
        from .objstore._root import DEFAULT_DEADLINE_S, ObjectRoot  # obstore: only for URLs

        return ObjectRoot(text, storage_options, DEFAULT_DEADLINE_S if deadline_s is None else deadline_s)
    if storage_options or deadline_s is not None:
        raise ValueError(f"storage_options and deadline_s apply to s3:// URLs, not to {text!r}")
    if text.startswith(MEMORY_SCHEME):
        name = text[len(MEMORY_SCHEME):].strip("/")
        if not name:
            raise ValueError(f"a memory root needs a name: {MEMORY_SCHEME}NAME, not {text!r}")
        return MemoryRoot(name)
    scheme, sep, _ = text.partition("://")
    if sep and scheme.isidentifier():  # a URL of a scheme no root serves, not a directory name
        raise ValueError(f"unknown root scheme in {text!r}: a local path, s3://bucket/prefix or memory://name")
    return PosixRoot(text)
