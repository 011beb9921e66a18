"""A rank of the node-local-root and stuck-rank tests: gloo on localhost, one scenario, a JSON result.

Run as ``python _rank_worker.py SCENARIO RANK WORLD PORT ROOT OUT``. With ``NODE_DIRS`` set
(``dirA:dirA:dirB:dirB``, one per rank), the process first enters a private mount namespace
and bind-mounts its rank's directory at ROOT: ranks with different directories are two
"nodes" that see the same path on different disks. That happens before anything else (no
thread exists yet: a mount namespace is per thread, and later threads inherit it).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import time
import traceback
from typing import Any

CLONE_NEWNS = 0x00020000
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18


def enter_node(src: str, dst: str) -> None:
    """This process gets a mount namespace of its own in which ``src`` is mounted at ``dst``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    # private: the bind mount below must not propagate back to the host's namespace
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    if libc.mount(src.encode(), dst.encode(), None, MS_BIND, None) != 0:
        raise OSError(ctypes.get_errno(), f"mount --bind {src} {dst}")


def listing(root: str) -> dict[str, str]:
    """Every file under ``root`` (this rank's view) with a hash of its bytes."""
    out: dict[str, str] = {}
    for d, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(d, name), root) + "/"] = ""
        for name in files:
            p = os.path.join(d, name)
            try:
                with open(p, "rb") as f:
                    out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()[:16]
            except FileNotFoundError:  # on a shared root another rank's close removes its owner record
                continue
    return out


def main() -> None:
    scenario, rank, world, port, root, out = (
        sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6],
    )  # fmt: skip
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("DUMP_AFTER_S", "100")))  # a hang shows its stacks
    nodes = os.environ.get("NODE_DIRS")
    if nodes:
        enter_node(nodes.split(":")[rank], root)
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    result: dict[str, Any] = {"rank": rank}
    try:
        globals()[f"scenario_{scenario}"](rank, world, root, out, result)
    except BaseException as e:  # noqa: BLE001 - the test reads what happened from the file
        result["crash"] = "".join(traceback.format_exception(e))
    with open(f"{out}.{rank}.json.tmp", "w") as f:
        json.dump(result, f)
    os.rename(f"{out}.{rank}.json.tmp", f"{out}.{rank}.json")
    if rank == 0:
        # the store lives in this process: keep it up until every other rank is done with it
        end = time.monotonic() + float(os.environ.get("HOST_STORE_S", "0"))
        while time.monotonic() < end and not all(os.path.exists(f"{out}.{r}.json") for r in range(world)):
            time.sleep(0.05)
    os._exit(0)  # skip process-group teardown: a peer may be gone by design


def state_for(rank: int, step: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"model": {"w": torch.randn(4096, generator=g)}, "extra": {"rank": rank, "step": step}}


def describe(exc: BaseException | None) -> Any:
    from asyncckpt import SaveError, SaveTimeoutError

    if exc is None:
        return None
    d: dict[str, Any] = {"type": type(exc).__name__, "msg": str(exc)}
    if isinstance(exc, SaveError):
        d["failures"] = {str(r): {"exc_type": f.exc_type, "message": f.message} for r, f in exc.failures.items()}
    if isinstance(exc, SaveTimeoutError):
        d["missing"] = list(exc.missing)
    return d


def scenario_nodes(rank: int, world: int, root: str, out: str, result: dict[str, Any]) -> None:
    """Build a Checkpointer on ROOT; if that works, save step 2 and load it back."""
    import torch
    import torch.distributed as dist

    from asyncckpt import Checkpointer

    timeout = float(os.environ.get("CK_TIMEOUT", "5"))
    result["before"] = listing(root)
    dist.barrier()  # every rank looked before any constructs
    t0 = time.monotonic()
    try:
        ck = Checkpointer(root, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - what the test looks at
        result["ctor_s"] = time.monotonic() - t0
        result["ctor_error"] = describe(e)
        result["after"] = listing(root)
        return
    result["ctor_s"] = time.monotonic() - t0
    with ck:
        ck.save(2, state_for(rank, 2)).result(60)
        loaded = ck.load()
        want = state_for(rank, 2)
        same = bool(torch.equal(loaded["model"]["w"], want["model"]["w"]))
        result["equal"] = same and loaded["extra"] == want["extra"]
        result["steps"] = ck.steps()
    result["after"] = listing(root)


def scenario_stuck(rank: int, world: int, root: str, out: str, result: dict[str, Any]) -> None:
    """Save step 1; once the test says go (after it made one rank's next write hang in the
    kernel), save step 2 and time its failure and the close() after it."""
    from asyncckpt import Checkpointer

    timeout = float(os.environ.get("CK_TIMEOUT", "5"))
    ck = Checkpointer(root, timeout=timeout)
    ck.save(1, state_for(rank, 1)).result(60)
    open(f"{out}.ready.{rank}", "w").close()
    end = time.monotonic() + 60
    while not os.path.exists(f"{out}.go") and time.monotonic() < end:
        time.sleep(0.02)
    t0 = time.monotonic()
    h = ck.save(2, state_for(rank, 2))
    result["error"] = describe(h.exception(timeout=300))
    result["error_s"] = time.monotonic() - t0
    t1 = time.monotonic()
    try:
        ck.close()
    except Exception as e:  # noqa: BLE001 - the failure of step 2 again
        result["close_error"] = type(e).__name__
    result["close_s"] = time.monotonic() - t1


if __name__ == "__main__":
    main()
