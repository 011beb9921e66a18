"""``asyncckpt verify``: recompute every checksum of one, or every, checkpoint."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .._errors import CheckpointError, CheckpointNotFoundError
from .._layout import step_dir_name
from .._manifest import Manifest
from ..reading import candidate_steps, find_latest, open_step, step_bytes, verify_step
from ._args import command, non_negative_int
from ._print import PROG, Progress, dump_json, human_bytes, say


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = command(
        sub,
        "verify",
        "recompute every checksum",
        "Recompute the CRC-32C of every file of a checkpoint and check every rank's structure\n"
        "against its shard header, streaming the data (memory use stays small). Shows progress\n"
        "(bytes, rate, ETA) when stderr is a terminal, nothing when piped. A failure is remembered\n"
        "under ROOT/.asyncckpt/bad so 'asyncckpt ls' marks the step (when ROOT is writable).\n"
        "Exits 0 when valid, 1 when a checkpoint is incomplete or corrupt (naming the file).",
        "  asyncckpt verify ckpt/                # the newest complete step (what load() resumes from)\n"
        "  asyncckpt verify ckpt/ --step 300\n"
        "  asyncckpt verify ckpt/ --all          # every step directory with a committed name",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=non_negative_int, metavar="N", help="verify this step (default: newest complete)")
    which.add_argument("--all", action="store_true", help="verify every step directory")
    return p


def _steps(root: str, args: argparse.Namespace) -> list[int]:
    if args.all:
        steps = candidate_steps(root)
        if not steps:
            raise CheckpointNotFoundError(f"no checkpoints under {root}")
        return steps
    if args.step is not None:
        return [args.step]
    latest = find_latest(root)
    if latest is None:
        raise CheckpointNotFoundError(f"no complete checkpoint under {root}")
    newer = [s for s in candidate_steps(root) if s > latest.step]
    if newer:
        say(
            f"{PROG}: note: {len(newer)} newer step director{'ies are' if len(newer) > 1 else 'y is'} incomplete "
            f"(step {', '.join(map(str, newer[:5]))}); verifying step {latest.step}, the newest complete one",
            sys.stderr,
        )
    return [latest.step]


def run(args: argparse.Namespace) -> int:
    """Verify the chosen steps; one ``ok`` line per good step, one error line per problem."""
    root: str = args.root
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"{root} is not a directory")
    steps = _steps(root, args)
    results: list[dict[str, Any]] = []
    opened: list[tuple[str, Manifest]] = []
    for step in steps:
        try:
            opened.append(open_step(root, step))
        except CheckpointError as e:
            what = "incomplete" if os.path.lexists(os.path.join(root, step_dir_name(step))) else "not found"
            results.append({"step": step, "status": what, "ok": False, "problems": [{"path": None, "reason": str(e)}]})
            if not args.json:
                say(f"{PROG}: step {step}: {what}: {e}", sys.stderr)
    progress = Progress(sys.stderr, sum(step_bytes(d, m) for d, m in opened), sys.stderr.isatty())
    try:
        for step_dir, manifest in opened:
            progress.label(f"verifying step {manifest.step}")
            problems = verify_step(root, step_dir, manifest, progress.advance)
            progress.close()
            files = len(manifest.files) + 1  # the manifest is a file of the checkpoint too
            nbytes = step_bytes(step_dir, manifest)
            # retired by a running job while we read it: gone, not damaged
            status = "ok" if not problems else "not found" if all(p.vanished for p in problems) else "corrupt"
            results.append(
                {
                    "step": manifest.step,
                    "status": status,
                    "ok": not problems,
                    "path": os.path.abspath(step_dir),
                    "files": files,
                    "bytes": nbytes,
                    "problems": [{"path": p.path, "reason": p.reason} for p in problems],
                }
            )
            if args.json:
                continue
            for p in problems:
                say(f"{PROG}: step {manifest.step}: {status}: {p}", sys.stderr)
            if not problems:
                say(f"step {manifest.step}: ok ({files} files, {human_bytes(nbytes)} verified)")
    finally:
        progress.close()
    results.sort(key=lambda r: int(r["step"]))
    good = sum(1 for r in results if r["ok"])
    if args.json:
        dump_json({"root": os.path.abspath(root), "ok": good, "failed": len(results) - good, "steps": results})
    elif len(steps) > 1:
        say(f"{good} of {len(steps)} checkpoints ok")
    return 0 if good == len(results) else 1
