"""``asyncckpt push``: upload committed local checkpoints to an object store."""

from __future__ import annotations

import argparse
from typing import Any

from ._args import command, non_negative_int, positive_int
from ._print import dump_json, human_bytes, say
from ._remote_args import add_remote_arguments, check_url, deadline_s, storage_options


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = command(
        sub,
        "push",
        "upload committed checkpoints to s3://bucket/prefix",
        "Upload the complete checkpoints under ROOT (or --step N / --latest) to URL with the\n"
        "object-store commit protocol: each file goes to step_N/a-<attempt>/ (its CRC-32C checked\n"
        "against the manifest as it goes up, its stored size checked), then the local manifest,\n"
        "unchanged, is created once (If-None-Match: *) as step_N/manifest.json: the commit point.\n"
        "Idempotent: steps already committed there are skipped. An interrupted push leaves no\n"
        "complete-looking step; run it again. --keep-last N retires older remote checkpoints\n"
        "(manifest first, then objects). Needs no ownership of ROOT: it only reads.",
        "  asyncckpt push ckpt/ s3://bucket/run1 --latest\n"
        "  asyncckpt push ckpt/ s3://bucket/run1 --keep-last 5 --storage-option endpoint=http://127.0.0.1:8333",
    )
    p.add_argument("url", metavar="URL", help="s3://bucket/prefix")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=non_negative_int, action="append", metavar="N",
                       help="push step N (repeatable; default: every complete step)")
    which.add_argument("--latest", action="store_true", help="push only the newest complete step")
    p.add_argument("--keep-last", type=positive_int, metavar="N", help="afterwards keep only the newest N remote steps")
    add_remote_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    from ..remote import push  # imports obstore: only when run

    check_url(args.url)
    steps: Any = "latest" if args.latest else args.step
    results = push(args.root, args.url, steps=steps, storage_options=storage_options(args), keep_last=args.keep_last,
                   deadline_s=deadline_s(args))
    if args.json:
        dump_json([{"step": r.step, "status": r.status, "url": r.url, "bytes": r.nbytes, "seconds": r.seconds}
                   for r in results])
        return 0
    if not results:
        say(f"no complete checkpoint under {args.root}: nothing pushed")
    for r in results:
        rate = f" ({r.nbytes / r.seconds / 2**20:.0f} MiB/s)" if r.status == "pushed" and r.seconds > 0 else ""
        verb = "pushed" if r.status == "pushed" else "already there:"
        say(f"step {r.step}: {verb} {human_bytes(r.nbytes)} {r.url} in {r.seconds:.2f} s{rate}")
    return 0
