"""One rank of a node-local tier test (``test_node_tier.py``): argv scenario rank world port root out.

``NODE_DIRS``: per rank, the directory bind-mounted at ``root`` in this rank's own mount
namespace (``_rank_worker.enter_node``); ``NODE_NAMES``: per rank, its ``ASYNCCKPT_NODE``;
``MEMORY`` (the memory tier's one path) and ``MEMORY_DIRS`` (per rank, its node's directory on
/dev/shm, bind-mounted there in the same namespace); ``REPLICATE``: its peer replica.
``DISK_EVERY`` (``DISK_EVERY_S``: by time, seconds): the disk tier's frequency; ``SAVE_GAPS``:
each rank's sleeps before its saves; ``GO_ON``: a failed save is recorded (``save_errors``)
and the next step saved; ``SIGTERM_AT_END``: after the saves each rank signals itself SIGTERM
(``install_sigterm_handler``: no flush, no close of its own; a preempted job), ``FINAL_STEP``: the
handler's final save; ``SIGTERM_RANKS``: only these ranks are preempted (the others flush and close,
after saving ``OTHERS_FINAL`` when set: a training loop's next save).
Writes what happened to ``out.<rank>.json``.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

from _rank_worker import describe, enter_node
from _rank_worker import state_for as small_state


def state_for(rank: int, step: int) -> dict[str, Any]:
    """``_rank_worker.state_for``, plus ``STATE_MB`` MiB of float32 when set (measurements), plus
    a tensor equal on every rank when ``SHARED`` is set, a DTensor when ``DTENSOR`` is."""
    import torch

    state = small_state(rank, step)
    if os.environ.get("SHARED"):  # a tensor every rank holds the same (DDP's model): dedupe spreads its writers
        state["model"]["shared"] = torch.arange(1 << 16, dtype=torch.float32) + step
    if os.environ.get("DTENSOR"):  # FSDP's sharded parameters: a DTensor over every rank
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        state["model"]["sharded"] = distribute_tensor(torch.arange(64, dtype=torch.float32) + step, mesh, [Shard(0)])
    if os.environ.get("STATE_MB"):
        g = torch.Generator().manual_seed(7919 * step + rank)
        state["model"]["big"] = torch.rand(int(os.environ["STATE_MB"]) << 18, generator=g)
    return state


def _refuse_disk_reads(root: str) -> list[str]:
    """Refuse (``PermissionError``, through an audit hook) every open for reading of a rank's
    file under ``root`` from now on; return the list the refused paths are appended to."""
    refused: list[str] = []
    prefix = root.rstrip("/") + "/"

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event != "open" or not args or not isinstance(args[0], (str, bytes)):
            return
        path, mode = os.fsdecode(args[0]), args[1]
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        reading = ("r" in mode and "+" not in mode) if isinstance(mode, str) else flags & os.O_ACCMODE == os.O_RDONLY
        if reading and path.startswith(prefix) and os.path.basename(path).startswith("rank"):
            refused.append(path)
            raise PermissionError(errno.EACCES, "a rank file on the disk read back (refused by the test)", path)

    sys.addaudithook(hook)
    return refused


def scenario_run(rank: int, world: int, root: str, out: str, result: dict[str, Any]) -> None:
    """Resume (``load()``: the step and whether it is bit-exact, or the error), then save the
    steps in ``STEPS`` (comma-separated); ``DIE_BEFORE``: this node's ranks ``_exit`` before
    saving that step (a node lost mid-run); the others record the save's error, and go on for
    ``LINGER_S`` before they stop (a job that lives on after a failed save)."""
    import torch

    from asyncckpt import Checkpointer

    timeout = float(os.environ.get("CK_TIMEOUT", "60"))  # ample on a busy machine; failure tests set less
    keep_last = int(os.environ["KEEP_LAST"]) if os.environ.get("KEEP_LAST") else None
    dying = os.environ.get("DIE_RANKS", "")
    ops: Any = None
    slow_retire = os.environ.get("SLOW_RETIRE_RANK") == str(rank)
    if os.environ.get("FAIL_RENAME_RANK") == str(rank) or slow_retire:  # the OS call fails, not our code
        from asyncckpt.testing import OsOps

        target = f"step_{int(os.environ.get('FAIL_RENAME_STEP', '-1')):08d}"
        retired = f"step_{int(os.environ.get('SLOW_RETIRE_STEP', '-1')):08d}"

        class FailCommit(OsOps):
            def rename(self, src: str, dst: str) -> None:
                if slow_retire and os.path.basename(src) == retired and ".deleting-" in dst:
                    time.sleep(float(os.environ["SLOW_RETIRE_S"]))  # a slow disk under retention
                elif os.path.basename(dst) == target:
                    if os.environ.get("SLOW_RENAME_S"):  # a slow disk that does commit, in time
                        time.sleep(float(os.environ["SLOW_RENAME_S"]))
                        return super().rename(src, dst)
                    if os.environ.get("FAIL_RENAME_HANG_S"):  # a disk that stops answering, then fails
                        time.sleep(float(os.environ["FAIL_RENAME_HANG_S"]))
                    raise OSError(errno.EIO, os.strerror(errno.EIO), dst)
                super().rename(src, dst)

        ops = FailCommit()
    extra: dict[str, Any] = {"os_ops": ops} if ops is not None else {}
    if os.environ.get("DIRECT_IO"):
        extra["direct_io"] = os.environ["DIRECT_IO"]
    if os.environ.get("MEMORY"):  # the memory tier
        extra["memory"] = os.environ["MEMORY"]
        for opt in ("MEMORY_KEEP_LAST", "MEMORY_BUDGET", "MEMORY_EVERY", "DISK_EVERY"):
            if os.environ.get(opt):
                extra[opt.lower()] = int(os.environ[opt])
        for opt in ("MEMORY_EVERY", "DISK_EVERY"):  # a frequency by time: seconds
            if os.environ.get(f"{opt}_S"):
                extra[opt.lower()] = timedelta(seconds=float(os.environ[f"{opt}_S"]))
        if os.environ.get("REPLICATE"):  # the peer replica
            extra["replicate"] = True
    if os.environ.get("MIRROR"):  # the persistent tier
        extra.update(mirror=os.environ["MIRROR"], storage_options=json.loads(os.environ["S3OPTS"]))
        if os.environ.get("MIRROR_EVERY"):
            extra["mirror_every"] = int(os.environ["MIRROR_EVERY"])
        if os.environ.get("MIRROR_EVERY_S"):
            extra["mirror_every"] = timedelta(seconds=float(os.environ["MIRROR_EVERY_S"]))
        if os.environ.get("KEEP_LAST_REMOTE"):
            extra["keep_last_remote"] = int(os.environ["KEEP_LAST_REMOTE"])
    # SIGTERM_RANKS: the ranks preempted (default: every rank); the others save OTHERS_FINAL (a step) too,
    # as a plain save of the training loop, then flush and close
    preempted_here = str(rank) in os.environ.get("SIGTERM_RANKS", ",".join(map(str, range(world)))).split(",")
    if os.environ.get("SIGTERM_AT_END") and preempted_here:  # preempted after the saves: asyncckpt's, then this

        def preempted(signum: int, frame: Any) -> None:
            result["sigterm_flushed"] = True  # asyncckpt's handler flushed (or it had exited 1)
            _leave(rank, world, out, result)

        signal.signal(signal.SIGTERM, preempted)
    try:
        ck = Checkpointer(root, node_local=True, timeout=timeout, keep_last=keep_last, **extra)
    except Exception as e:  # noqa: BLE001 - what the test looks at
        result["init_error"] = describe(e)
        return
    if os.environ.get("SIGTERM_AT_END") and preempted_here:
        final = int(os.environ.get("FINAL_STEP", "0"))  # the handler's final save of this step
        ck.install_sigterm_handler(grace_s=timeout * 3,
                                   final_save=(lambda c: c.save(final, state_for(rank, final))) if final else None)
    result["run_id"] = ck.run_id
    try:
        t_load = time.monotonic()
        loaded = ck.load()
        result["load_s"] = time.monotonic() - t_load
    except Exception as e:  # noqa: BLE001 - what the test looks at
        result["load_error"] = describe(e)
    else:
        step = int(loaded["extra"]["step"])
        want = state_for(rank, step)
        result["loaded"] = step
        result["equal"] = all(torch.equal(loaded["model"][k], want["model"][k]) for k in want["model"]) and loaded[
            "extra"
        ] == want["extra"] and set(loaded["model"]) == set(want["model"])
    result["saved"] = []
    if os.environ.get("NO_DISK_READS"):  # from here on, a read of a rank file on this node's disk is refused
        result["disk_reads"] = _refuse_disk_reads(root)
    # SAVE_GAPS: per rank (';'-separated), the seconds it sleeps before each save (','-separated):
    # ranks whose clocks disagree on the time between two saves
    gaps = os.environ["SAVE_GAPS"].split(";")[rank].split(",") if os.environ.get("SAVE_GAPS") else []
    steps = [int(x) for x in os.environ.get("STEPS", "").split(",") if x]
    if os.environ.get("OTHERS_FINAL") and not preempted_here:
        steps.append(int(os.environ["OTHERS_FINAL"]))
    for i, s in enumerate(steps):
        if str(rank) in dying.split(",") and s == int(os.environ["DIE_BEFORE"]):
            json.dump(result, open(f"{out}.{rank}.json", "w"))
            _done(out, rank)
            os._exit(9)  # this node is lost: no close, no goodbye
        try:
            state = state_for(rank, s)
            time.sleep(float(gaps[i] if gaps else os.environ.get("SAVE_GAP_S", "0")))  # training between saves
            t_call = time.monotonic()
            result.setdefault("calls", []).append(t_call)  # this rank's clock at each save() call
            handle = ck.save(s, state)
            result.setdefault("block_s", []).append(time.monotonic() - t_call)  # save()'s blocking
            info = handle.result(timeout + 30)
            result.setdefault("commit_s", []).append(time.monotonic() - t_call)  # save() to its commit
            result["saved"].append(s)
            result.setdefault("tiers", []).append([info.tier, str(info.path)])  # where each save is durable
        except Exception as e:  # noqa: BLE001
            if os.environ.get("GO_ON"):  # the job goes on after a failed save: the next save must work
                result.setdefault("save_errors", []).append({"step": s, "s": time.monotonic() - t_call,
                                                             **describe(e)})  # fmt: skip
                continue
            result["save_error"] = describe(e)
            result["failed_step"] = s
            time.sleep(float(os.environ.get("LINGER_S", "0")))  # the job goes on after a failed save
            break
    if "save_error" in result:
        return
    if os.environ.get("SIGTERM_AT_END") and preempted_here:  # no flush, no close: the handler does what is left
        with open(f"{out}.{rank}.json", "w") as f:  # (what is known if the handler exits 1 without a word)
            json.dump(result, f)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(timeout * 4)  # (the handlers run at the next bytecode; they never return)
        result["sigterm_not_handled"] = True
        return
    try:
        ck.flush(timeout=timeout * 6)  # with the persistent tier: the uploads too
    except Exception as e:  # noqa: BLE001
        result["flush_error"] = describe(e)
    if os.environ.get("KILL_AFTER_FLUSH"):  # every process of every node killed: no close, no goodbye
        _leave(rank, world, out, result, 9)
    ck.close()


def scenario_two(rank: int, world: int, root: str, out: str, result: dict[str, Any]) -> None:
    """Two Checkpointers of one job on one memory tier (``MEMORY``): the first on ``root``, the
    second on ``root/second`` (``second_error``: its construction's error); then the first
    saves step 1 and closes (``saved``, ``first_error``)."""
    from asyncckpt import Checkpointer

    timeout = float(os.environ.get("CK_TIMEOUT", "30"))
    ck = Checkpointer(root, node_local=True, timeout=timeout, memory=os.environ["MEMORY"])
    try:
        Checkpointer(os.path.join(root, "second"), node_local=True, timeout=timeout, memory=os.environ["MEMORY"])
    except Exception as e:  # noqa: BLE001 - what the test looks at
        result["second_error"] = describe(e)
    try:
        ck.save(1, state_for(rank, 1)).result(timeout + 30)
        ck.flush(timeout=timeout * 3)
        result["saved"] = [1]
        ck.close()
    except Exception as e:  # noqa: BLE001 - what the test looks at
        result["first_error"] = describe(e)


def _leave(rank: int, world: int, out: str, result: dict[str, Any], status: int = 9) -> None:
    """Write ``result`` and exit with ``status`` at once: no close, no goodbye (rank 0, which
    hosts the c10d store, waits up to 30 s for every rank's result first: the last to go)."""
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    _done(out, rank)
    end = time.monotonic() + 30
    while rank == 0 and time.monotonic() < end and not all(os.path.exists(f"{out}.{r}.done") for r in range(world)):
        time.sleep(0.05)
    os._exit(status)


def _done(out: str, rank: int) -> None:
    """This rank's result is final (rank 0 waits for these, not for the result files: a rank
    about to signal itself writes one early, and rank 0 must not take the store away before
    that rank's handler is done)."""
    open(f"{out}.{rank}.done", "w").close()


def main() -> None:
    scenario, rank, world, port, root, out = (
        sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6],
    )  # fmt: skip
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("DUMP_AFTER_S", "100")))
    enter_node(os.environ["NODE_DIRS"].split(":")[rank], root)
    if os.environ.get("MEMORY_DIRS") and os.environ.get("MEMORY"):  # this node's tmpfs dir, in its namespace
        import ctypes

        src, dst = os.environ["MEMORY_DIRS"].split(":")[rank], os.environ["MEMORY"]
        if ctypes.CDLL(None, use_errno=True).mount(src.encode(), dst.encode(), None, 4096, None) != 0:  # MS_BIND
            raise OSError(ctypes.get_errno(), f"mount --bind {src} {dst}")
    import logging

    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(threadName)s %(levelname)s %(message)s")
    os.environ["ASYNCCKPT_NODE"] = os.environ["NODE_NAMES"].split(":")[rank]
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
    _done(out, rank)
    if rank == 0:
        end = time.monotonic() + float(os.environ.get("HOST_STORE_S", "0"))
        while time.monotonic() < end and not all(os.path.exists(f"{out}.{r}.done") for r in range(world)):
            time.sleep(0.05)
    os._exit(0)


if __name__ == "__main__":
    main()
