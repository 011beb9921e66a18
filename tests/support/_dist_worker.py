"""A rank of a multi-process test: init gloo on localhost, run one scenario, write a JSON result.

Run as ``python _dist_worker.py SCENARIO RANK WORLD PORT ROOT OUT``. Faults are real: the
scenarios use RLIMIT_FSIZE (EFBIG), os._exit and SIGSTOP on this process.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncckpt import Checkpointer, SaveError, SaveTimeoutError
from asyncckpt.roots.posix._osops import OsOps


def state_for(rank: int, step: int, numel: int = 4096) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"model": {"w": torch.randn(numel, generator=g)}, "extra": {"rank": rank, "step": step}}


def describe(exc: BaseException | None) -> Any:
    if exc is None:
        return None
    d: dict[str, Any] = {"type": type(exc).__name__, "msg": str(exc)}
    if isinstance(exc, SaveError):
        d["step"] = exc.step
        d["failures"] = {
            str(r): {"exc_type": f.exc_type, "errno": f.errno, "path": f.path, "message": f.message}
            for r, f in exc.failures.items()
        }
    if isinstance(exc, SaveTimeoutError):
        d["missing"] = list(exc.missing)
    return d


def main() -> None:
    scenario, rank, world, port, root, out = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
        sys.argv[6],
    )
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
    os._exit(0)  # skip process-group teardown: a peer may be gone by design


def scenario_roundtrip(rank: int, world: int, root: str, result: dict[str, Any]) -> None:
    with Checkpointer(root, keep_last=2, timeout=30) as ck:
        infos = [ck.save(s, state_for(rank, s)).result(timeout=60) for s in (1, 2, 3)]
        result["infos"] = [(i.step, i.world_size, i.nbytes) for i in infos]
        result["steps"] = ck.steps()
        latest = ck.latest()
        result["latest"] = latest.step if latest else None
        loaded = ck.load()
        expected = state_for(rank, 3)
        result["equal"] = (
            bool(torch.equal(loaded["model"]["w"], expected["model"]["w"])) and loaded["extra"] == expected["extra"]
        )
        result["files"] = sorted(os.listdir(os.path.join(root, "step_00000003")))


def scenario_efbig(rank: int, world: int, root: str, result: dict[str, Any]) -> None:
    with Checkpointer(root, timeout=20) as ck:
        ck.save(1, state_for(rank, 1)).result(timeout=60)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        t0 = time.monotonic()
        h = ck.save(2, state_for(rank, 2))
        result["error"] = describe(h.exception(timeout=60))
        result["elapsed"] = time.monotonic() - t0
        try:
            ck.flush()
        except SaveError as e:
            result["flush_error"] = describe(e)
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        latest = ck.latest()
        result["latest_after_failure"] = latest.step if latest else None
        result["retry"] = ck.save(2, state_for(rank, 2)).result(timeout=60).step
        result["steps"] = ck.steps()


def sharded_state_for(rank: int, world: int, step: int) -> dict[str, Any]:
    """A DTensor sharded over every rank next to a tiny plain tensor identical on every rank
    (FSDP2's shape: the dedupe round cannot pay for an image, so the shard is written while
    the round runs)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.Generator().manual_seed(step)
    w = torch.randn(64 * world, 256, generator=full)
    return {"model": {"w": distribute_tensor(w, mesh, [Shard(0)])}, "step": torch.tensor(float(step))}


def scenario_efbig_sharded(rank: int, world: int, root: str, result: dict[str, Any]) -> None:
    with Checkpointer(root, timeout=20) as ck:
        ck.save(1, sharded_state_for(rank, world, 1)).result(timeout=60)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        t0 = time.monotonic()
        h = ck.save(2, sharded_state_for(rank, world, 2))
        result["error"] = describe(h.exception(timeout=60))
        result["elapsed"] = time.monotonic() - t0
        try:
            ck.flush()
        except SaveError as e:
            result["flush_error"] = describe(e)
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        latest = ck.latest()
        result["latest_after_failure"] = latest.step if latest else None
        result["retry"] = ck.save(2, sharded_state_for(rank, world, 2)).result(timeout=60).step
        target = sharded_state_for(rank, world, 0)
        ck.load(into=target)
        want = sharded_state_for(rank, world, 2)
        result["equal"] = bool(
            torch.equal(target["model"]["w"].to_local(), want["model"]["w"].to_local())
            and torch.equal(target["step"], want["step"])
        )


def scenario_bad_state(rank: int, world: int, root: str, result: dict[str, Any]) -> None:
    with Checkpointer(root, timeout=20) as ck:
        state: Any = state_for(rank, 1)
        if rank == 2:
            state["extra"]["bad"] = object()
        try:
            h = ck.save(1, state)
            result["error"] = describe(h.exception(timeout=60))
        except TypeError as e:
            result["call_error"] = describe(e)
        # every caller saw step 1's error (at the call, or on its handle): the next save goes on,
        # on every rank alike, once that failure settled (it did not on rank 2: save() raised it
        # again there, and the others waited the timeout for rank 2)
        time.sleep(1.0)
        result["next"] = ck.save(2, state_for(rank, 2)).result(timeout=60).step
        try:
            ck.flush()  # still reports it
        except SaveError as e:
            result["flush_error"] = describe(e)


def scenario_leader_fails_deduped(rank: int, world: int, root: str, result: dict[str, Any]) -> None:
    """A state identical on every rank (deduplicated), whose save fails on the leader: first in
    preparing the attempt (a foreign step directory is in the way), then at the call (a state
    refused on rank 0). The followers' dedupe rounds, started before the attempt, are dropped
    at once: every rank hears the leader's failure well inside the timeout."""
    same = state_for(0, 1)  # equal on every rank
    with Checkpointer(root, timeout=30) as ck:
        if rank == 0:
            os.makedirs(os.path.join(root, "step_00000001"))  # not a checkpoint: the leader refuses it
        t0 = time.monotonic()
        result["prepare"] = describe(ck.save(1, same).exception(timeout=60))
        result["prepare_s"] = time.monotonic() - t0
        try:
            ck.flush()
        except SaveError:
            pass
        if rank == 0:
            os.rmdir(os.path.join(root, "step_00000001"))
        state: Any = state_for(0, 2)
        if rank == 0:
            state["extra"]["bad"] = object()
        t0 = time.monotonic()
        try:
            result["refused"] = describe(ck.save(2, state).exception(timeout=60))
        except TypeError as e:
            result["refused"] = describe(e)
        result["refused_s"] = time.monotonic() - t0
        try:
            ck.flush()
        except SaveError:
            pass
        info = ck.save(3, state_for(0, 3)).result(timeout=60)
        result["after"] = ck.steps()
        result["nbytes"] = info.nbytes
        loaded = ck.load()
        result["equal"] = bool(torch.equal(loaded["model"]["w"], state_for(0, 3)["model"]["w"]))


def scenario_exit(rank: int, world: int, root: str, result: dict[str, Any]) -> None:
    ck = Checkpointer(root, timeout=4)
    ck.save(1, state_for(rank, 1)).result(timeout=60)
    if rank == 2:
        os._exit(3)  # dies during the next save
    t0 = time.monotonic()
    h = ck.save(2, state_for(rank, 2))
    result["error"] = describe(h.exception(timeout=60))
    result["elapsed"] = time.monotonic() - t0
    latest = ck.latest()
    result["latest"] = latest.step if latest else None
    try:
        ck.close()  # collective: rank 0 (the store's host) stays until the survivors have read
    except SaveError:
        pass


def scenario_sigstop(rank: int, world: int, root: str, result: dict[str, Any]) -> None:
    ck = Checkpointer(root, timeout=6)
    ck.save(1, state_for(rank, 1)).result(timeout=60)
    # step 2's saves start together: a rank that lagged behind (a busy machine) must not be
    # taken for a missing one when the test asserts that only the stopped rank is named
    dist.barrier()
    if rank == 1:
        # stopped in the middle of the save; the test sends SIGCONT much later
        h = ck.save(2, state_for(rank, 2))
        os.kill(os.getpid(), signal.SIGSTOP)
        result["error"] = describe(h.exception(timeout=60))
        return
    t0 = time.monotonic()
    h = ck.save(2, state_for(rank, 2))
    result["error"] = describe(h.exception(timeout=60))
    result["elapsed"] = time.monotonic() - t0
    try:
        ck.close()  # collective; the stopped rank never acknowledges, so rank 0 waits out the deadline
    except SaveError:
        pass


def scenario_collectives(rank: int, world: int, root: str, result: dict[str, Any]) -> None:
    wrong = 0
    with Checkpointer(root, keep_last=2, timeout=30, max_pending=1) as ck:
        handles = []
        for i in range(20):
            handles.append(ck.save(i, state_for(rank, i, numel=16384)))
            for j in range(5):  # training collectives on the default group while the save runs
                t = torch.full((1000,), float(rank + i + j))
                dist.all_reduce(t)
                expect = sum(r + i + j for r in range(world))
                wrong += int(not torch.all(t == expect))
        result["steps"] = [h.result(timeout=60).step for h in handles]
    result["wrong"] = wrong
    result["latest_steps"] = sorted(n for n in os.listdir(root) if n != ".asyncckpt")  # not the metadata dir


def scenario_two_checkpointers(rank: int, world: int, root: str, result: dict[str, Any]) -> None:
    # model state and data-loader state under different roots, saved interleaved
    with (
        Checkpointer(os.path.join(root, "model"), timeout=20) as a,
        Checkpointer(os.path.join(root, "data"), timeout=20) as b,
    ):
        for step in (1, 2, 3):
            ha = a.save(step, state_for(rank, step))
            hb = b.save(step * 10, {"pos": step * 100 + rank})
            result.setdefault("a", []).append(ha.result(timeout=60).step)
            result.setdefault("b", []).append(hb.result(timeout=60).step)
        result["a_steps"], result["b_steps"] = a.steps(), b.steps()
        result["b_loaded"] = b.load()["pos"]


class PhaseOps(OsOps):
    """Stands in for one OS call: when this rank reaches ``op`` on a path ending in ``where``
    during step 2, the process kills or stops itself - a real death/stop in that phase:
    ``kill``/``stop`` before the call, ``stopafter`` once it returned."""

    def __init__(self, op: str, where: str, action: str) -> None:
        self.op, self.where, self.action = op, where, action
        self._paths: dict[int, str] = {}

    def _matches(self, op: str, path: str) -> bool:
        return op == self.op and path.endswith(self.where) and "step_00000002" in path

    def _hit(self, op: str, path: str) -> None:
        if self._matches(op, path) and self.action != "stopafter":
            if self.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            _stop_here()

    def _after(self, op: str, path: str) -> None:
        if self._matches(op, path) and self.action == "stopafter":
            _stop_here()

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        self._hit("open", path)
        fd = super().open(path, flags, mode)
        self._paths[fd] = path
        return fd

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        self._hit("write", self._paths.get(fd, ""))
        return super().pwrite(fd, data, offset)

    def rename(self, src: str, dst: str) -> None:
        self._hit("rename", dst)
        super().rename(src, dst)
        self._after("rename", dst)


def _stop_here() -> None:
    """Stop the whole process before this thread runs one more instruction. A SIGSTOP sent to
    the process (``os.kill(os.getpid(), ...)``) from a thread other than the main one is
    taken by another thread, and the caller runs on until that thread starts the group stop:
    under load, long enough to commit a step "after" the stop. Sent to the calling thread
    itself, the stop begins before the call returns."""
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def scenario_phase(rank: int, world: int, root: str, result: dict[str, Any]) -> None:
    victim, op, where, action = os.environ["PHASE"].split(":")
    ops = PhaseOps(op, where, action) if rank == int(victim) else OsOps()
    # 6 s: the first save of 3 ranks must commit within it on a loaded CI machine (4 s did not, once)
    ck = Checkpointer(root, timeout=6, os_ops=ops)
    ck.save(1, state_for(rank, 1)).result(timeout=60)
    t0 = time.monotonic()
    h = ck.save(2, state_for(rank, 2))
    result["error"] = describe(h.exception(timeout=60))
    result["elapsed"] = time.monotonic() - t0
    try:
        ck.close()
    except SaveError:
        pass


def early_state(rank: int, step: int) -> dict[str, Any]:
    """Three tensors identical on every rank and a per-rank RNG state. In step 3 ``a`` differs
    on rank 1 (so it is per-rank there: every rank writes its own), in the other steps it is
    identical again."""
    g = torch.Generator().manual_seed(step)
    model = {name: torch.randn(65536, generator=g) for name in ("a", "b", "c")}
    if step == 3 and rank == 1:
        model["a"] = model["a"] + 1.0
    return {"model": model, "rng": torch.full((1000,), rank * 10 + step, dtype=torch.uint8)}


class ShardFaultOps(OsOps):
    """Fails one OS call on this rank's shard in one step with ``err``: ``unlink`` (the early
    file removed to write it again), ``open2`` (the second open of the shard: the rewrite) or
    ``pwrite`` (a write of the shard: the early file, while the dedupe round runs). Once: the
    retry of the step succeeds."""

    def __init__(self, op: str, step: int, err: int, rank: int) -> None:
        self.op, self.err = op, err
        self.fired = False
        self.where = f"step_{step:08d}.tmp-"
        self.shard = f"rank{rank:05d}.safetensors"
        self.opens = 0
        self._paths: dict[int, str] = {}

    def _mine(self, path: str) -> bool:
        return self.where in path and path.endswith(self.shard)

    def _fire(self, op: str, path: str) -> None:
        if op == self.op and not self.fired:
            self.fired = True
            raise OSError(self.err, os.strerror(self.err), *([path] if op == "unlink" else []))

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if self._mine(path):
            self.opens += 1
            if self.opens == 2:
                self._fire("open2", path)
        fd = super().open(path, flags, mode)
        self._paths[fd] = path
        return fd

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        if self._mine(self._paths.get(fd, "")):
            self._fire("pwrite", "")
        return super().pwrite(fd, data, offset)

    def unlink(self, path: str) -> None:
        if self._mine(path):
            self._fire("unlink", path)
        super().unlink(path)


def scenario_dedupe_early(rank: int, world: int, root: str, result: dict[str, Any]) -> None:
    """Saves of one structure whose plan changes: step 1 plans (the round first), step 2 writes
    the slots that plan gave each rank while the round runs, step 3 (``a`` differs on rank 1)
    makes ranks whose early file lacks a tensor the round gives them write it again, step 4
    (``a`` identical again) leaves the ranks that wrote ``a`` in step 3 their own copies. With
    ``FAULT=op:step:victim``, that rank's ``ShardFaultOps`` fails the call (EIO)."""
    import errno
    import logging

    fault = os.environ.get("FAULT")
    ops: OsOps = OsOps()
    if fault:
        op, fstep, victim = fault.split(":")
        if rank == int(victim):
            ops = ShardFaultOps(op, int(fstep), errno.EIO, rank)
    rewrites: list[str] = []

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "writing it again" in record.getMessage():
                rewrites.append(record.getMessage())

    logger = logging.getLogger("asyncckpt")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Seen())
    result["steps"] = {}
    with Checkpointer(root, timeout=20, os_ops=ops) as ck:
        for step in (1, 2, 3, 4, 5):
            before = len(rewrites)
            t0 = time.monotonic()
            h = ck.save(step, early_state(rank, step))
            err = h.exception(timeout=60)
            got: dict[str, Any] = {"error": describe(err), "elapsed": time.monotonic() - t0}
            if err is not None:
                try:
                    ck.flush()
                except SaveError as e:
                    got["flush_error"] = describe(e)
                latest = ck.latest()
                got["latest_after_failure"] = latest.step if latest else None
                got["retry"] = ck.save(step, early_state(rank, step)).result(timeout=60).step
            got["rewrote"] = len(rewrites) > before
            got["nbytes"] = ck.latest().nbytes  # type: ignore[union-attr]
            loaded = ck.load(step)
            want = early_state(rank, step)
            got["equal"] = all(torch.equal(loaded["model"][k], want["model"][k]) for k in want["model"]) and bool(
                torch.equal(loaded["rng"], want["rng"])
            )
            result["steps"][str(step)] = got
        result["all_steps"] = ck.steps()


if __name__ == "__main__":
    main()
