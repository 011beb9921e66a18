"""One rank of the I/O error sweep: inject a persistent error at the i-th file operation of a
save, on one rank, for every i; record how every rank saw it. Run by test_fault_sweep.py as
``python _sweep_worker.py RANK WORLD PORT ROOT OUT``."""

from __future__ import annotations

import errno
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncckpt import Checkpointer, SaveError
from asyncckpt.roots.posix._osops import OsOps

COUNTED = ("open", "write", "fsync", "close", "rename", "mkdir", "fsync_dir")
TIMEOUT = 10.0  # generous: a loaded 2-core box must not turn an I/O error into a timeout


class SweepOps(OsOps):
    """Stands in for the OS calls: counts them and, once armed, fails the i-th and every later one."""

    def __init__(self) -> None:
        self.count = 0
        self.fail_at: int | None = None
        self.err = errno.EIO
        self.once = False
        self.log: list[tuple[str, str, bool]] = []  # (op, path, failed)
        self._paths: dict[int, str] = {}

    def arm(self, i: int | None, err: int = errno.EIO, once: bool = False) -> None:
        self.count, self.fail_at, self.err, self.once, self.log = 0, i, err, once, []

    def _op(self, op: str, path: str) -> None:
        self.count += 1
        at = self.fail_at
        failed = at is not None and (self.count == at if self.once else self.count >= at)
        self.log.append((op, path, failed))
        if failed:
            raise OSError(self.err, os.strerror(self.err))

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        self._op("mkdir", path)
        super().mkdir(path, mode)

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        self._op("open", path)
        fd = super().open(path, flags, mode)
        self._paths[fd] = path
        return fd

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        self._op("write", self._paths.get(fd, "?"))
        return super().pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        self._op("fsync", self._paths.get(fd, "?"))
        super().fsync(fd)

    def close(self, fd: int) -> None:
        path = self._paths.pop(fd, "?")
        try:
            self._op("close", path)
        finally:
            super().close(fd)  # the descriptor is released even when "close" reports an error

    def rename(self, src: str, dst: str) -> None:
        self._op("rename", dst)
        super().rename(src, dst)

    def fsync_dir(self, path: str) -> None:
        self._op("fsync_dir", path)
        super().fsync_dir(path)


def main() -> None:
    rank, world, port, root, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    ops = SweepOps()
    cases: list[dict[str, Any]] = []
    result: dict[str, Any] = {"rank": rank, "cases": cases}
    try:
        with Checkpointer(root, timeout=TIMEOUT, os_ops=ops) as ck:
            step = 0
            ops.arm(None)
            # the same on every rank, like every later save: counted with the same (deduplicated) work
            ck.save(step, {"w": torch.full((5000,), float(step))}).result(timeout=60)
            counts = [0] * world  # every rank learns how many counted ops each rank makes per save
            counts[rank] = ops.count
            t = torch.tensor(counts)
            dist.all_reduce(t)
            counts = t.tolist()
            result["ops_per_rank"] = counts
            for target in range(world):
                for err, once in ((errno.EIO, False), (errno.ENOSPC, False), (errno.EIO, True), (errno.ENOSPC, True)):
                    for i in range(1, counts[target] + 1):
                        step += 1
                        ops.arm(i if rank == target else None, err, once)
                        t0 = time.monotonic()
                        exc = ck.save(step, {"w": torch.full((5000,), float(step))}).exception(timeout=60)
                        elapsed = time.monotonic() - t0
                        case: dict[str, Any] = {
                            "step": step,
                            "target": target,
                            "err": err,
                            "i": i,
                            "once": once,
                            "elapsed": elapsed,
                            "type": type(exc).__name__ if exc else None,
                        }
                        if rank == target:
                            case["faulted_op"] = next((o for o in ops.log if o[2]), None)
                            fsynced_after_fail = [
                                p
                                for j, (op, p, failed) in enumerate(ops.log)
                                if op == "fsync"
                                and failed
                                and any(o2 == "fsync" and p2 == p for o2, p2, _ in ops.log[j + 1 :])
                            ]
                            case["fsync_retried"] = fsynced_after_fail
                        if isinstance(exc, SaveError):
                            case["failures"] = {str(r): [f.exc_type, f.errno, f.path] for r, f in exc.failures.items()}
                        ops.arm(None)
                        try:
                            ck.flush()
                        except SaveError:
                            pass
                        latest = ck.latest()
                        case["latest"] = latest.step if latest else None
                        if exc is not None:  # the next save after clearing the fault commits
                            case["retry"] = ck.save(step, {"w": torch.full((5000,), float(step))}).result(60).step
                        cases.append(case)
    except BaseException as e:  # noqa: BLE001 - the test reads what happened from the file
        result["crash"] = "".join(traceback.format_exception(e))
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    os._exit(0)


if __name__ == "__main__":
    main()
