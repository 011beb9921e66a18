"""A rank of the agreed-fallback tests: ``python _fallback_worker.py RANK WORLD PORT ROOT OUT``.

Every rank saves steps 1 and 2; then rank ``BAD_RANK`` (env) flips one byte of its own step-2
shard, and every rank loads: ``load()`` must agree on step 1 everywhere, ``load(into=)`` must
restore step 1 everywhere, and ``load(step=2)`` must raise ``CheckpointCorruptError`` on every
rank without touching the targets. With ``RESAVE=1`` (env) every rank then saves step 2 again
and step 3: both must commit everywhere (issue 26).
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

from asyncckpt import CheckpointCorruptError, Checkpointer


def state_for(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((1024,), float(10 * step + rank)), "step": step, "rank": rank}


def main() -> None:
    rank, world, port, root, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    bad = int(os.environ["BAD_RANK"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    result: dict[str, Any] = {"rank": rank}
    try:
        with Checkpointer(root, timeout=20) as ck:
            for step in (1, 2):
                ck.save(step, state_for(rank, step)).result(timeout=60)
            dist.barrier()
            if rank == bad:
                path = os.path.join(root, "step_00000002", f"rank{rank:05d}.safetensors")
                with open(path, "r+b") as f:
                    f.seek(-3, os.SEEK_END)
                    b = f.read(1)
                    f.seek(-3, os.SEEK_END)
                    f.write(bytes([b[0] ^ 0x40]))
            dist.barrier()
            latest = ck.latest()
            result["latest"] = latest.step if latest else None
            got = ck.load()
            result["loaded"] = [got["step"], got["rank"], float(got["w"][0])]
            target = {"w": torch.zeros(1024), "step": -1, "rank": -1}
            ck.load(into=target)
            result["into"] = [target["step"], float(target["w"][0])]
            untouched = {"w": torch.zeros(1024), "step": -1, "rank": -1}
            try:
                ck.load(2, into=untouched, verify_first=True)  # no rank writes: one rank rejects
                result["explicit"] = "loaded"
            except CheckpointCorruptError as e:
                result["explicit"] = type(e).__name__
                result["explicit_msg"] = str(e)
            result["untouched"] = [untouched["step"], float(untouched["w"].abs().sum())]
            if os.environ.get("RESAVE"):  # issue 26: the run goes on past the bad step 2
                resaved: dict[str, Any] = {"latest_after_fallback": ck.latest().step}  # type: ignore[union-attr]
                infos = [ck.save(s, state_for(rank, s)).result(timeout=60) for s in (2, 3)]
                resaved["committed"] = [i.step for i in infos]
                resaved["latest"] = ck.latest().step  # type: ignore[union-attr]
                got = ck.load(2)
                resaved["step2"] = [got["step"], got["rank"], float(got["w"][0])]
                result["resaved"] = resaved
    except BaseException as e:  # noqa: BLE001 - the test reads what happened from the file
        result["crash"] = "".join(traceback.format_exception(e))
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    os._exit(0)


if __name__ == "__main__":
    main()
