"""``asyncckpt gc``: remove leftovers and, with ``--keep-last``, old complete checkpoints
(of a local root, or of an ``s3://`` root under its lease: ``_gc_remote``)."""

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
from ._remote_args import add_remote_arguments, refuse_remote_options


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
        "and refuses a root a Checkpointer owns (--dry-run needs no ownership).\n\n"
        "ROOT may be an s3:// URL: gc then takes the root's lease (refused while a live job\n"
        "holds it; a lease its holder stopped renewing is taken over after its TTL) and removes\n"
        "step prefixes without a manifest, objects of attempts that lost a commit and incomplete\n"
        "multipart uploads older than --min-age (by the store's clock).",
        "  asyncckpt gc ckpt/ --dry-run\n  asyncckpt gc ckpt/ --keep-last 3\n  asyncckpt gc ckpt/ --min-age 0\n"
        "  asyncckpt gc s3://bucket/run1 --min-age 0 --storage-option endpoint=http://127.0.0.1:8333",
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
    add_remote_arguments(p)
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
    if root.startswith("s3://"):
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


class Report:
    """What a gc run did, said as it goes (text) or as one JSON document at the end: the same
    lines and shape for a local root and an ``s3://`` one."""

    def __init__(self, root: str, dry: bool, text: bool, min_age: float) -> None:
        self.dry, self.text, self.min_age = dry, text, min_age
        self.doc: dict[str, Any] = {"root": root, "dry_run": dry, "removed": [], "kept": [], "retired": []}
        self.freed = 0

    def kept(self, name: str, age: float) -> None:
        self.doc["kept"].append({"name": name, "age_s": round(age, 3)})
        if self.text:
            say(
                f"kept {name}: modified {human_age(age)} ago, a save may still be writing it "
                f"(--min-age {self.min_age:g}s; pass --min-age 0 to remove it)"
            )

    def removed(self, name: str, what: str, size: int) -> None:
        self.doc["removed"].append({"name": name, "size": size})
        if self.text:
            say(f"{'would remove' if self.dry else 'removed'} {name} ({what}, {human_bytes(size)})")
        self.freed += size

    def retired(self, step: int, size: int) -> None:
        self.doc["retired"].append({"step": step, "size": size})
        if self.text:
            say(f"{'would retire' if self.dry else 'retired'} step {step} ({human_bytes(size)})")
        self.freed += size

    def keeping(self, steps: list[int]) -> None:
        self.doc["kept_steps"] = steps
        if steps and self.text:
            say(f"keeping {len(steps)} complete checkpoint(s): step {', '.join(map(str, steps))}")

    def left_alone(self, name: str, problem: str | None, reason: str | None) -> None:
        self.doc.setdefault("left_alone", []).append({"name": name, "problem": problem, "reason": reason})
        if self.text:
            say(f"left alone {name}: incomplete, {reason}; inspect it and remove it by hand if unwanted")

    def finish(self) -> int:
        self.doc.setdefault("kept_steps", [])
        self.doc.setdefault("left_alone", [])
        self.doc["freed"] = self.freed
        if self.text:
            say(f"{'would free' if self.dry else 'freed'} {human_bytes(self.freed)}")
        else:
            dump_json(self.doc)
        return 0


def _run(args: argparse.Namespace, root: str) -> int:
    dry: bool = args.dry_run
    now = time.time()
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
            out.retired(step, sizes.get(step, 0))
        out.keeping([i.step for i in infos if i.step not in victims])
    for d in scan(root):
        if not d.complete and d.problem not in ("save-leftover", "retire-leftover"):
            out.left_alone(d.name, d.problem, d.reason)
    return out.finish()
