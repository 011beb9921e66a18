"""``asyncckpt gc``: remove leftovers and, with ``--keep-last``, old complete checkpoints
(of a local root, or of an ``s3://`` root under its lease: ``_gc_remote``)."""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import time
import uuid
from typing import Any

from .._errors import CheckpointNotFoundError
from ..format._layout import deleting_dir_name
from ..reading import complete_checkpoints, scan, usage
from ..roots._badmarks import clear
from ..roots._scheme import is_url
from ..roots.posix import _ownership
from ..roots.posix._retention import choose_victims, leftovers, retire
from ..roots.posix._storage import DEFAULT_OPS, Storage, remove_tree
from ..threads._sync import run_sync
from ._args import command, positive_int, seconds
from ._remote_args import add_remote_arguments, refuse_remote_options
from ._reports import Report


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = command(
        sub,
        "gc",
        "remove leftovers and old checkpoints",
        "Remove leftovers of crashed save attempts and interrupted retirements and, with\n"
        "--keep-last N, retire resumable checkpoints beyond the newest N, under the library's own\n"
        "retention rules: only resumable checkpoints count (complete, not known bad), the newest\n"
        "resumable one is never removed, and a checkpoint is renamed out of the way (atomically,\n"
        "root fsynced) before its files are deleted. Leftovers modified within --min-age are kept,\n"
        "because a running job may still be writing them. Steps known bad (a verification or a\n"
        "load found them corrupt) and bad attempts set aside are reported and kept for inspection\n"
        "unless --remove-bad; incomplete directories with a committed name are only reported.\n"
        "Removing is writing: gc takes the root's ownership for its run and refuses a root a\n"
        "Checkpointer owns (--dry-run needs no ownership).\n\n"
        "ROOT may be an s3:// URL: gc then takes the root's lease (refused while a live job\n"
        "holds it; a lease its holder stopped renewing is taken over after its TTL) and removes\n"
        "step prefixes without a manifest, objects of attempts that lost a commit and incomplete\n"
        "multipart uploads older than --min-age (by the store's clock).",
        "  asyncckpt gc ckpt/ --dry-run\n  asyncckpt gc ckpt/ --keep-last 3\n  asyncckpt gc ckpt/ --min-age 0\n"
        "  asyncckpt gc s3://bucket/run1 --min-age 0 --storage-option endpoint=http://127.0.0.1:8333",
    )
    p.add_argument("--keep-last", type=positive_int, metavar="N", help="keep only the newest N resumable checkpoints")
    p.add_argument(
        "--remove-bad",
        action="store_true",
        help="also remove the steps known bad and the bad attempts set aside (never a resumable step)",
    )
    p.add_argument(
        "--by-commit-order",
        action="store_true",
        help="with --keep-last: newest means most recently committed, not highest step (for roots "
        "saved with allow_earlier_steps=True, where an earlier step may be committed later)",
    )
    p.add_argument(
        "--min-age",
        type=seconds,
        default=3600.0,
        metavar="SECONDS",
        help="only remove leftovers not modified for this long (default: 3600)",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    add_remote_arguments(p)
    return p


def _retire(root: str, keep_last: int, by_commit_order: bool) -> list[int]:
    """Run the library's own retention (rename to ``.deleting-``, fsync the root, remove)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-gc") as pool:
        return run_sync(lambda: retire(Storage(pool), root, keep_last, by_commit_order=by_commit_order))


def run(args: argparse.Namespace) -> int:
    """Remove old leftovers and, with ``--keep-last``, complete checkpoints beyond the newest N.

    Raises ``RootInUseError`` (exit status 1) if a Checkpointer owns the root: one root has
    one writer at a time, and gc removes files. ``--dry-run`` reads only.
    """
    root: str = args.root
    if is_url(root):
        from ._gc_remote import run_remote  # imports obstore: only for URLs

        return run_remote(args)
    refuse_remote_options(args, root)
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"{root} is not a directory")
    if args.dry_run:
        return _run(args, root)
    own = _ownership.acquire(root, [], role="asyncckpt gc")
    try:
        return _run(args, root)
    finally:
        own.release()


def _remove_bad(root: str, name: str, step: int, attempt: str | None) -> None:
    """Remove a known-bad step directory or a bad attempt set aside: renamed to a
    ``.deleting-`` name first (a crash leaves a leftover, never a half-removed step), the
    root fsynced, then its files removed and its bad mark dropped."""
    src = os.path.join(root, name)
    dst = os.path.join(root, deleting_dir_name(step, uuid.uuid4().hex[:16]))
    try:
        os.rename(src, dst)
    except FileNotFoundError:
        return  # removed meanwhile
    DEFAULT_OPS.fsync_dir(root)
    remove_tree(dst, DEFAULT_OPS)
    if attempt is not None:
        clear(root, step, attempt)


def _run(args: argparse.Namespace, root: str) -> int:
    dry: bool = args.dry_run
    now = time.time()
    # every step's state first: marks that cannot be read (CheckpointReadError) stop gc
    # before it removes anything, rather than letting it retire by guess
    dirs = scan(root)
    out = Report(os.path.abspath(root), dry, not args.json, args.min_age)
    for path in leftovers(root):
        name = os.path.basename(path)
        try:
            use = usage(path)
        except FileNotFoundError:
            continue
        age = now - use.modified
        if age < args.min_age:
            out.kept(name, age)
            continue
        what = "crashed save attempt" if ".tmp-" in name else "interrupted retirement"
        if not dry:
            try:
                remove_tree(path, DEFAULT_OPS)
            except FileNotFoundError:
                pass  # removed concurrently (by the library's own clean-up): fine
        out.removed(name, f"leftover of a {what}", use.size)
    if args.keep_last is not None:
        infos = complete_checkpoints(root)  # resumable ones: the same rule as the library's retention
        sizes = {}
        for i in infos:
            try:
                sizes[i.step] = usage(str(i.path)).size
            except FileNotFoundError:
                sizes[i.step] = 0
        if not dry:
            victims = _retire(root, args.keep_last, args.by_commit_order)
        else:
            victims = choose_victims(infos, args.keep_last, by_commit_order=args.by_commit_order)
        for step in victims:
            out.retired(step, sizes.get(step, 0))
        out.keeping([i.step for i in infos if i.step not in victims])
    resumable = [d.step for d in dirs if d.resumable]
    bad = [d for d in dirs if d.state == "bad"]
    if bad and max(d.step for d in bad) > max(resumable, default=-1):
        out.newest_bad(max(d.step for d in bad), max(resumable, default=None))
    for d in dirs:
        if d.state in ("bad", "aside"):
            reason = d.reason or (f"verification failed: {d.bad.get('reason')}: {d.bad.get('path')}" if d.bad else "")
            if args.remove_bad and not dry:
                _remove_bad(root, d.name, d.step, d.attempt)
            out.bad(d.name, d.step, d.state, reason, d.size, args.remove_bad)
        elif d.state == "incomplete":
            out.left_alone(d.name, d.problem, d.reason)
    return out.finish()
