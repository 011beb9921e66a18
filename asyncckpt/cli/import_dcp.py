"""``asyncckpt import``: convert a DCP checkpoint (``torch.distributed.checkpoint``) into a step."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ._args import Formatter, UsageError, non_negative_int
from ._print import dump_json, say


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "import",
        help="convert a DCP checkpoint into a step of ROOT",
        description=(
            "Convert the checkpoint torch.distributed.checkpoint's FileSystemWriter wrote in DCP_DIR\n"
            "(__R_I.distcp files and .metadata) into step N of ROOT, keeping its chunks: a\n"
            "Checkpointer on ROOT (or dcp.load through asyncckpt.integrations.dcp.StorageReader)\n"
            "then resumes from it at any world size, resharding. Written as step_N.tmp-<attempt>/,\n"
            "every file CRC-32C'd and fsynced, the manifest last, then renamed to step_N; an existing\n"
            "step is never overwritten. Reads one .distcp file at a time (memory: the largest file).\n\n"
            "DCP's .metadata is a Python pickle: reading it runs whatever code the file names, so\n"
            "the import needs --allow-pickle, for checkpoints you trust."
        ),
        epilog="examples:\n  asyncckpt import outputs/step-1000 ckpt/ --step 1000 --allow-pickle\n",
        formatter_class=Formatter,
    )
    p.add_argument("dcp_dir", metavar="DCP_DIR", help="the DCP checkpoint directory (holds .metadata)")
    p.add_argument("root", metavar="ROOT", help="the asyncckpt root to add the step to (created if missing)")
    p.add_argument("--step", type=non_negative_int, metavar="N", required=True, help="the step number to give it")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="read DCP's pickled .metadata (unpickling runs code the file names: only for trusted checkpoints)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    if not args.allow_pickle:
        raise UsageError(
            "DCP's .metadata is a Python pickle and reading it runs whatever code the file names; "
            "pass --allow-pickle to import a checkpoint you trust"
        )
    if not os.path.isdir(args.dcp_dir):
        raise FileNotFoundError(2, "No such directory", args.dcp_dir)
    from ..integrations.dcp import import_dcp  # imports torch: only when run

    step_dir = import_dcp(args.dcp_dir, args.root, args.step, allow_pickle=True)
    if args.json:
        dump_json({"step": args.step, "path": str(step_dir.resolve()), "source": os.path.abspath(args.dcp_dir)})
    else:
        say(f"step {args.step}: imported {args.dcp_dir} into {step_dir}")
    return 0
