"""``asyncckpt verify s3://bucket/prefix``: the remote counterpart of a local verify."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .._errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ..format._layout import step_dir_name
from ..format._manifest import Manifest
from ..loading._remote_verify import open_for_verify, verify_remote_step
from ..roots.objstore._remote import candidate_steps, open_store
from ..roots.objstore._steps import newest_resumable
from ..threads._sync import run_sync
from ._print import PROG, Progress, say
from ._remote_args import deadline_s, storage_options
from ._reports import report, summarize
from .info import note_passed_over


def run_remote(args: argparse.Namespace) -> int:
    """Verify the chosen remote steps: same lines, JSON and exit status as a local verify;
    a failure is remembered on the store as a bad mark, a pass drops it (best effort)."""
    url: str = args.root
    store = open_store(url, storage_options(args))
    deadline = time.monotonic() + deadline_s(args)
    return run_sync(lambda: _run(store, url, args, deadline))


async def _steps(store: Any, args: argparse.Namespace, deadline: float) -> list[int]:
    if args.all:
        steps = sorted(await candidate_steps(store, deadline))
        if not steps:
            raise CheckpointNotFoundError(f"no checkpoints under {store.url}")
        return steps
    if args.step is not None:
        return [args.step]
    passed: list[tuple[int, CheckpointCorruptError]] = []
    found = await newest_resumable(store, deadline, passed=passed)
    if found is None:
        raise CheckpointNotFoundError(f"no complete checkpoint under {store.url}")
    note_passed_over([(s, str(e)) for s, e in passed], found[0].step, "verifying")
    return [found[0].step]


async def _run(store: Any, url: str, args: argparse.Namespace, deadline: float) -> int:
    steps = await _steps(store, args, deadline)
    results: list[dict[str, Any]] = []
    opened: list[tuple[Manifest, int]] = []  # with the manifest's own bytes
    for step in steps:
        try:
            opened.append(await open_for_verify(store, step, deadline))
        except CheckpointError as e:
            if args.all and isinstance(e, CheckpointNotFoundError):
                # data without a manifest: an attempt that never committed, or one being retired
                say(f"{PROG}: note: step {step} has no manifest (uncommitted): skipped", sys.stderr)
                continue
            what = "not found" if isinstance(e, CheckpointNotFoundError) else "corrupt"
            path = getattr(e, "path", None)
            results.append({"step": step, "status": what, "ok": False, "problems": [{"path": path, "reason": str(e)}]})
            if not args.json:
                say(f"{PROG}: step {step}: {what}: {e}", sys.stderr)
    if args.all and not results and not opened:
        raise CheckpointNotFoundError(f"no committed checkpoints under {store.url}")
    progress = Progress(sys.stderr, sum(f.size for m, _ in opened for f in m.files), sys.stderr.isatty())
    try:
        for m, manifest_bytes in opened:
            progress.label(f"verifying step {m.step}")
            problems = await verify_remote_step(store, m, deadline, progress.advance)
            progress.close()
            nbytes = manifest_bytes + sum(f.size for f in m.files)  # what a local verify counts
            report(results, m.step, problems, store.object_url(step_dir_name(m.step)), len(m.files) + 1, nbytes,
                   args.json)  # fmt: skip
    finally:
        progress.close()
    return summarize(results, url, len(results), args.json)
