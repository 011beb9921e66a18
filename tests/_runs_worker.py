"""A rank of the run-identity test: two gloo ranks whose views of one root path differ.

Run as ``python _runs_worker.py RANK WORLD PORT ROOT_A ROOT_B LINK OUT``. Both ranks first
save step 5 together under ROOT_A and, with other values, under ROOT_B (two commits of step
5, two attempts). Then rank 0 builds its Checkpointer on LINK while it points to ROOT_A, and
rank 1 (after a barrier) repoints LINK to ROOT_B and builds its own: the same root path, two
views, as two nodes with node-local disks would have. Each rank then tries ``load()`` and
``load(step=5)`` and reports what it got (JSON in OUT).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncckpt import Checkpointer


def state_for(rank: int, which: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + ord(which))
    return {"w": torch.randn(512, generator=g), "which": which}


def outcome(fn: Any) -> dict[str, Any]:
    try:
        got = fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": type(e).__name__, "msg": str(e)}
    return {"loaded": got["which"]}


def main() -> None:
    rank, world, port, root_a, root_b, link, out = sys.argv[1:8]
    r, w = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=w,
                            timeout=timedelta(seconds=60))
    result: dict[str, Any] = {"rank": r}
    try:
        for root, which in ((root_a, "a"), (root_b, "b")):
            with Checkpointer(root, timeout=30) as ck:
                ck.save(5, state_for(r, which))
                result[f"run_{which}"] = getattr(ck, "run_id", None)  # (absent before runs)
        if r == 0:
            ck = Checkpointer(link, timeout=30)  # LINK -> ROOT_A, pinned now
            dist.barrier()
        else:
            dist.barrier()
            tmp = link + ".new"
            os.symlink(root_b, tmp)
            os.replace(tmp, link)  # rank 1's view: LINK -> ROOT_B
            ck = Checkpointer(link, timeout=30)
        try:
            result["root"] = ck.root
            result["newest"] = outcome(ck.load)
            result["explicit"] = outcome(lambda: ck.load(step=5))
        finally:
            ck.close()
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    finally:
        with open(out, "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
