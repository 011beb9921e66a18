"""``asyncckpt gc``: remove leftovers and, with ``--keep-last``, old complete checkpoints of any
root (a directory under its flock, an ``s3://`` prefix under its lease), written once against
:class:`asyncckpt.roots.Root`."""

from __future__ import annotations

import argparse
from typing import Any

from ..roots import Root
from ._args import UsageError, command, positive_int, seconds
from ._remote_args import add_remote_arguments, root_of
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


def run(args: argparse.Namespace) -> int:
    """Remove old leftovers and, with ``--keep-last``, complete checkpoints beyond the newest N.

    Raises ``RootInUseError`` (exit status 1) if a Checkpointer owns the root (its flock, a
    live lease): one root has one writer at a time, and gc removes files. ``--dry-run``
    reads only and takes no ownership.
    """
    root = root_of(args)
    if args.by_commit_order and not root.caps.by_commit_order:
        raise UsageError("--by-commit-order applies to local roots (an object-store root keeps the highest steps)")
    try:
        if args.dry_run:
            return _run(args, root)
        claim = root.claim("asyncckpt gc")
        try:
            return _run(args, root)
        finally:
            claim.release()
    finally:
        root.close()


def _run(args: argparse.Namespace, root: Root) -> int:
    dry: bool = args.dry_run
    # every step's state first: marks that cannot be read (CheckpointReadError) stop gc
    # before it removes anything, rather than letting it retire by guess
    rows = root.list_steps()
    out = Report(root.url, dry, not args.json, args.min_age)
    found = root.leftovers()
    doomed = []
    for x in found:
        if x.age_s < args.min_age:
            out.kept(x.name, x.age_s)
        else:
            doomed.append(x)
    if not dry:
        root.remove(doomed)
    for x in doomed:
        out.removed(x.name, x.what, x.size)
    if args.keep_last is not None:
        # resumable ones only: the library's retention rule (_stepstates.victims)
        sizes = {d.step: d.size for d in rows if d.resumable}
        retired = root.retire(args.keep_last, by_commit_order=args.by_commit_order, dry_run=dry)
        for step in retired:
            out.retired(step, sizes.get(step, 0))
        out.keeping(sorted(s for s in sizes if s not in retired))
    resumable = [d.step for d in rows if d.resumable]
    bad = [d.step for d in rows if d.state == "bad"]
    if bad and max(bad) > max(resumable, default=-1):
        out.newest_bad(max(bad), max(resumable, default=None))
    # a store's step prefix without a manifest is a leftover (prefixes are implicit), reported
    # once, as such; a directory with a committed name is left alone
    leftover_names = {x.name.rstrip("/") for x in found}
    for d in rows:
        if d.state in ("bad", "aside"):
            reason = d.reason or (f"verification failed: {d.bad.get('reason')}: {d.bad.get('path')}" if d.bad else "")
            if args.remove_bad and not dry:
                root.remove_bad(d)
            out.bad(d.name, d.step, d.state, reason, d.size, args.remove_bad)
        elif d.state == "incomplete" and d.name not in leftover_names:
            out.left_alone(d.name, d.problem, d.reason)
    return out.finish()
