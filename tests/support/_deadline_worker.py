"""One rank of a deadline test on a node-local root (``test_deadline_ranks.py``): argv scenario
rank world port root out. Every rank is on one node (``ASYNCCKPT_NODE``), rank 0 its leader.
``CK_TIMEOUT``: the Checkpointer's timeout. Writes what happened to ``out.<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any


def _describe(e: BaseException) -> dict[str, Any]:
    return {"type": type(e).__name__, "msg": str(e), "missing": list(getattr(e, "missing", ()) or ()),
            "filename": getattr(e, "filename", None)}


def scenario_slow_start(rank: int, root: str, result: dict[str, Any]) -> None:
    """The leader's start (its mkdir of the root) takes ``SLOW_S``: construction must fail on
    every rank by the timeout counted from its call. Then a construction without the slow
    call, with ample time: the root was left to it (nothing held, nothing lost)."""
    from asyncckpt import Checkpointer
    from asyncckpt.testing import OsOps

    class SlowStart(OsOps):
        def mkdir(self, path: str, mode: int = 0o777) -> None:
            if os.path.abspath(path) == os.path.abspath(root):
                time.sleep(float(os.environ["SLOW_S"]))  # a disk that is slow to answer
            super().mkdir(path, mode)

    ops: Any = SlowStart() if rank == 0 else None
    t0 = time.monotonic()
    try:
        ck = Checkpointer(root, node_local=True, timeout=float(os.environ["CK_TIMEOUT"]),
                          **({"os_ops": ops} if ops is not None else {}))  # fmt: skip
    except Exception as e:  # noqa: BLE001 - what the test looks at
        result["ctor_error"] = _describe(e)
    else:
        ck.close()
    result["ctor_s"] = time.monotonic() - t0
    with Checkpointer(root, node_local=True, timeout=60) as ck:
        result["after"] = ck.steps()


def _wait_for(path: str, timeout: float = 60.0) -> None:
    """Until the test creates ``path`` (at most ``timeout`` s: the test fails on what follows)."""
    end = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.02)


def _save_then_wait_for_go(rank: int, root: str, out: str) -> None:
    """Save step 1 (each rank its own part), say so (``<OUT>.saved``), wait for ``<OUT>.go``."""
    import torch
    import torch.distributed as dist

    from asyncckpt import Checkpointer

    with Checkpointer(root, node_local=True, timeout=60) as ck:
        ck.save(1, {"w": torch.full((4096,), float(rank + 1))}).result(120)
    dist.barrier()
    if rank == 0:
        open(f"{out}.saved", "w").close()
    _wait_for(f"{out}.go")


def scenario_late_load(rank: int, root: str, result: dict[str, Any]) -> None:
    """Save step 1 (each rank its own part), then say so (``<OUT>.saved``) and wait for the
    test's go (``<OUT>.go``: its file system now makes rank 1's first read of its part slow).
    Rank 1 comes to ``load()`` ``LATE_S`` after rank 0: rank 0's load must end by its timeout.
    Then a second load, with the slow read spent: every rank loads its part (nothing lost)."""
    import torch.distributed as dist

    from asyncckpt import Checkpointer

    out = os.environ["OUT"]
    _save_then_wait_for_go(rank, root, out)
    with Checkpointer(root, node_local=True, timeout=float(os.environ["CK_TIMEOUT"])) as ck:
        dist.barrier()
        if rank == 1:
            time.sleep(float(os.environ["LATE_S"]))
        t0 = time.monotonic()
        try:
            ck.load()
        except Exception as e:  # noqa: BLE001 - what the test looks at
            result["load_error"] = _describe(e)
        result["load_s"] = time.monotonic() - t0
        dist.barrier()
        result["loaded"] = float(ck.load()["w"][0])


def scenario_stuck_read(rank: int, root: str, result: dict[str, Any]) -> None:
    """Save step 1 (each rank its own part), then say so (``<OUT>.saved``) and wait for the
    test's go (``<OUT>.go``: its file system now holds rank 1's read of its shard until the
    rules change). Both ranks load: each says how it ended (``<OUT>.loaded.<rank>``), and the
    test lets the held read go once both did (or gave up waiting), then says ``<OUT>.go2``.
    Then a second load: every rank loads its part (nothing lost)."""
    import torch.distributed as dist

    from asyncckpt import Checkpointer

    out = os.environ["OUT"]
    _save_then_wait_for_go(rank, root, out)
    with Checkpointer(root, node_local=True, timeout=float(os.environ["CK_TIMEOUT"])) as ck:
        dist.barrier()
        t0 = time.monotonic()
        try:
            ck.load()
        except Exception as e:  # noqa: BLE001 - what the test looks at
            result["load_error"] = _describe(e)
        result["load_s"] = time.monotonic() - t0
        open(f"{out}.loaded.{rank}", "w").close()
        _wait_for(f"{out}.go2")
        dist.barrier()
        result["loaded"] = float(ck.load()["w"][0])


def scenario_held_construction(rank: int, root: str, result: dict[str, Any]) -> None:
    """Save step 1 (each rank its own part), say so (``<OUT>.saved``; each rank's pid in
    ``<OUT>.pid.<rank>``) and wait for the test's go (``<OUT>.go``: its file system now holds
    a call until the rules change). Both ranks construct with ``CK_TIMEOUT`` (how it ended:
    ``ctor_error``, ``ctor_s``), each says so (``<OUT>.built.<rank>``), and the test lets the
    held call go once both did, then says ``<OUT>.go2``. Then a construction and a load: the
    root was left free (a call released late lets go of what it took) and every rank loads
    its part (nothing lost)."""
    import torch.distributed as dist

    from asyncckpt import Checkpointer

    out = os.environ["OUT"]
    with open(f"{out}.pid.{rank}", "w") as f:
        f.write(str(os.getpid()))
    _save_then_wait_for_go(rank, root, out)
    t0 = time.monotonic()
    try:
        node_local = os.environ.get("CK_NODE_LOCAL", "1") == "1"  # "0": the shared root's check
        Checkpointer(root, node_local=node_local, timeout=float(os.environ["CK_TIMEOUT"])).close()
    except Exception as e:  # noqa: BLE001 - what the test looks at
        result["ctor_error"] = _describe(e)
    result["ctor_s"] = time.monotonic() - t0
    open(f"{out}.built.{rank}", "w").close()
    _wait_for(f"{out}.go2")
    end = time.monotonic() + 10  # a call let go is on its way out: its thread ends once it let go
    while any(t.name.startswith("asyncckpt-node") for t in threading.enumerate()) and time.monotonic() < end:
        time.sleep(0.02)
    dist.barrier()
    with Checkpointer(root, node_local=True, timeout=60) as ck:
        result["loaded"] = float(ck.load()["w"][0])


def main() -> None:
    scenario, rank, world, port, root, out = (
        sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6],
    )  # fmt: skip
    import faulthandler

    faulthandler.dump_traceback_later(100)
    os.environ["ASYNCCKPT_NODE"] = "one"
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    result: dict[str, Any] = {"rank": rank}
    try:
        globals()[f"scenario_{scenario}"](rank, root, result)
    except BaseException as e:  # noqa: BLE001 - the test reads what happened from the file
        result["crash"] = "".join(traceback.format_exception(e))
    with open(f"{out}.{rank}.json.tmp", "w") as f:
        json.dump(result, f)
    os.rename(f"{out}.{rank}.json.tmp", f"{out}.{rank}.json")
    if rank == 0:  # rank 0 hosts the store: stay until every rank wrote its result
        end = time.monotonic() + 30
        while time.monotonic() < end and not all(os.path.exists(f"{out}.{r}.json") for r in range(world)):
            time.sleep(0.05)
    os._exit(0)


if __name__ == "__main__":
    main()
