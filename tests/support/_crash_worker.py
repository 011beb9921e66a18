"""Helper of ``test_crash_loop.py``: a fork server for workers that save checkpoints until SIGKILLed.

Importing torch takes seconds here, so this process imports it once and forks one worker per
crash: each worker is a separate process that the test kills with a real SIGKILL, and a
restart costs milliseconds instead of seconds. Commands, one per line on stdin:

    run ROOT    fork a worker saving under ROOT; answers ``spawned PID``
    reap PID    wait for that worker to end; answers ``reaped PID CODE`` (``-9``: SIGKILL)
    quit        kill what is left and exit (end of stdin does the same)

and it reports ``exited PID CODE`` as soon as a worker ends, killed or not.

A worker opens a ``Checkpointer`` on ROOT, prints ``PID start S`` where S is the newest
complete step + 1, and saves ``expected_state(S)``, ``expected_state(S + 1)``, ... one after
the other. It reports its progress as ``PID EVENT STEP`` lines, each written before the
worker goes on:

    saving     about to call save()              (staging follows)
    staged     save() returned; the worker scribbles over its tensors at once
    write      the writer created the attempt directory  (shard write, fsync)
    commit     the writer opened the manifest            (manifest, its rename, fsyncs)
    renamed    the writer is renaming the attempt to step_N (the commit point; then fsync, retention)
    committed  the save's handle reported the commit
    (then it idles ``IDLE_S`` seconds, "training", before the next save)

``write`` and ``commit`` come from an :class:`OsOps` wrapper, which also sleeps ``PACE_S``
before each metadata operation: like a slower file system, that spreads the commit over
tens of milliseconds so that kills land inside it.
"""

from __future__ import annotations

import os
import re
import select
import signal
import sys
import time
import traceback
from typing import Any

import torch

from asyncckpt import Checkpointer
from asyncckpt.roots.posix._osops import OsOps

KEEP_LAST = 2
PACE_S = 0.003
IDLE_S = 0.03
MAX_SAVES = 40  # a worker nobody kills stops by itself
_FLOATS = 4 * 2**20  # 16 MiB of float32
_INTS = 2**20  # 8 MiB of int64
_TMP = re.compile(r"step_(\d+)\.tmp-[0-9a-f]+$")
_FINAL = re.compile(r"step_(\d+)$")


def expected_state(step: int) -> dict[str, Any]:
    """What the worker saves at ``step`` (~26 MB); every value depends on the step."""
    g = torch.Generator().manual_seed(step)
    ramp = torch.arange(_FLOATS, dtype=torch.float32)
    return {
        "model": {
            "weight": ramp.mul(1e-3).add_(step),
            "bias": torch.randn(4099, generator=g),
            "half": torch.randn(512, 1024, generator=g).to(torch.bfloat16),
            "mask": torch.arange(100_003) % (step + 2) == 0,
        },
        "optim": {
            "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(64, 64, generator=g)}},
            "param_groups": [{"lr": 1.0 / (step + 1), "betas": (0.9, 0.999), "params": [0]}],
        },
        "ids": torch.arange(_INTS, dtype=torch.int64) * step,
        "extra": {
            "step": step,
            "tag": f"step-{step}",
            "blob": step.to_bytes(8, "little") * 3,
            "ratio": step / 7,
            "even": step % 2 == 0,
            "none": None,
            "ninf": float("-inf"),
        },
    }


def scribble(obj: Any) -> None:
    """Overwrite every tensor in ``obj`` in place (save() must have copied them already)."""
    if isinstance(obj, torch.Tensor):
        obj.fill_(True if obj.dtype == torch.bool else 0)
    elif isinstance(obj, dict):
        for v in obj.values():
            scribble(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            scribble(v)


def emit(line: str) -> None:
    os.write(1, (line + "\n").encode())  # one write: lines of concurrent threads never interleave


class PacedOps(OsOps):
    """The real OS calls, each metadata operation preceded by ``PACE_S`` of sleep; reports phases."""

    def _pace(self) -> None:
        time.sleep(PACE_S)

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        self._pace()
        m = _TMP.search(path)
        if m:
            emit(f"{os.getpid()} write {int(m.group(1))}")
        super().mkdir(path, mode)

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        self._pace()
        m = _TMP.search(os.path.dirname(path))
        if m and os.path.basename(path).startswith("manifest"):
            emit(f"{os.getpid()} commit {int(m.group(1))}")
        return super().open(path, flags, mode)

    def fsync(self, fd: int) -> None:
        self._pace()
        super().fsync(fd)

    def rename(self, src: str, dst: str) -> None:
        self._pace()
        m = _FINAL.search(dst)
        if m and _TMP.search(src):
            emit(f"{os.getpid()} renamed {int(m.group(1))}")
        super().rename(src, dst)

    def fsync_dir(self, path: str) -> None:
        self._pace()
        super().fsync_dir(path)

    def rmdir(self, path: str) -> None:
        self._pace()
        super().rmdir(path)


def worker(root: str, server: int) -> None:
    """Save successive steps under ``root`` until killed (runs in the forked child)."""
    torch.set_num_threads(1)
    pid = os.getpid()
    ck = Checkpointer(root, keep_last=KEEP_LAST, timeout=60.0, os_ops=PacedOps())
    latest = ck.latest()
    step = latest.step + 1 if latest is not None else 1
    emit(f"{pid} start {step}")
    for _ in range(MAX_SAVES):
        if os.getppid() != server:  # the fork server is gone: nobody will kill us
            break
        state = expected_state(step)
        emit(f"{pid} saving {step}")
        handle = ck.save(step, state)
        emit(f"{pid} staged {step}")
        scribble(state)
        handle.result(timeout=60.0)
        emit(f"{pid} committed {step}")
        time.sleep(IDLE_S)
        step += 1
    ck.close()


def serve() -> None:
    """The fork server's loop: commands from stdin; ``exited PID CODE`` whenever a worker dies."""
    server = os.getpid()
    codes: dict[int, int] = {}  # exit codes of reaped workers
    alive: set[int] = set()

    def reap(pid: int = -1, flags: int = os.WNOHANG) -> None:
        while alive:
            try:
                got, status = os.waitpid(pid, flags)
            except ChildProcessError:
                return
            if got == 0:
                return
            alive.discard(got)
            codes[got] = os.waitstatus_to_exitcode(status)
            emit(f"exited {got} {codes[got]}")
            if pid != -1:
                return

    emit("ready")
    pending = b""
    try:
        while True:
            readable, _, _ = select.select([0], [], [], 0.02)
            reap()
            if not readable:
                continue
            chunk = os.read(0, 4096)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                cmd, _, arg = line.decode().partition(" ")
                if cmd == "run":
                    pid = os.fork()
                    if pid == 0:
                        code = 0
                        try:
                            worker(arg, server)
                        except BaseException:  # noqa: BLE001 - report, then leave without any cleanup
                            traceback.print_exc()
                            sys.stderr.flush()
                            code = 3
                        os._exit(code)
                    alive.add(pid)
                    emit(f"spawned {pid}")
                elif cmd == "reap":
                    pid = int(arg)
                    if pid in alive:
                        reap(pid, 0)
                    emit(f"reaped {pid} {codes.get(pid)}")
                elif cmd == "quit":
                    return
    finally:
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass


if __name__ == "__main__":
    serve()
