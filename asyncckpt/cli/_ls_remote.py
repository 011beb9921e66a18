"""``asyncckpt ls s3://bucket/prefix``: one row per remote step prefix, complete or not."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..remote import RemoteStep, scan
from ._print import PROG, dump_json, human_age, human_bytes, say, table
from ._remote_args import storage_options


def run_remote(args: argparse.Namespace) -> int:
    url: str = args.root
    steps = scan(url, storage_options=storage_options(args))
    now = time.time()
    if args.json:
        dump_json([_as_json(s, url, now) for s in steps])
        return 0
    if not steps:
        say(f"{PROG}: no step prefixes under {url}", sys.stderr)
        return 0
    rows = [[str(s.step), s.status, human_bytes(s.size), str(s.files),
             "?" if s.world_size is None else str(s.world_size),
             "?" if s.created is None else human_age(now - s.created), s.name or f"step_{s.step:08d}/", s.reason]
            for s in steps]
    for line in table(["STEP", "STATUS", "SIZE", "FILES", "RANKS", "AGE", "PREFIX", "NOTE"], rows):
        say(line)
    return 0


def _as_json(s: RemoteStep, url: str, now: float) -> dict[str, Any]:
    """One row in the shape of a local ``ls --json`` row (``reading.StepDir.as_json``), key
    for key: what differs is where (a URL) and when (the store's clock)."""
    name = s.name.rstrip("/") or f"step_{s.step:08d}"
    modified = s.modified if s.modified is not None else s.created
    since = s.created if s.created is not None else modified
    return {
        "step": s.step,
        "name": name,
        "path": f"{url.rstrip('/')}/{name}",
        "status": s.status,
        "state": s.status,
        "resumable": s.status == "complete",
        "complete": s.complete,
        "problem": s.problem,
        # a step known bad by its mark says why in ``bad``, as a local row does
        "reason": None if s.bad is not None else (s.reason or None),
        "note": None,
        "bad": s.bad,
        "size": s.size,
        "files": s.files,
        "ranks": s.world_size,
        "attempt": s.attempt,
        "run": s.run,
        "created": s.created,
        "modified": modified,
        "age_s": None if since is None else round(now - since, 3),
    }
