"""``asyncckpt ls``: one row per step directory, complete or not."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..reading import scan
from ..roots._scheme import is_url
from ._args import command
from ._print import PROG, dump_json, human_age, human_bytes, say, table
from ._remote_args import add_storage_options, refuse_remote_options


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = command(
        sub,
        "ls",
        "list every step directory, complete or not",
        "List every step directory under ROOT, oldest first, in the library's own states:\n"
        "complete (resumable: what latest() and load() take), bad (known bad: a verification or a\n"
        "load found it corrupt, or its files prove it damaged: corrupt manifest, size mismatch,\n"
        "...), aside (a bad attempt set aside when its step was saved again, kept for\n"
        "inspection), incomplete (no completion marker, leftovers of crashed save attempts or\n"
        "interrupted retirements), with their size, number of files (manifest included), ranks\n"
        "and age.",
        "  asyncckpt ls ckpt/\n  asyncckpt ls ckpt/ --json | jq '.[] | select(.resumable) | .step'\n"
        "  asyncckpt ls s3://bucket/run1 --storage-option endpoint=http://127.0.0.1:8333",
    )
    add_storage_options(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Print one row per step directory (newest last); ``--json`` prints a JSON list."""
    root: str = args.root
    if is_url(root):
        from ._ls_remote import run_remote  # imports obstore: only for URLs

        return run_remote(args)
    refuse_remote_options(args, root)
    dirs = scan(root)
    now = time.time()
    if args.json:
        dump_json([d.as_json(now) for d in dirs])
        return 0
    if not dirs:
        say(f"{PROG}: no step directories under {root}", sys.stderr)
        return 0
    rows = []
    for d in dirs:
        since = d.created if d.created is not None else d.modified
        note = d.reason or d.note or ""
        if d.state == "bad" and d.bad is not None:
            note = f"verification failed: {d.bad.get('reason')}: {d.bad.get('path')}"
        rows.append(
            [
                str(d.step),
                d.status,
                human_bytes(d.size),
                str(d.files),
                "?" if d.ranks is None else str(d.ranks),
                human_age(now - since),
                d.name,
                d.run[:12] if d.run is not None else "-",
                note,
            ]
        )
    for line in table(["STEP", "STATUS", "SIZE", "FILES", "RANKS", "AGE", "DIRECTORY", "RUN", "NOTE"], rows):
        say(line)
    return 0
