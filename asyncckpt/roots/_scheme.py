"""The one place that tells an object-store URL from a local path: every check of a root's
kind goes through :func:`is_url` (no imports: the command line asks it before it knows which
side it needs)."""

from __future__ import annotations

from typing import TypeGuard

#: The URL scheme of an S3-compatible object store.
SCHEME = "s3://"


def is_url(root: object) -> TypeGuard[str]:
    """Whether ``root`` names an object store (``s3://...``) rather than a local path."""
    return isinstance(root, str) and root.startswith(SCHEME)
