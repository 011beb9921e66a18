"""``asyncckpt gc``: remove leftovers and, with ``--keep-last``, old complete checkpoints."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import time
from typing import Any

from .. import _ownership
from .._errors import CheckpointNotFoundError
from .._retention import choose_by_commit_order, choose_victims, leftovers, retire
from .._storage import DEFAULT_OPS, Storage, remove_tree
from ..reading import complete_checkpoints, scan, usage
from ._args import command, positive_int, seconds
from ._print import dump_json, human_age, human_bytes, say


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = command(
        sub,
        "gc",
        "remove leftovers and old checkpoints",
        "Remove leftovers of crashed save attempts and interrupted retirements and, with\n"
        "--keep-last N, retire complete checkpoints beyond the newest N, under the library's own\n"
        "retention rules: only complete checkpoints count, the newest complete one is never\n"
        "removed, and a checkpoint is renamed out of the way (atomically, root fsynced) before\n"
        "its files are deleted. Leftovers modified within --min-age are kept, because a running\n"
        "job may still be writing them. Incomplete directories with a committed name are only\n"
        "reported, never removed. Removing is writing: gc takes the root's ownership for its run\n"
        "and refuses a root a Checkpointer owns (--dry-run needs no ownership).",
        "  asyncckpt gc ckpt/ --dry-run\n  asyncckpt gc ckpt/ --keep-last 3\n  asyncckpt gc ckpt/ --min-age 0",
    )
    p.add_argument("--keep-last", type=positive_int, metavar="N", help="keep only the newest N complete checkpoints")
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
    return p


def _retire(root: str, keep_last: int, by_commit_order: bool) -> list[int]:
    """Run the library's own retention (rename to ``.deleting-``, fsync the root, remove)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-gc") as pool:
        return asyncio.run(retire(Storage(pool), root, keep_last, by_commit_order=by_commit_order))


def run(args: argparse.Namespace) -> int:
    """Remove old leftovers and, with ``--keep-last``, complete checkpoints beyond the newest N.

    Raises ``RootInUseError`` (exit status 1) if a Checkpointer owns the root: one root has
    one writer at a time, and gc removes files. ``--dry-run`` reads only.
    """
    root: str = args.root
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"{root} is not a directory")
    if args.dry_run:
        return _run(args, root)
    own = _ownership.acquire(root, [], role="asyncckpt gc")
    try:
        return _run(args, root)
    finally:
        own.release()


def _run(args: argparse.Namespace, root: str) -> int:
    dry: bool = args.dry_run
    text = not args.json
    now = time.time()
    doc: dict[str, Any] = {"root": os.path.abspath(root), "dry_run": dry, "removed": [], "kept": [], "retired": []}
    freed = 0
    for path in leftovers(root):
        name = os.path.basename(path)
        try:
            use = usage(path)
        except FileNotFoundError:
            continue
        age = now - use.modified
        if age < args.min_age:
            doc["kept"].append({"name": name, "age_s": round(age, 3)})
            if text:
                say(
                    f"kept {name}: modified {human_age(age)} ago, a save may still be writing it "
                    f"(--min-age {args.min_age:g}s; pass --min-age 0 to remove it)"
                )
            continue
        what = "crashed save attempt" if ".tmp-" in name else "interrupted retirement"
        if not dry:
            try:
                remove_tree(path, DEFAULT_OPS)
            except FileNotFoundError:
                pass  # removed concurrently (by the library's own clean-up): fine
        doc["removed"].append({"name": name, "size": use.size})
        if text:
            say(f"{'would remove' if dry else 'removed'} {name} (leftover of a {what}, {human_bytes(use.size)})")
        freed += use.size
    kept_steps: list[int] = []
    if args.keep_last is not None:
        infos = complete_checkpoints(root)
        sizes = {}
        for i in infos:
            try:
                sizes[i.step] = usage(str(i.path)).size
            except FileNotFoundError:
                sizes[i.step] = 0
        if not dry:
            victims = _retire(root, args.keep_last, args.by_commit_order)
        elif args.by_commit_order:
            victims = choose_by_commit_order(infos, args.keep_last)
        else:
            victims = choose_victims([i.step for i in infos], args.keep_last)
        for step in victims:
            doc["retired"].append({"step": step, "size": sizes.get(step, 0)})
            if text:
                say(f"{'would retire' if dry else 'retired'} step {step} ({human_bytes(sizes.get(step, 0))})")
            freed += sizes.get(step, 0)
        kept_steps = [i.step for i in infos if i.step not in victims]
        if kept_steps and text:
            say(f"keeping {len(kept_steps)} complete checkpoint(s): step {', '.join(map(str, kept_steps))}")
    doc["kept_steps"] = kept_steps
    doc["left_alone"] = []
    for d in scan(root):
        if not d.complete and d.problem not in ("save-leftover", "retire-leftover"):
            doc["left_alone"].append({"name": d.name, "problem": d.problem, "reason": d.reason})
            if text:
                say(f"left alone {d.name}: incomplete, {d.reason}; inspect it and remove it by hand if unwanted")
    doc["freed"] = freed
    if text:
        say(f"{'would free' if dry else 'freed'} {human_bytes(freed)}")
    else:
        dump_json(doc)
    return 0
