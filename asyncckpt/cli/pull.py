"""``asyncckpt pull``: download a checkpoint from an object store into a local root."""

from __future__ import annotations

import argparse
from typing import Any

from ._args import Formatter, non_negative_int
from ._print import dump_json, say
from ._remote_args import add_remote_arguments, check_url, deadline_s, storage_options


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "pull",
        help="download a checkpoint from s3://bucket/prefix into ROOT",
        description=(
            "Download the newest complete checkpoint under URL (or --step N) into ROOT as a\n"
            "committed checkpoint (written as step_N.tmp-<attempt>/, each file's space reserved\n"
            "before its first byte is fetched so a full disk fails at once, every file CRC-32C\n"
            "checked and fsynced, the manifest last, then renamed to step_N): a Checkpointer on ROOT\n"
            "resumes from it. Takes ROOT's ownership for the run (refuses a root a Checkpointer owns)."
        ),
        epilog="examples:\n  asyncckpt pull s3://bucket/run1 /nvme/run1\n",
        formatter_class=Formatter,
    )
    p.add_argument("url", metavar="URL", help="s3://bucket/prefix")
    p.add_argument("root", metavar="ROOT", help="the local checkpoint root (created if missing)")
    p.add_argument("--step", type=non_negative_int, metavar="N", help="the step to pull (default: newest complete)")
    add_remote_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    from ..remote import pull  # imports obstore: only when run

    check_url(args.url)
    step, status = pull(args.url, args.root, step=args.step, storage_options=storage_options(args),
                        deadline_s=deadline_s(args))
    if args.json:
        dump_json({"step": step, "status": status, "root": args.root})
    else:
        say(f"step {step}: {'pulled into' if status == 'pulled' else 'already in'} {args.root}")
    return 0
