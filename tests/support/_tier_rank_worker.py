"""A rank of the tier-mode test: gloo on localhost, one shared root mirrored to a store.

Run as ``python _tier_rank_worker.py PHASE RANK WORLD PORT ROOT URL OPTIONS_JSON OUT``.
``save``: every rank saves steps 1 and 2 of its own state and flushes (rank 0 uploads);
``resume``: on an empty root, every rank finds step 2 on the store and loads its own state;
``every``: ``mirror_every`` by time (2 s), each rank sleeping its own amounts before steps 1-4
(their clocks disagree), each save waited for; its ``save()`` call times in ``calls``.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncckpt import Checkpointer


def state_for(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(4096, generator=g), "rank": rank, "step": step}


def main() -> None:
    phase, rank, world, port, root, url, opts, out = sys.argv[1:9]
    r, w = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=w,
                            timeout=timedelta(seconds=60))
    result: dict[str, Any] = {"rank": r}
    try:
        every: dict[str, Any] = {"mirror_every": timedelta(seconds=2), "keep_last_remote": None}
        with Checkpointer(root, mirror=url, storage_options=json.loads(opts), timeout=60,
                          **({"keep_last": 1, "keep_last_remote": 1} if phase != "every" else every)) as ck:
            if phase == "every":
                for step, gap in enumerate([[0, 3, 0, 3], [0, 0, 3, 0]][r][:4], 1):
                    time.sleep(gap)
                    result.setdefault("calls", []).append(time.monotonic())
                    ck.save(step, state_for(r, step)).result(timeout=60)
                ck.flush(timeout=60)
                result["ok"] = True
            elif phase == "save":
                for step in (1, 2):
                    ck.save(step, state_for(r, step))
                ck.flush(timeout=60)
                result["ok"] = True
            else:
                latest = ck.latest()
                result["latest"] = None if latest is None else latest.step
                got = ck.load()
                want = state_for(r, 2)
                result["ok"] = bool(torch.equal(got["w"], want["w"]) and got["rank"] == r and got["step"] == 2)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    finally:
        with open(out, "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
