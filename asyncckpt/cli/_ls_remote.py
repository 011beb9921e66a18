"""``asyncckpt ls s3://bucket/prefix``: one row per remote step prefix, complete or not."""

from __future__ import annotations

import argparse
import sys
import time

from ..remote import scan
from ._print import PROG, dump_json, human_age, human_bytes, say, table
from ._remote_args import storage_options


def run_remote(args: argparse.Namespace) -> int:
    url: str = args.root
    steps = scan(url, storage_options=storage_options(args))
    now = time.time()
    if args.json:
        dump_json([{"step": s.step, "name": s.name, "complete": s.complete, "status": s.status,
                    "resumable": s.status == "complete", "reason": s.reason or None, "size": s.nbytes,
                    "files": s.files, "ranks": s.world_size, "created": s.created, "attempt": s.attempt,
                    "run": s.run}
                   for s in steps])  # fmt: skip
        return 0
    if not steps:
        say(f"{PROG}: no step prefixes under {url}", sys.stderr)
        return 0
    rows = [[str(s.step), s.status, human_bytes(s.nbytes), str(s.files),
             "?" if s.world_size is None else str(s.world_size),
             "?" if s.created is None else human_age(now - s.created), s.name or f"step_{s.step:08d}/", s.reason]
            for s in steps]
    for line in table(["STEP", "STATUS", "SIZE", "FILES", "RANKS", "AGE", "PREFIX", "NOTE"], rows):
        say(line)
    return 0
