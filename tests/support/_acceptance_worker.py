"""A rank of tests/test_acceptance.py's two-rank test: init gloo on localhost, run one scenario,
write a JSON result. Run as ``python _acceptance_worker.py SCENARIO RANK WORLD PORT ROOT OUT``.
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

from asyncckpt import Checkpointer, SaveError
from asyncckpt.format import _index
from asyncckpt.saving import _leadercommit


def replicated(step: int) -> dict[str, Any]:
    """A DDP-like state: the same tensors on every rank (dedupe writes each once, and the step
    gets a global index saying where)."""
    g = torch.Generator().manual_seed(step)
    return {"model": {f"w{i}": torch.randn(256, generator=g) for i in range(4)}, "step": step}


def scenario_index_unchecked(rank: int, world: int, root: str, result: dict[str, Any]) -> None:
    """The same with the committing rank's check off: what then commits."""
    if rank == 0:
        _leadercommit._CHECK_BEFORE_COMMIT = False
    with Checkpointer(root, keep_last=1, timeout=30) as ck:
        ck.save(1, replicated(1)).result(timeout=60)
        err = ck.save(2, replicated(2)).exception(timeout=60)
        ck.flush()
        result["error"] = None if err is None else str(err)
        result["steps"] = ck.steps()
        _index.MAX_INDEX_BYTES = 10  # the readers' bound, lowered as the other scenario does
        try:
            ck.load()
            result["load_error"] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            result["load_error"] = type(e).__name__


def scenario_index(rank: int, world: int, root: str, result: dict[str, Any]) -> None:
    with Checkpointer(root, keep_last=1, timeout=30) as ck:
        ck.save(1, replicated(1)).result(timeout=60)
        assert os.path.exists(os.path.join(root, "step_00000001", _index.INDEX))
        if rank == 0:  # the committing rank: its readers' bound, lowered, refuses the index
            _index.MAX_INDEX_BYTES = 10
        err = ck.save(2, replicated(2)).exception(timeout=60)
        try:
            ck.flush()
        except SaveError:
            pass  # (the same failure, reported once more there)
        _index.MAX_INDEX_BYTES = 1 << 30
        result["error"] = None
        if err is not None:
            result["error"] = {"type": type(err).__name__, "msg": str(err)}
            if isinstance(err, SaveError):
                result["error"]["failures"] = {
                    str(r): {"exc_type": f.exc_type, "message": f.message} for r, f in err.failures.items()
                }
        result["steps"] = ck.steps()
        loaded = ck.load()
        want = replicated(1)
        result["loaded_step1"] = loaded["step"] == 1 and all(
            torch.equal(loaded["model"][k], want["model"][k]) for k in want["model"]
        )


def main() -> None:
    scenario, rank, world, port, root, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    result: dict[str, Any] = {"rank": rank}
    try:
        globals()[f"scenario_{scenario}"](rank, world, root, result)
    except BaseException as e:  # noqa: BLE001 - the test reads what happened from the file
        result["crash"] = "".join(traceback.format_exception(e))
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip process-group teardown


if __name__ == "__main__":
    main()
