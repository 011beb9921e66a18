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


def split_url(url: str) -> tuple[str, str]:
    """The bucket and the prefix (no slashes around it) of ``s3://bucket/prefix``:
    ``ValueError`` for any other URL, a query or fragment, or an empty or relative segment.
    The one parse of an object-store URL (roots, ``mirror=``), without obstore."""
    from urllib.parse import urlsplit  # here: the module itself imports nothing

    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ValueError(f"object-store URL must look like s3://bucket/prefix, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError("object-store URL must not carry a query or fragment (pass storage_options=)")
    prefix = parts.path.strip("/")
    if any(seg in ("", ".", "..") for seg in prefix.split("/")) and prefix:
        raise ValueError(f"object-store prefix has an empty or relative segment: {prefix!r}")
    return parts.netloc, prefix
