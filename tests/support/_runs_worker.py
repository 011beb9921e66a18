"""A rank of the run-identity test: two gloo ranks whose views of one root path differ.

Run as ``python _runs_worker.py RANK WORLD PORT ROOT_A ROOT_B LINK OUT`` (as root: each rank
runs in a private mount namespace of its own). Both ranks first save step 5 together under
ROOT_A and, with other values, under ROOT_B (two commits of step 5, two attempts). Then both
build their Checkpointer on LINK (-> ROOT_A): one shared view, so construction's shared-root
check passes. Only then does rank 1 bind-mount ROOT_B over ROOT_A in its own namespace: the
same root path, two views, as when a node's local disk changed under a running job. Each
rank then tries ``load()`` and ``load(step=5)`` and reports what it got (JSON in OUT).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncckpt import Checkpointer

CLONE_NEWNS = 0x00020000
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18


def private_namespace() -> Any:
    """A mount namespace of this process's own (while it has one thread: unshare refuses
    CLONE_NEWNS to a multithreaded process), private so no mount propagates to the host."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    return libc


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
    libc = private_namespace()
    r, w = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=w,
                            timeout=timedelta(seconds=60))
    result: dict[str, Any] = {"rank": r}
    try:
        for root, which in ((root_a, "a"), (root_b, "b")):
            with Checkpointer(root, timeout=30) as ck:
                ck.save(5, state_for(r, which))
                result[f"run_{which}"] = getattr(ck, "run_id", None)  # (absent before runs)
        ck = Checkpointer(link, timeout=30)  # LINK -> ROOT_A, pinned now, on both ranks
        if r == 1 and libc.mount(root_b.encode(), root_a.encode(), None, MS_BIND, None) != 0:
            raise OSError(ctypes.get_errno(), f"mount --bind {root_b} {root_a}")
        dist.barrier()
        try:
            result["root"] = ck.root
            with open(os.path.join(ck.root, "step_00000005", "manifest.json")) as f:
                result["view"] = json.load(f)["attempt"]  # the commit of step 5 this rank sees
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
