"""A rank of an exit-path test (``test_exit_paths.py``): real gloo ranks, real deaths.

Run as ``python _exit_worker.py SCENARIO RANK WORLD PORT ROOT OUT [EXTRA...]``, or as
``python _exit_worker.py store_host 0 WORLD PORT`` for a stand-alone store host (what
torchrun's agent is). Times are ``time.monotonic()`` (one clock for every process here).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _dist_worker import describe, state_for

from asyncckpt import Checkpointer, SaveError


def timed(timings: dict[str, float], name: str, fn: Callable[[], Any]) -> Any:
    t0 = time.monotonic()
    try:
        return fn()
    finally:
        timings[name] = round(time.monotonic() - t0, 3)


def wait_for_file(path: Path, limit: float = 30.0) -> None:
    end = time.monotonic() + limit
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def scenario_follower_dies(rank: int, world: int, root: str, result: dict[str, Any], extra: list[str]) -> None:
    ck = Checkpointer(root, timeout=4)
    ck.save(1, state_for(rank, 1)).result(timeout=60)
    if rank == 2:
        result["died_at"] = time.monotonic()
        write_result(result)
        os._exit(3)  # dies; the others' next save names it missing
    h = ck.save(2, state_for(rank, 2))
    result["error"] = describe(h.exception(timeout=60))
    t0 = time.monotonic()
    try:
        ck.close()  # rank 0 must not wait for rank 2 again
    except SaveError:
        pass
    result["close_s"] = time.monotonic() - t0


def scenario_follower_dies_idle(rank: int, world: int, root: str, result: dict[str, Any], extra: list[str]) -> None:
    ck = Checkpointer(root, timeout=20)
    ck.save(1, state_for(rank, 1)).result(timeout=60)
    if rank == 2:
        time.sleep(1.5)  # beats a little, then dies while no save is running
        result["died_at"] = time.monotonic()
        write_result(result)
        os._exit(3)
    Path(root, "..", f"closing.{rank}").write_text("")
    t0 = time.monotonic()
    ck.close()  # rank 0 learns of the death only from rank 2's heartbeat
    result["close_s"] = time.monotonic() - t0
    result["threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("asyncckpt"))


def _after_coordinator_died(ck: Checkpointer, rank: int, result: dict[str, Any], pending: Any) -> None:
    timings: dict[str, float] = {}
    result["timings"] = timings
    if pending is None:
        pending = timed(timings, "save_call", lambda: ck.save(2, state_for(rank, 2)))
    result["save_error"] = describe(timed(timings, "pending_save", lambda: pending.exception(timeout=60)))
    try:
        timed(timings, "latest", ck.latest)
        result["latest_error"] = None
    except Exception as e:  # noqa: BLE001 - the test checks the type and the words
        result["latest_error"] = describe(e)
    try:
        h = timed(timings, "next_save_call", lambda: ck.save(3, state_for(rank, 3)))
        result["next_save_error"] = describe(timed(timings, "next_save", lambda: h.exception(timeout=60)))
    except Exception as e:  # noqa: BLE001 - an error at the call is fine too
        result["next_save_error"] = describe(e)
    try:
        timed(timings, "close", ck.close)
    except SaveError as e:
        result["close_error"] = describe(e)


def scenario_leader_killed(rank: int, world: int, root: str, result: dict[str, Any], extra: list[str]) -> None:
    marker = Path(root).parent / "leader_died"
    ck = Checkpointer(root, timeout=20, io_threads=4)
    ck.save(1, state_for(rank, 1)).result(timeout=60)
    if rank == 0:
        time.sleep(0.5)  # the followers' save of step 2 is waiting for rank 0 by now
        # atomically: the followers wait for the file to exist and read it at once (a plain
        # write_text let them read it empty, as time 0, once in a while under load)
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(str(time.monotonic()))
        os.replace(tmp, marker)
        os.kill(os.getpid(), signal.SIGKILL)
    pending = ck.save(2, state_for(rank, 2))  # pending when rank 0 (the store host) dies
    wait_for_file(marker)
    result["leader_died_at"] = float(marker.read_text())
    _after_coordinator_died(ck, rank, result, pending)


def scenario_host_killed(rank: int, world: int, root: str, result: dict[str, Any], extra: list[str]) -> None:
    tmp = Path(extra[1])
    ck = Checkpointer(root, timeout=20, io_threads=4)
    ck.save(1, state_for(rank, 1)).result(timeout=60)
    (tmp / f"saved.{rank}").write_text("")
    wait_for_file(tmp / "killed")
    _after_coordinator_died(ck, rank, result, None)


def write_result(result: dict[str, Any]) -> None:
    with open(f"{OUT}.{result['rank']}.json", "w") as f:
        json.dump(result, f)


OUT = ""


def main() -> None:
    global OUT
    scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    if scenario == "store_host":
        store = dist.TCPStore("127.0.0.1", port, world, is_master=True, timeout=timedelta(seconds=60),
                              wait_for_workers=False)  # fmt: skip
        print("up", flush=True)
        time.sleep(120)
        del store
        return
    root, OUT, extra = sys.argv[5], sys.argv[6], sys.argv[7:]
    if scenario == "host_killed":
        store = dist.TCPStore("127.0.0.1", int(extra[0]), world, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    else:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
    result: dict[str, Any] = {"rank": rank}
    try:
        globals()[f"scenario_{scenario}"](rank, world, root, result, extra)
    except BaseException as e:  # noqa: BLE001 - the test reads what happened from the file
        result["crash"] = "".join(traceback.format_exception(e))
    result["exit_at"] = time.monotonic()
    write_result(result)
    os._exit(0)  # skip process-group teardown: a peer or the store is gone by design


if __name__ == "__main__":
    main()
