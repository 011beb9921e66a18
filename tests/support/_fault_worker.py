"""Worker processes of the real-fault tests; writes what happened as JSON.

Two roles:

``python _fault_worker.py race PARAMS.json``
    The directory race: imports ``ensure_dir`` once, then forks ``procs`` processes that
    create the same fresh path each round, all released together by a
    ``multiprocessing.Barrier``. ``lanes`` threads per process run interleaved sequences of
    rounds (round ``i`` in lane ``i % lanes``, one barrier per lane), so rounds that wait
    out a stale window overlap. Each process writes ``OUT.<mode>.<p>.json``.

``python _fault_worker.py rank SCENARIOS RANK WORLD PORT OUT PARAMS.json``
    One rank of a gloo job on localhost running the named kernel-fault scenarios in order
    (``enospc``: a small tmpfs fills up; ``erofs``: a loop-mounted ext4 is remounted
    read-only between saves, by rank 0; ``efbig``: RLIMIT_FSIZE on one rank). Writes
    ``OUT.<rank>.json``. Faults are real: nothing in the library is replaced.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

META_DIR = ".asyncckpt"  # asyncckpt.format._layout.META_DIR: the root's metadata, never a checkpoint
STEP_LEAF = os.path.join("step_00000297", "rng")


def round_path(root: str, mode: str, i: int) -> str:
    return os.path.join(root, mode, f"r{i:04d}", STEP_LEAF)


# -------------------------------------------------------------------------------- the race
def _race_process(p: int, mode: str, params: dict[str, Any], barriers: list[Any]) -> None:
    from asyncckpt.roots.posix._ensure_dir import ensure_dir

    rounds, lanes = int(params["rounds"]), len(barriers)
    deadline_s = float(params.get("deadline_s", 10.0))
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def lane(t: int) -> None:
        for i in range(t, rounds, lanes):
            path = round_path(params["root"], mode, i)
            rec: dict[str, Any] = {"round": i}
            try:
                barriers[t].wait(timeout=120)
            except Exception as e:  # noqa: BLE001 - a broken barrier is a result too
                rec["barrier"] = repr(e)
            t0 = time.monotonic()
            try:
                if mode == "ensure_dir":
                    ensure_dir(path, timeout=deadline_s)
                else:
                    os.makedirs(path, exist_ok=True)
                rec["ok"] = True
            except OSError as e:
                rec.update(ok=False, type=type(e).__name__, errno=e.errno, msg=str(e)[:300])
            rec["s"] = time.monotonic() - t0
            with lock:
                results.append(rec)

    threads = [threading.Thread(target=lane, args=(t,)) for t in range(lanes)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    with open(f"{params['out']}.{mode}.{p}.json", "w") as f:
        json.dump(sorted(results, key=lambda r: r["round"]), f)


def race_main(params_path: str) -> int:
    with open(params_path) as f:
        params = json.load(f)
    import asyncckpt.roots.posix._ensure_dir  # noqa: F401 - imported once here; the forked racers share it

    ctx = mp.get_context("fork")
    procs, lanes = int(params["procs"]), int(params.get("lanes", 1))
    for mode in params["modes"]:
        os.makedirs(os.path.join(params["root"], mode), exist_ok=True)
        barriers = [ctx.Barrier(procs) for _ in range(lanes)]
        workers = [ctx.Process(target=_race_process, args=(p, mode, params, barriers)) for p in range(procs)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        bad = [w.exitcode for w in workers if w.exitcode != 0]
        if bad:
            print(f"race workers of mode {mode} exited with {bad}", file=sys.stderr)
            return 1
    return 0


# ------------------------------------------------------------------------------ the ranks
def _usage(path: str) -> list[int]:
    s = os.statvfs(path)
    return [s.f_bfree, s.f_ffree]


def _sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


def _fail_then_recover(
    rank: int,
    root: str,
    res: dict[str, Any],
    *,
    timeout: float,
    small: int,
    big: int,
    usage_of: str | None,
    inject: Any,
    remove: Any,
) -> None:
    """Commit step 1; inject the fault; save step 2 (must fail); remove it; save step 3."""
    import torch.distributed as dist
    from _dist_worker import describe, state_for  # imported here: the race mode stays torch-free

    from asyncckpt import Checkpointer, SaveError

    with Checkpointer(root, timeout=timeout) as ck:
        ck.save(1, state_for(rank, 1, small)).result(timeout=60)
        dist.barrier()
        inject()
        dist.barrier()
        if rank == 0 and usage_of:
            res["usage_before"] = _usage(usage_of)
        t0 = time.monotonic()
        h = ck.save(2, state_for(rank, 2, big))
        res["error"] = describe(h.exception(timeout=timeout + 30))
        res["elapsed"] = time.monotonic() - t0
        if rank == 0:
            if usage_of:
                res["usage_after"] = _usage(usage_of)
            res["listing_after_failure"] = sorted(n for n in os.listdir(root) if n != META_DIR)
        try:
            ck.flush()
        except SaveError as e:
            res["flush_error"] = describe(e)
        latest = ck.latest()
        res["latest_after_failure"] = latest.step if latest else None
        dist.barrier()
        remove()
        dist.barrier()
        res["next"] = ck.save(3, state_for(rank, 3, small)).result(timeout=60).step
        res["steps"] = ck.steps()
        loaded = ck.load(3)
        res["loaded_extra"] = loaded["extra"]
        if rank == 0:
            res["listing_end"] = sorted(n for n in os.listdir(root) if n != META_DIR)


def scenario_enospc(rank: int, world: int, p: dict[str, Any], res: dict[str, Any]) -> None:
    # steps 1 and 3 fit; step 2 asks for world x big x 4 bytes, more than the tmpfs holds
    _fail_then_recover(
        rank,
        p["root"],
        res,
        timeout=float(p["timeout"]),
        small=4096,
        big=int(p["big_numel"]),
        usage_of=p["mount"],
        inject=lambda: None,
        remove=lambda: None,
    )


def scenario_erofs(rank: int, world: int, p: dict[str, Any], res: dict[str, Any]) -> None:
    mnt = p["mount"]

    def remount(mode: str) -> None:
        if rank == 0:
            _sh("mount", "-o", f"remount,{mode}", mnt)

    _fail_then_recover(
        rank,
        p["root"],
        res,
        timeout=float(p["timeout"]),
        small=4096,
        big=4096,
        usage_of=mnt,
        inject=lambda: remount("ro"),
        remove=lambda: remount("rw"),
    )


def scenario_efbig(rank: int, world: int, p: dict[str, Any], res: dict[str, Any]) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    victim = int(p["rank"])

    def limit() -> None:
        if rank == victim:  # files of this process may not grow past 4 KiB (Python ignores SIGXFSZ)
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))

    def unlimit() -> None:
        if rank == victim:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    try:
        _fail_then_recover(
            rank,
            p["root"],
            res,
            timeout=float(p["timeout"]),
            small=4096,
            big=4096,
            usage_of=p.get("mount"),
            inject=limit,
            remove=unlimit,
        )
    finally:
        unlimit()


def rank_main(argv: list[str]) -> int:
    scenarios, rank, world, port, out, params_path = (
        argv[0].split(","),
        int(argv[1]),
        int(argv[2]),
        argv[3],
        argv[4],
        argv[5],
    )
    import torch.distributed as dist

    with open(params_path) as f:
        params = json.load(f)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    result: dict[str, Any] = {"rank": rank}
    for name in scenarios:
        res: dict[str, Any] = {}
        result[name] = res
        try:
            globals()[f"scenario_{name}"](rank, world, params[name], res)
        except BaseException as e:  # noqa: BLE001 - the test reads what happened from the file
            res["crash"] = "".join(traceback.format_exception(e))
        with open(f"{out}.{rank}.json", "w") as f:
            json.dump(result, f)
        if "crash" in res:
            break  # the ranks may no longer agree on what comes next
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown


if __name__ == "__main__":
    if sys.argv[1] == "race":
        sys.exit(race_main(sys.argv[2]))
    sys.exit(rank_main(sys.argv[2:]))
