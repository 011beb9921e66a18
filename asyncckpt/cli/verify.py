"""``asyncckpt verify``: recompute every checksum of one, or every, checkpoint."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .._discovery import pin_step, unlisted_note
from .._errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from .._layout import step_dir_name
from .._manifest import Manifest
from .._readfault import fault_of
from ..reading import Problem, candidate_steps, newest_complete, passed_over, step_bytes, verify_step
from ._args import command, non_negative_int
from ._print import PROG, Progress, dump_json, human_bytes, say
from ._remote_args import add_remote_arguments, refuse_remote_options
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
    if root.startswith("s3://"):
        from ._verify_remote import run_remote

        return run_remote(args)
    refuse_remote_options(args, root)
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


def report(
    results: list[dict[str, Any]], step: int, problems: list[Problem], where: str, files: int, nbytes: int,
    as_json: bool,
    note: str | None = None,
) -> None:
    """Add the verdict on one verified step to ``results`` and, unless ``as_json``, print it
    (and ``note``: what decides nothing, such as files the manifest does not list)."""
    # retired by a running job while we read it: gone, not damaged; an I/O error: unreadable
    # (the storage failed, the data may be fine: nothing was marked)
    status = (
        "ok" if not problems
        else "not found" if all(p.vanished for p in problems)
        else "unreadable" if all(p.io or p.vanished for p in problems)
        else "corrupt"
    )  # fmt: skip
    results.append({
        "step": step, "status": status, "ok": not problems, "path": where, "files": files, "bytes": nbytes,
        "problems": [{"path": p.path, "reason": p.reason} for p in problems], "note": note,
    })  # fmt: skip
    if as_json:
        return
    if note is not None:
        say(f"{PROG}: step {step}: note: {note}", sys.stderr)
    for p in problems:
        say(f"{PROG}: step {step}: {status}: {p}", sys.stderr)
    if not problems:
        say(f"step {step}: ok ({files} files, {human_bytes(nbytes)} verified)")


def summarize(results: list[dict[str, Any]], root: str, asked: int, as_json: bool) -> int:
    """Print the closing summary (or the JSON document) and return the exit status: 0 when
    every result is ok."""
    results.sort(key=lambda r: int(r["step"]))
    good = sum(1 for r in results if r["ok"])
    if as_json:
        dump_json({"root": root, "ok": good, "failed": len(results) - good, "steps": results})
    elif asked > 1:
        say(f"{good} of {asked} checkpoints ok")
    return 0 if good == len(results) else 1
