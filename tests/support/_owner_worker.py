"""Real processes of the ownership tests (``tests/test_ownership.py``).

``python _owner_worker.py hold ROOT``
    build a Checkpointer on ROOT, commit step 1, print ``ready PID``, then sleep until killed.
``python _owner_worker.py job WHO ROOT GO DONE STEPS``
    one of two independent jobs: print ``ready``, wait for the file GO, build a Checkpointer
    on ROOT; refused: print ``refused MESSAGE-AS-JSON`` and exit; owner: print ``owner PID``,
    commit STEPS steps, print ``saved STEPS``, hold the root until the file DONE exists.
``python _owner_worker.py groups RANK WORLD PORT SHARED ROOT_A ROOT_B OUT``
    a rank of a 4-rank gloo job with the sub-groups [0, 1] and [2, 3]; writes ``OUT.RANK.json``.

:func:`try_construct` is the target of a ``multiprocessing`` spawn child.
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

from asyncckpt import Checkpointer, RootInUseError

WAIT_S = 60.0


def state(who: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + who)
    return {"w": torch.randn(1024, generator=g), "who": who, "step": step}


def _wait_for(path: str, limit: float = WAIT_S) -> None:
    end = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.002)


def try_construct(root: str, queue: Any) -> None:
    """Spawn child: try to build a Checkpointer on ``root``; report what happened on ``queue``."""
    try:
        Checkpointer(root, timeout=WAIT_S).close()
        queue.put(("constructed", "", os.getpid()))
    except RootInUseError as e:
        queue.put(("RootInUseError", str(e), os.getpid()))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        queue.put((type(e).__name__, str(e), os.getpid()))


def hold(root: str) -> None:
    ck = Checkpointer(root, timeout=WAIT_S)
    ck.save(1, state(0, 1)).result(timeout=WAIT_S)
    print("ready", os.getpid(), flush=True)
    time.sleep(300)


def job(who: int, root: str, go: str, done: str, steps: int) -> None:
    print("ready", flush=True)
    _wait_for(go)
    try:
        ck = Checkpointer(root, timeout=WAIT_S)
    except RootInUseError as e:
        print("refused", json.dumps(str(e)), flush=True)
        return
    print("owner", os.getpid(), flush=True)
    with ck:
        for step in range(1, steps + 1):
            ck.save(step, state(who, step)).result(timeout=WAIT_S)
        print("saved", steps, flush=True)
        _wait_for(done)


def groups(rank: int, world: int, port: str, shared: str, root_a: str, root_b: str, result: dict[str, Any]) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    group_a = dist.new_group([0, 1])
    group_b = dist.new_group([2, 3])
    mine = group_a if rank < 2 else group_b
    result["pid"] = os.getpid()
    owner = None
    if rank < 2:
        owner = Checkpointer(shared, process_group=group_a, timeout=20)
        result["shared"] = "owner"
    dist.barrier()  # group A owns the shared root now
    if rank >= 2:
        t0 = time.monotonic()
        try:
            Checkpointer(shared, process_group=group_b, timeout=20)
            result["shared"] = "constructed"
        except Exception as e:  # noqa: BLE001 - the test reads what happened
            result["shared"] = {"type": type(e).__name__, "msg": str(e), "elapsed": time.monotonic() - t0}
    dist.barrier()
    if owner is not None:
        owner.save(1, state(rank, 1)).result(timeout=WAIT_S)
        owner.close()
    dist.barrier()  # the shared root is free again
    if rank >= 2:
        with Checkpointer(shared, process_group=group_b, timeout=20) as ck:
            ck.save(2, state(rank, 2)).result(timeout=WAIT_S)
            result["shared_after_close"] = ck.steps()
    dist.barrier()
    with Checkpointer(root_a if rank < 2 else root_b, process_group=mine, timeout=20) as ck:
        ck.save(1, state(rank, 1)).result(timeout=WAIT_S)
        result["own_root_steps"] = ck.steps()


def main() -> None:
    kind = sys.argv[1]
    if kind == "hold":
        hold(sys.argv[2])
    elif kind == "job":
        job(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]))
    elif kind == "groups":
        rank, world, port, shared, root_a, root_b, out = sys.argv[2:9]
        result: dict[str, Any] = {"rank": int(rank)}
        try:
            groups(int(rank), int(world), port, shared, root_a, root_b, result)
        except BaseException as e:  # noqa: BLE001 - the test reads what happened from the file
            result["crash"] = "".join(traceback.format_exception(e))
        with open(f"{out}.{rank}.json.tmp", "w") as f:
            json.dump(result, f)
        os.rename(f"{out}.{rank}.json.tmp", f"{out}.{rank}.json")
        if rank == "0":
            # this process hosts the job's c10d store: stay until every rank is done with it
            for r in range(int(world)):
                try:
                    _wait_for(f"{out}.{r}.json", 60)
                except TimeoutError:
                    break
        sys.stdout.flush()
        os._exit(0)  # skip process-group teardown
    else:
        raise SystemExit(f"unknown kind {kind!r}")


if __name__ == "__main__":
    main()
