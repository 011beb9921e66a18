"""The arguments of the commands that take ``s3://`` URLs: ``--storage-option KEY=VALUE``
(values never printed), ``--deadline``, and the URL check."""

from __future__ import annotations

import argparse
import math

from ..roots import Root, open_root
from ..roots._scheme import is_url
from ._args import UsageError

DEFAULT_DEADLINE_S = 3600.0


def add_remote_arguments(p: argparse.ArgumentParser) -> None:
    """``--deadline`` and ``--storage-option`` (push, pull)."""
    p.add_argument(
        "--deadline", type=_seconds, default=None, metavar="S",
        help="s3:// only: give up after S seconds (default 3600)",
    )  # fmt: skip
    add_storage_options(p)


#: The least ``--deadline``: below a millisecond no request could finish (``1e-320`` would
#: pass a plain "> 0" and give up at once).
MIN_DEADLINE_S = 0.001


def _seconds(text: str) -> float:
    """A deadline: a finite number of seconds, at least :data:`MIN_DEADLINE_S` (argparse turns
    the error into exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < MIN_DEADLINE_S:
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds, at least {MIN_DEADLINE_S:g}, not {text!r}"
        )
    return value


def deadline_s(args: argparse.Namespace) -> float:
    """``--deadline`` in seconds (3600 when not given)."""
    value: float | None = getattr(args, "deadline", None)
    return DEFAULT_DEADLINE_S if value is None else value


def refuse_remote_options(args: argparse.Namespace, root: str) -> None:
    """A usage error when ``--storage-option`` or ``--deadline`` is given for a local ``root``:
    they mean something only for ``s3://`` URLs, and a flag that is silently ignored misleads."""
    # "given" is not None and not empty (a value argparse accepted is given, whatever it is)
    given = [flag for flag, dest in (("--storage-option", "storage_option"), ("--deadline", "deadline"))
             if getattr(args, dest, None) not in (None, [])]  # fmt: skip
    if given:
        raise UsageError(f"{' and '.join(given)} apply to s3:// URLs only, not to the local root {root!r}")


def root_of(args: argparse.Namespace, default_deadline_s: float = DEFAULT_DEADLINE_S) -> Root:
    """The root ``args.root`` names (``asyncckpt.roots.open_root``, no I/O), with the
    ``--storage-option`` and ``--deadline`` (default ``default_deadline_s``) of a store; for
    any other root those flags are a usage error (:func:`refuse_remote_options`), and so is a
    root ``open_root`` refuses (an unknown scheme)."""
    where: str = args.root
    try:
        root = open_root(where)
    except ValueError as e:  # an empty root, a URL of a scheme no root serves
        raise UsageError(str(e)) from None
    if root.caps.kind != "objstore":
        refuse_remote_options(args, where)
        return root
    value: float | None = getattr(args, "deadline", None)
    return open_root(where, storage_options=storage_options(args),
                     deadline_s=default_deadline_s if value is None else value)  # fmt: skip


def check_url(url: str) -> str:
    """``url`` if it is an ``s3://`` URL, else a usage error."""
    if not is_url(url):
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
