"""A rank of the ``on_every_rank`` tests: init gloo on localhost, run the scenarios, write JSON.

Run as ``python _every_rank_worker.py SCENARIOS RANK WORLD PORT DIR OUT`` where SCENARIOS is
a comma-separated list run in order (every rank runs the same list: the calls pair up by
order, as collectives do). Each scenario records, per rank, what ``on_every_rank`` returned
or raised and how long it took.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

import asyncckpt
from asyncckpt import RanksFailedError, RanksTimeoutError


def describe(exc: BaseException) -> dict[str, Any]:
    d: dict[str, Any] = {"type": type(exc).__name__, "msg": str(exc)}
    if isinstance(exc, RanksFailedError):
        d["failures"] = {
            str(r): {"exc_type": f.exc_type, "errno": f.errno, "path": f.path, "global_rank": f.global_rank}
            for r, f in exc.failures.items()
        }
        d["missing"] = list(exc.missing)
        d["timeout"] = isinstance(exc, RanksTimeoutError)
        d["cause"] = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
    return d


def run(fn: Callable[[], Any], **kw: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        out: dict[str, Any] = {"value": asyncckpt.on_every_rank(fn, **kw)}
    except Exception as e:  # noqa: BLE001 - recorded for the test to assert on
        out = {"error": describe(e)}
    out["s"] = time.monotonic() - t0
    return out


def scenario_ok(rank: int, world: int, base: str) -> dict[str, Any]:
    def fn() -> Any:
        d = os.path.join(base, "ok", f"rank{rank}")
        asyncckpt.ensure_dir(d)
        return {"rank": rank, "dir": d, "pair": (rank, "x")}

    return run(fn, timeout=30)


def scenario_one_fails(rank: int, world: int, base: str) -> dict[str, Any]:
    def fn() -> Any:
        if rank == 2:
            raise FileExistsError(errno.EEXIST, "File exists", os.path.join(base, "epoch_1_step_297", "rng"))
        return rank

    return run(fn, timeout=30)


def scenario_not_json(rank: int, world: int, base: str) -> dict[str, Any]:
    return run(lambda: object() if rank == 1 else rank, timeout=30)


def scenario_subgroup(rank: int, world: int, base: str) -> dict[str, Any]:
    group = dist.new_group([1, 3])  # collective on the default group: every rank makes it
    if rank not in (1, 3):
        return {"skipped": True}

    def fn() -> Any:
        if rank == 3:
            raise PermissionError(errno.EACCES, "Permission denied", base)
        return rank

    return run(fn, group=group, timeout=30)


def scenario_absent(rank: int, world: int, base: str) -> dict[str, Any]:
    # rank 2 is alive but busy elsewhere for 4 s (a retry loop, a hung mkdir): the others
    # must not wait for it past the timeout; when it arrives it raises the same error
    def fn() -> Any:
        if rank == 2:
            time.sleep(4.0)
        return rank

    return run(fn, timeout=1.5)


def scenario_leader_slow(rank: int, world: int, base: str) -> dict[str, Any]:
    # rank 0 is slow inside fn past the others' patience (timeout + 5 s): they give up naming
    # it, and rank 0, finishing later with every report in hand, must raise the same error
    # instead of returning results the others never got
    def fn() -> Any:
        if rank == 0:
            time.sleep(7.5)
        return rank

    return run(fn, timeout=1.0)


def main() -> None:
    scenarios, rank, world, port, base, out = (
        sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6],
    )  # fmt: skip
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    result: dict[str, Any] = {"rank": rank}
    try:
        for name in scenarios:
            result[name] = globals()[f"scenario_{name}"](rank, world, base)
    except BaseException:  # noqa: BLE001 - reported in the result file
        result["crash"] = traceback.format_exc()
    with open(out, "w") as f:
        json.dump(result, f)
    # rank 0 hosts the store: it stays until every rank is done (no barrier: after a timeout
    # scenario the ranks finish at different times)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"test/done/{rank}", "1")
    if rank == 0:
        store.wait([f"test/done/{r}" for r in range(world)], timedelta(seconds=60))
    os._exit(0)


if __name__ == "__main__":
    main()
