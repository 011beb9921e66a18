"""``asyncckpt ls``: one row per step entry of any root (a directory, an ``s3://`` prefix),
complete or not, read through the root's one listing (``Root.list_steps``)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ._args import command
from ._print import PROG, dump_json, human_age, human_bytes, say, table
from ._remote_args import add_storage_options, root_of

#: How long a listing of a store may take.
LIST_DEADLINE_S = 300.0
_PLURAL = {"directory": "directories", "prefix": "prefixes"}


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
    """Print one row per step entry (newest last); ``--json`` prints a JSON list."""
    root = root_of(args, LIST_DEADLINE_S)
    rows = root.list_steps()
    now = time.time()
    if args.json:
        dump_json([d.as_json(now) for d in rows])
        return 0
    if not rows:
        say(f"{PROG}: no step {_PLURAL[root.caps.step_noun]} under {args.root}", sys.stderr)
        return 0
    table_rows = []
    for d in rows:
        since = d.created if d.created is not None else d.modified
        note = d.reason or d.note or ""
        if d.state == "bad" and d.bad is not None:
            note = f"verification failed: {d.bad.get('reason')}: {d.bad.get('path')}"
        table_rows.append([
            str(d.step), d.status, human_bytes(d.size), str(d.files), "?" if d.ranks is None else str(d.ranks),
            "?" if since is None else human_age(now - since), d.name, d.run[:12] if d.run is not None else "-", note,
        ])  # fmt: skip
    header = ["STEP", "STATUS", "SIZE", "FILES", "RANKS", "AGE", root.caps.step_noun.upper(), "RUN", "NOTE"]
    for line in table(header, table_rows):
        say(line)
    return 0
