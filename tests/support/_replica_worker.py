"""One rank of a peer-replica test (``test_replica.py``): argv rank world port base out.

``NODE_NAMES``: per rank, its ``ASYNCCKPT_NODE`` (comma-separated); each node keeps its
replicas under ``base/<node>/replicas``. ``PUSH``: steps to push (comma-separated), each with
``ATTEMPT`` and :func:`files_for`'s files (one from a file on the node's disk, one from bytes).
``FETCHES``: fetch rounds after the pushes, ``;``-separated, each ``step:attempt:needers`` with
``:corrupt`` appended to have every holder flip one byte of what it holds of that step first.
``DIE_RANK`` dies by SIGKILL at ``DIE_AT``: ``before`` (its push) or ``mid`` (after sending the
header of a 8 MiB frame to its buddy, none of the bytes) or ``hang`` (alive and silent for
``HANG_S``) or ``fetch`` (before the first fetch round). ``BAD_RANK`` pushes a file that is not
there at ``BAD_STEP``; ``FULL_RANK`` finds its tmpfs full at ``FULL_STEP``; ``NO_FILES_RANK``
pushes no files at all. ``STALL_RANK`` stalls ``STALL_S`` seconds (alive) before its push of
``STALL_STEP``, then goes on. A push that breaks the group records what the node's replica
directory holds then (``leftovers``); the pushes go on (the next one builds a new group).
Writes ``out.<rank>.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import time
import traceback
from typing import Any


def files_for(rank: int, step: int, attempt: str, size: int | None = None) -> dict[str, bytes]:
    """The files rank ``rank`` pushes for ``step`` (deterministic; sizes differ by rank)."""
    rnd = random.Random(f"{rank}/{step}/{attempt}")
    n = int(os.environ.get("SIZE", str(64 << 10))) if size is None else size
    return {f"rank{rank:05d}.data": rnd.randbytes(n + 17 * rank), f"rank{rank:05d}.meta": rnd.randbytes(100 + rank),
            "empty": b""}  # fmt: skip


def digest(files: dict[str, bytes]) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in files.items()}


def _describe(e: BaseException) -> dict[str, Any]:
    return {"type": type(e).__name__, "msg": str(e), "failed": {str(k): v for k, v in getattr(e, "failed", {}).items()},
            "broken": getattr(e, "broken", None),
            "files": None if getattr(e, "files", None) is None else digest(e.files)}  # type: ignore[attr-defined]  # fmt: skip


def run(rank: int, world: int, base: str, result: dict[str, Any]) -> None:
    import torch

    from asyncckpt.ranks._distributed import resolve
    from asyncckpt.ranks._nodes import discover
    from asyncckpt.roots.replica import Replicas
    from asyncckpt.roots.replica._wire import DATA, Counts, send

    timeout = float(os.environ.get("REPLICA_TIMEOUT", "30"))
    ctx = resolve(None, 60)
    assert ctx is not None
    nodes = discover(ctx, "replica-test", 30)
    node = nodes.names[nodes.node_of(rank)]
    directory = os.path.join(base, node, "replicas")
    rep = Replicas(ctx, nodes, directory, keep=int(os.environ.get("KEEP", "2")), timeout=timeout)
    result.update(buddy=rep.buddy, sources=list(rep.sources), node=node, pushes=[], fetches=[],
                  links={str(p): pg.size() for p, (pg, _) in rep.group.pairs.items()})  # fmt: skip
    attempt = os.environ.get("ATTEMPT", "a")
    die = os.environ.get("DIE_RANK") == str(rank)
    full: dict[str, Any] = {}
    for step in [int(s) for s in os.environ.get("PUSH", "").split(",") if s]:
        files = files_for(rank, step, attempt)
        disk = os.path.join(base, node, f"own-{rank}-{step}")  # one file from this node's disk
        with open(disk, "wb") as f:
            f.write(files[f"rank{rank:05d}.data"])
        given: dict[str, Any] = {**files, f"rank{rank:05d}.data": disk}
        if os.environ.get("NO_FILES_RANK") == str(rank):  # a rank with nothing to keep
            given = {}
        if os.environ.get("FULL_RANK") == str(rank):  # the OS call: this node's tmpfs is full at FULL_STEP
            import ctypes
            import errno

            from asyncckpt.roots.posix import _fileio

            real = full.setdefault("real", _fileio._FALLOCATE)

            def fallocate(fd: int, mode: int, offset: int, n: int, step: int = step, real: Any = real) -> int:
                if str(step) == os.environ.get("FULL_STEP"):
                    ctypes.set_errno(errno.ENOSPC)
                    return -1
                return int(real(fd, mode, offset, n))

            _fileio._FALLOCATE = fallocate
        if die and os.environ.get("DIE_AT") == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        if die and os.environ.get("DIE_AT") == "hang":  # alive, connected, silent: a stuck process
            time.sleep(float(os.environ.get("HANG_S", "8")))
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ.get("STALL_RANK") == str(rank) and os.environ.get("STALL_STEP") == str(step):
            time.sleep(float(os.environ["STALL_S"]))  # a paused process: it comes back
        if os.environ.get("BAD_RANK") == str(rank) and os.environ.get("BAD_STEP") == str(step):
            given[f"rank{rank:05d}.data"] = disk + ".gone"  # a file that is not there
        if die and os.environ.get("DIE_AT") == "mid":
            big = torch.zeros(8 << 20, dtype=torch.uint8)  # announced, never sent whole: the frame's header
            sending = send(rep.group, rep.buddy, DATA, {"source": rank, "step": step, "attempt": attempt,
                                                      "files": [["x", 8 << 20, 0]]}, [big], Counts())  # fmt: skip
            del sending
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        before = rep.counts.as_json()
        try:
            rep.push(step, attempt, given)
            error = None
        except Exception as e:  # noqa: BLE001 - what the test looks at
            error = _describe(e)
        after = rep.counts.as_json()
        result["pushes"].append({"step": step, "s": time.monotonic() - t0, "error": error,
                                 "counts": {k: after[k] - before[k] for k in after},
                                 "held": rep.held(step, attempt)})  # fmt: skip
        if error and error["broken"] and "leftovers" not in result:
            result["leftovers"] = sorted(
                os.path.relpath(os.path.join(d, n), directory) for d, ds, fs in os.walk(directory) for n in ds + fs
            )
        result["generation"] = rep.generation
    for spec in [s for s in os.environ.get("FETCHES", "").split(";") if s]:
        parts = spec.split(":")
        step, att, needers = int(parts[0]), parts[1], {int(r) for r in parts[2].split(",") if r}
        if parts[3:] == ["corrupt"]:
            for s in rep.sources:
                d = os.path.join(rep.held_here.source_dir(s), f"step_{step:08d}", f"rank{s:05d}.meta")
                with open(d, "r+b") as f:
                    b = f.read(1)
                    f.seek(0)
                    f.write(bytes([b[0] ^ 0xFF]))
        if die and os.environ.get("DIE_AT") == "fetch":
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            got = rep.fetch(step, att, rank in needers)
            entry: dict[str, Any] = {"got": None if got is None else digest(got)}
        except Exception as e:  # noqa: BLE001 - what the test looks at
            entry = {"error": _describe(e)}
        entry.update(step=step, attempt=att, s=time.monotonic() - t0, held=rep.held(step, att))
        result["fetches"].append(entry)


def main() -> None:
    rank, world, port, base, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    import faulthandler

    faulthandler.dump_traceback_later(100)
    os.environ["ASYNCCKPT_NODE"] = os.environ["NODE_NAMES"].split(",")[rank]
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    result: dict[str, Any] = {"rank": rank}
    try:
        run(rank, world, base, result)
    except BaseException as e:  # noqa: BLE001 - the test reads what happened from the file
        result["crash"] = "".join(traceback.format_exception(e))
    with open(f"{out}.{rank}.json.tmp", "w") as f:
        json.dump(result, f)
    os.rename(f"{out}.{rank}.json.tmp", f"{out}.{rank}.json")
    if rank == 0:  # the store lives in this process: keep it up until every other rank is done with it
        end = time.monotonic() + float(os.environ.get("HOST_STORE_S", "30"))
        while time.monotonic() < end and not all(
            os.path.exists(f"{out}.{r}.json") for r in range(world) if str(r) != os.environ.get("DIE_RANK")
        ):
            time.sleep(0.05)
    os._exit(0)  # skip process-group teardown: a peer may be gone by design


if __name__ == "__main__":
    main()
