"""A rank of the collective read-fault test: ``python _readfault_worker.py RANK WORLD PORT ROOT OUT``.

Every rank saves steps 1 and 2 under ROOT (a faultfs mount); rank 0 then writes ``OUT.ready``
and every rank waits for ``OUT.go`` (the test arms an EIO on one rank's step-2 shard in
between). Then every rank loads ``load()`` and ``load(2)`` and reports what each raised.
Before that, a stale bad mark on step 1 must be dropped by ``load(1)`` (every rank verified
its files).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncckpt import Checkpointer
from asyncckpt.roots import _readfault
from asyncckpt.roots._badmarks import bad_mark, record_bad
from asyncckpt.roots.posix._discovery import read_manifest


def state_for(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((64 * 1024,), float(10 * step + rank)), "step": step, "rank": rank}


def outcome(fn: Any) -> dict[str, Any]:
    try:
        got = fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"type": type(e).__name__, "msg": str(e), "errno": getattr(e, "errno", None),
                "filename": getattr(e, "filename", None), "mro": [c.__name__ for c in type(e).__mro__]}
    return {"loaded": got["step"]}


def main() -> None:
    _readfault.BACKOFF_S = 0.05  # short pauses between tries: the test is about who raises what
    rank, world, port, root, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    result: dict[str, Any] = {"rank": rank}
    try:
        with Checkpointer(root, timeout=20) as ck:
            for step in (1, 2):
                ck.save(step, state_for(rank, step)).result(timeout=60)
            ck.flush()
            dist.barrier()
            # a stale mark on step 1 (an old verdict): an agreed load that verified every file drops it
            attempt = read_manifest(os.path.join(root, "step_00000001")).attempt
            if rank == 0:
                assert record_bad(root, 1, attempt, os.path.join(root, "step_00000001", "rank00001.safetensors"), "EIO")
            dist.barrier()
            result["load1"] = float(ck.load(1)["w"][0])
            dist.barrier()  # rank 0 drops the mark once the ranks agreed
            result["mark1"] = bad_mark(root, 1, attempt) is not None
            dist.barrier()
            if rank == 0:
                with open(f"{out}.ready", "w") as f:
                    f.write("1")
            end = time.monotonic() + 60
            while not os.path.exists(f"{out}.go") and time.monotonic() < end:
                time.sleep(0.05)
            t0 = time.monotonic()
            result["newest"] = outcome(ck.load)
            result["explicit"] = outcome(lambda: ck.load(2))
            result["took"] = time.monotonic() - t0
    except Exception:  # noqa: BLE001 - reported to the test
        result["crash"] = traceback.format_exc()
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
