"""``asyncckpt verify``: recompute every checksum of one, or every, checkpoint."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .._errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ..format._layout import step_dir_name
from ..format._manifest import Manifest
from ..reading import candidate_steps, newest_complete, passed_over, step_bytes, verify_step
from ..roots._readfault import fault_of
from ..roots.posix._discovery import pin_step, unlisted_note
from ._args import UsageError, command, non_negative_int
from ._print import PROG, Progress, say
from ._remote_args import add_remote_arguments, root_of
from ._reports import report, summarize
from .info import note_passed_over


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = command(
        sub,
        "verify",
        "recompute every checksum",
        "Recompute the CRC-32C of every file of a checkpoint and check every rank's structure\n"
        "against its shard header, streaming the data (memory use stays small). Shows progress\n"
        "(bytes, rate, ETA) when stderr is a terminal, nothing when piped. A failure is remembered\n"
        "under ROOT/.asyncckpt/bad (when ROOT is writable): the step is then known bad ('asyncckpt\n"
        "ls' shows it, latest() and load() pass over it) until a verification of it passes.\n"
        "An I/O error (EIO, a timeout) is reported as 'unreadable', not corrupt, and marks nothing.\n"
        "Exits 0 when valid, 1 when a checkpoint is incomplete, corrupt or unreadable (naming the file).\n"
        "ROOT may be an s3:// URL: every object's CRC-32C is recomputed from ranged GETs\n"
        "(bounded memory) and the step's objects and sizes checked against its manifest.",
        "  asyncckpt verify ckpt/                # the newest resumable step (what load() resumes from)\n"
        "  asyncckpt verify ckpt/ --step 300\n"
        "  asyncckpt verify ckpt/ --all          # every step directory with a committed name\n"
        "  asyncckpt verify s3://bucket/run1 --storage-option endpoint=http://127.0.0.1:8333",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=non_negative_int, metavar="N",
                       help="verify this step (default: the newest resumable)")
    which.add_argument("--all", action="store_true", help="verify every step directory")
    add_remote_arguments(p)  # s3:// only
    return p


def _steps(root: str, args: argparse.Namespace) -> list[int]:
    if args.all:
        steps = candidate_steps(root)
        if not steps:
            raise CheckpointNotFoundError(f"no checkpoints under {root}")
        return steps
    if args.step is not None:
        return [args.step]
    skipped: dict[int, CheckpointCorruptError] = {}
    latest = newest_complete(root, skipped=skipped)
    if latest is None:
        raise CheckpointNotFoundError(f"no complete checkpoint under {root}")
    note_passed_over(passed_over(skipped), latest.step, "verifying")
    newer = [s for s in candidate_steps(root) if s > latest.step and s not in skipped]
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
    kind = root_of(args).caps.kind  # the registry's scheme check; no I/O
    if kind == "objstore":
        from ._verify_remote import run_remote  # the store's engine: ranged GETs (imports obstore)

        return run_remote(args)
    if kind != "posix":
        raise UsageError(f"verify reads a local directory or an s3:// URL, not {root!r}")
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"{root} is not a directory")
    steps = _steps(root, args)
    results: list[dict[str, Any]] = []
    opened: list[tuple[str, Manifest]] = []
    notes: dict[int, str | None] = {}
    for step in steps:
        try:
            with pin_step(root, step) as pinned:
                assert pinned.manifest is not None
                opened.append((pinned.path, pinned.manifest))
                notes[step] = unlisted_note(pinned.unlisted)  # files it ignores: said, never damage
        except CheckpointError as e:
            what = "incomplete" if os.path.lexists(os.path.join(root, step_dir_name(step))) else "not found"
            what = "unreadable" if fault_of(e) == "io" else what  # EIO on its manifest: not damage
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
            report(results, manifest.step, problems, os.path.abspath(step_dir), files, nbytes, args.json,
                   notes.get(manifest.step))  # fmt: skip
    finally:
        progress.close()
    return summarize(results, os.path.abspath(root), len(steps), args.json)
