"""``asyncckpt gc s3://bucket/prefix``: the remote counterpart of a local gc, under the root's lease."""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import time
from typing import Any

from ..format._layout import aside_key, data_prefix
from ..format._stepstates import state_of, victims, why_bad
from ..roots.objstore._lease import Lease, held
from ..roots.objstore._leftovers import remove, survey
from ..roots.objstore._remote import open_store, retire_remote
from ..roots.objstore._steps import remove_bad
from ..threads._sync import run_sync
from ._args import UsageError
from ._remote_args import deadline_s, storage_options
from ._reports import Report

_WHAT = {
    "uncommitted": "leftover of a save or push that never committed",
    "dead-attempt": "objects of an attempt that lost its step's commit",
    "upload": "incomplete multipart upload",
}


def run_remote(args: argparse.Namespace) -> int:
    """Remove the dead leftovers under the URL and, with ``--keep-last``, retire complete steps
    beyond the newest N, holding the root's lease for the run (``RootInUseError``, exit
    status 1, while a live job holds it). ``--dry-run`` reads only and takes no lease."""
    if args.by_commit_order:
        raise UsageError("--by-commit-order applies to local roots (an object-store root keeps the highest steps)")
    store = open_store(args.root, storage_options(args))
    deadline = time.monotonic() + deadline_s(args)
    if args.dry_run:
        return run_sync(lambda: _run(store, args, deadline, None))

    async def go() -> int:
        async with held(store, "asyncckpt gc", deadline) as lease:
            return await _run(store, args, deadline, lease)

    return run_sync(go)


async def _run(store: Any, args: argparse.Namespace, deadline: float, lease: Lease | None) -> int:
    dry = lease is None
    out = Report(store.url, dry, not args.json, args.min_age)
    found = await survey(store, deadline)
    # ages by the store's clock; a dry run writes nothing, so it goes by this machine's
    now = await store.server_time(deadline) if not dry and found.leftovers else _dt.datetime.now(_dt.timezone.utc)
    doomed = []
    for x in found.leftovers:
        age = (now - x.modified).total_seconds() if x.modified is not None else math.inf
        if age < args.min_age:
            out.kept(x.name, age)
        else:
            doomed.append(x)
    if lease is not None and doomed:
        lease.check()
        await remove(store, doomed, deadline)
    for x in doomed:
        out.removed(x.name, _WHAT[x.kind], x.size)
    if args.keep_last is not None:
        # the library's rule (_stepstates.victims): resumable steps only, never the newest
        retired = victims([(s, 0.0) for s in found.complete], args.keep_last)
        if lease is not None:
            lease.check()
            retired = await retire_remote(store, args.keep_last, deadline, lease)
        for step in sorted(retired):
            out.retired(step, found.nbytes.get(step, 0))
        out.keeping(sorted(s for s in found.complete if s not in retired))
    bad_steps = [s for s, p in found.bad.items() if p.committed is not None and state_of(p.committed) == "bad"]
    if bad_steps and max(bad_steps) > max(found.complete, default=-1):
        out.newest_bad(max(bad_steps), max(found.complete, default=None))
    for step, p in sorted(found.bad.items()):
        if args.remove_bad and lease is not None:
            await remove_bad(store, p, deadline, lease)
        for seen in p.seen:
            state = state_of(seen)
            if state == "bad":
                size = sum(o.size for o in p.listed)
                out.bad(seen.name, step, "bad", why_bad(seen), size, args.remove_bad)
            elif state == "aside":
                a = seen.attempt or ""
                mine = data_prefix(step, a)
                size = sum(o.size for o in p.listed if o.key == aside_key(step, a) or o.key.startswith(mine))
                reason = "set aside when the step was saved again" + (
                    f"; verification failed: {seen.mark}" if seen.mark is not None else "")
                out.bad(seen.name + ".json", step, "aside", reason, size, args.remove_bad)
    for name, problem, reason in found.left_alone:
        if int(name[len("step_"):].rstrip("/")) not in found.bad:
            out.left_alone(name, problem, reason)
    return out.finish()
