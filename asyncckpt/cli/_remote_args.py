"""The arguments of the commands that take ``s3://`` URLs: ``--storage-option KEY=VALUE``
(values never printed), ``--deadline``, and the URL check."""

from __future__ import annotations

import argparse

from ._args import UsageError


def add_remote_arguments(p: argparse.ArgumentParser) -> None:
    """``--deadline`` and ``--storage-option`` (push, pull)."""
    p.add_argument("--deadline", type=float, default=3600.0, metavar="S", help="give up after S seconds (default 3600)")
    add_storage_options(p)


def check_url(url: str) -> str:
    """``url`` if it is an ``s3://`` URL, else a usage error."""
    if not url.startswith("s3://"):
        raise UsageError(f"URL must be s3://bucket/prefix, not {url!r}")
    return url


def add_storage_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-option", action="append", default=[], metavar="KEY=VALUE", dest="storage_option",
        help="an obstore S3 option for s3:// URLs (endpoint, region, access_key_id, ...); repeatable;\n"
             "missing ones come from the AWS_* environment. Values are never printed.",
    )


def storage_options(args: argparse.Namespace) -> dict[str, str]:
    """The ``--storage-option`` pairs as a dict (a malformed one is a usage error, its value unshown)."""
    out: dict[str, str] = {}
    for item in getattr(args, "storage_option", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--storage-option must be KEY=VALUE (got one starting {item[:12]!r}...)")
        out[key.strip()] = value
    return out
