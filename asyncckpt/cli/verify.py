"""``asyncckpt verify``: recompute every checksum of one, or every, checkpoint of any root,
through the one verification engine (``loading._verify``) and the root's step reader."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from .._errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ..loading._verify import step_bytes, verify_opened
from ..reading import passed_over
from ..roots import Listed, Root
from ..roots._readfault import fault_of
from ..roots._root import StepReader
from ..roots.posix._discovery import unlisted_note
from ._args import command, non_negative_int
from ._print import PROG, Progress, say
from ._remote_args import add_remote_arguments, root_of
from ._reports import report, summarize
from .info import note_passed_over

#: Entry states that carry a committed step's name (the others: leftovers, retirements, set aside).
_NAMED = ("complete", "bad", "incomplete")
#: How many steps ``--all`` holds open at once (a POSIX reader holds a directory descriptor).
HELD = 32


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = command(
        sub,
        "verify",
        "recompute every checksum",
        "Recompute the CRC-32C of every file of a checkpoint (and of every block its global index\n"
        "lists) and check every rank's structure against its shard header, streaming the data\n"
        "(memory use stays small): a step passes exactly when every rank of it loads. Shows\n"
        "progress (bytes, rate, ETA) when stderr is a terminal, nothing when piped. A failure is\n"
        "remembered as a bad mark on the root (when it is writable): the step is then known bad\n"
        "('asyncckpt ls' shows it, latest() and load() pass over it) until a verification of it\n"
        "passes. An I/O error (EIO, a timeout, a store's 503s) is reported as 'unreadable', not\n"
        "corrupt, and marks nothing. Exits 0 when valid, 1 when a checkpoint is incomplete, corrupt\n"
        "or unreadable (naming the file). ROOT may be an s3:// URL: the same checks, from ranged GETs.",
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


def _uncommitted(root: Root, row: Listed) -> bool:
    """Whether ``row`` is no commit at all: where the manifest is the commit point (a store),
    a step's name without one is an attempt that never committed; where the commit is a
    rename, the name is the commit and a missing manifest is an incomplete step."""
    return root.caps.commit != "rename" and row.problem == "no-marker"


def _named(root: Root, rows: list[Listed]) -> list[Listed]:
    return [r for r in rows if r.state in _NAMED and not _uncommitted(root, r)]


def _steps(root: Root, args: argparse.Namespace) -> list[int]:
    if args.all:
        rows = root.list_steps()
        steps = sorted({r.step for r in _named(root, rows)})
        for s in sorted({r.step for r in rows if _uncommitted(root, r)} - set(steps)):
            say(f"{PROG}: note: step {s} has no manifest (uncommitted): skipped", sys.stderr)
        if not steps:
            raise CheckpointNotFoundError(f"no checkpoints under {root.url}")
        return steps
    if args.step is not None:
        return [args.step]
    skipped: list[tuple[int, CheckpointCorruptError]] = []
    latest = root.newest_resumable(skipped)
    if latest is None:
        raise CheckpointNotFoundError(f"no complete checkpoint under {root.url}")
    note_passed_over(passed_over(dict(skipped)), latest, "verifying")
    if root.caps.commit == "rename":  # only there can a step's name stand without its commit
        passed = {s for s, _ in skipped}
        newer = sorted({r.step for r in _named(root, root.list_steps())
                        if r.step > latest and r.step not in passed and r.state == "incomplete"})  # fmt: skip
        if newer:
            say(
                f"{PROG}: note: {len(newer)} newer step director{'ies are' if len(newer) > 1 else 'y is'} incomplete "
                f"(step {', '.join(map(str, newer[:5]))}); verifying step {latest}, the newest complete one",
                sys.stderr,
            )
    return [latest]


def _not_opened(root: Root, step: int, e: CheckpointError) -> str:
    """What a step that could not be opened is: ``unreadable`` (an I/O error: no verdict),
    ``incomplete`` (a committed step whose files are not its manifest's, or a step's name
    without its commit where the name is the commit), or ``not found``."""
    if fault_of(e) == "io":
        return "unreadable"
    if isinstance(e, CheckpointCorruptError):
        return "incomplete"
    try:
        named = [r for r in _named(root, root.list_steps()) if r.step == step]
    except CheckpointError:
        named = []
    return "incomplete" if named else "not found"


def run(args: argparse.Namespace) -> int:
    """Verify the chosen steps; one ``ok`` line per good step, one error line per problem."""
    root = root_of(args)
    try:
        return _run(root, args)
    finally:
        root.close()


def _open(root: Root, step: int, results: list[dict[str, Any]], as_json: bool) -> StepReader | None:
    """``step`` held open, or ``None`` with its verdict added to ``results`` (and said)."""
    try:
        return root.open_reader(step)
    except CheckpointError as e:
        what = _not_opened(root, step, e)
        results.append({"step": step, "status": what, "ok": False,
                        "problems": [{"path": getattr(e, "path", None), "reason": str(e)}]})  # fmt: skip
        if not as_json:
            say(f"{PROG}: step {step}: {what}: {e}", sys.stderr)
        return None


def _run(root: Root, args: argparse.Namespace) -> int:
    steps = _steps(root, args)
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as held:
        # every step opened first (what the progress counts, what cannot be opened said
        # first); at most HELD of them stay open until verified, the others are opened again
        opened: list[tuple[int, StepReader | None, int]] = []
        for step in steps:
            reader = _open(root, step, results, args.json)
            if reader is None:
                continue
            if len(opened) < HELD:
                held.enter_context(reader)
                opened.append((step, reader, step_bytes(reader)))
            else:
                with reader:
                    opened.append((step, None, step_bytes(reader)))
        progress = Progress(sys.stderr, sum(n for _, _, n in opened), sys.stderr.isatty())
        try:
            for step, kept, _ in opened:
                reader = kept if kept is not None else _open(root, step, results, args.json)
                if reader is None:
                    continue  # retired since it was first opened: said as such
                with reader:
                    m = reader.manifest
                    progress.label(f"verifying step {m.step}")
                    problems = verify_opened(root, reader, progress.advance)
                    progress.close()
                    report(results, m.step, problems, reader.locate(), len(m.files) + 1, step_bytes(reader),
                           args.json, unlisted_note(list(reader.notes)))  # fmt: skip
        finally:
            progress.close()
    return summarize(results, root.url, len(steps), args.json)
