"""Launch the ranks of a multi-process test as real subprocesses, with a hard deadline.

Every multi-rank test goes through :func:`run_ranks`: each rank runs ``argv(rank)`` with
stdout/stderr in ``log_dir/rank<R>.log``; whatever is still running at the deadline is
killed, so no test can leave a process behind or hang. ``warm=True`` forks the ranks from a
server that imported torch already (``_warm``: seconds of CPU less per rank) instead of
starting a fresh interpreter each; for workers that do not test how an interpreter exits, in
tests of the parallel phase only (not ``slow``, not ``timing``, no deadline of a few seconds).
``TESTS_WARM_RANKS=0`` in the environment starts every rank fresh (to compare, or to rule the
server out).

The worker's side: :func:`run_scenario` is a rank's life once it has parsed its arguments
(the gloo group, the scenario, its result or crash in ``OUT.RANK.json`` for :func:`results`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import _warm


def free_port() -> int:
    """A TCP port on localhost that is free right now (for the gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    argv: Callable[[int], list[str]],
    world: int,
    log_dir: Path,
    deadline: float,
    extra_env: dict[str, str] | None = None,
    on_started: Callable[[list[subprocess.Popen[bytes]]], None] | None = None,
    warm: bool = False,
) -> list[int]:
    """Run ``world`` ranks to completion or ``deadline`` seconds; return the ranks that hung."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **(extra_env or {}))
    warm = warm and os.environ.get("TESTS_WARM_RANKS", "1") != "0"
    logs = [open(log_dir / f"rank{r}.log", "wb") for r in range(world)]
    procs: list[Any] = []
    try:
        for r in range(world):
            if warm:
                procs.append(_warm.spawn(argv(r), env, str(log_dir / f"rank{r}.log")))
            else:
                cmd = [sys.executable, *argv(r)]
                procs.append(subprocess.Popen(cmd, env=env, stdout=logs[r], stderr=subprocess.STDOUT))
        if on_started is not None:
            on_started(procs)
        end = time.monotonic() + deadline
        for p in procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [r for r, p in enumerate(procs) if p.poll() is None]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs:
            f.close()


def log_tail(log_dir: Path, rank: int, n: int = 3000) -> str:
    return (log_dir / f"rank{rank}.log").read_text(errors="replace")[-n:]


def results(out: str | Path, world: int, log_dir: Path, dead: tuple[int, ...] = ()) -> dict[int, dict[str, Any]]:
    """What each rank but ``dead`` wrote to ``OUT.RANK.json`` (read, then removed): a rank that
    wrote nothing or recorded a crash fails the test with its log's tail."""
    import json

    res = {}
    for r in range(world):
        if r in dead:
            continue
        f = Path(f"{out}.{r}.json")
        assert f.exists(), f"rank {r} wrote no result:\n{log_tail(log_dir, r)}"
        res[r] = json.loads(f.read_text())
        f.unlink()
        assert "crash" not in res[r], res[r]["crash"]
    return res


def rank_results(out: Path, logs: Path, hung: list[int], world: int) -> dict[int, dict[str, Any]]:
    """:func:`results` after ``run_ranks`` returned ``hung``: none may have hung."""
    assert not hung, f"ranks {hung} hung:\n" + "\n".join(log_tail(logs, r) for r in hung)
    return results(out, world, logs)


def run_scenario(
    rank: int, world: int, port: str | int, out: str, scenario: Callable[[dict[str, Any]], object],
    timeout_s: float = 60.0,
) -> NoReturn:  # fmt: skip
    """A worker rank's life once it has parsed its arguments: join the gloo group on
    ``127.0.0.1:port`` (``timeout_s``), run ``scenario(res)``, write ``res`` (with ``"rank"``,
    and ``"crash"``: the traceback of whatever it raised) to ``OUT.RANK.json`` for
    :func:`results`, and end the process at once (``os._exit(0)``: no interpreter teardown)."""
    import json
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    res: dict[str, Any] = {"rank": rank}
    try:
        scenario(res)
    except BaseException as e:  # noqa: BLE001 - the test reads what happened from the file
        res["crash"] = "".join(traceback.format_exception(e))
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(res, f)
    os._exit(0)
