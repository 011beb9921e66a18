"""A process saving to an object-store root, for tests/test_s3_checkpointer.py.

``python _s3_worker.py resume URL OPTIONS_JSON OUT``: load the newest step, write what it got.
``python _s3_worker.py save URL OPTIONS_JSON OUT STEP [LEASE_TTL]``: save STEP and wait (the test kills it).
``python _s3_worker.py try URL OPTIONS_JSON OUT``: construct a Checkpointer, write what it raised.
``python _s3_worker.py exit URL OPTIONS_JSON OUT``: save step 1, then exit without close().
``python _s3_worker.py lease URL OPTIONS_JSON OUT RANK WORLD PORT``: one gloo rank (lease TTL 4 s)
saving step 1, then, once the test creates ``OUT.go``, steps 2 and 3; writes how each went.
``python _s3_worker.py ranks URL OPTIONS_JSON OUT RANK WORLD PORT``: one gloo rank saving steps
1 and 2 (each rank its own state) to the shared prefix, then loading step 2 back.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch

from asyncckpt import Checkpointer, SaveError

MiB = 1024 * 1024


def state_for(step: int, rank: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"model": {"big": torch.randn(MiB // 4 + 3, generator=g), "b": torch.arange(step, step + 5)},
            "step": step, "rank": rank}


def main() -> None:
    what, url, opts, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    res: dict[str, Any] = {}
    try:
        if what == "resume":
            with Checkpointer(url, storage_options=opts, timeout=60) as ck:
                latest = ck.latest()
                res["latest"] = None if latest is None else latest.step
                got = ck.load()
                want = state_for(got["step"])
                res["equal"] = bool(torch.equal(got["model"]["big"], want["model"]["big"]))
        elif what == "save":
            ttl = float(sys.argv[6]) if len(sys.argv) > 6 else None
            ck = Checkpointer(url, storage_options=opts, timeout=120, lease_ttl=ttl)
            ck.save(int(sys.argv[5]), state_for(int(sys.argv[5])))
            print("staged", flush=True)
            time.sleep(600)  # killed by the test while the upload is held at the proxy
        elif what == "exit":
            Checkpointer(url, storage_options=opts, timeout=60, lease_ttl=4).save(1, state_for(1)).result(timeout=60)
            res["saved"] = True  # the exit hook closes it: the lease is released on the way out
        elif what == "try":
            try:
                Checkpointer(url, storage_options=opts, timeout=60, lease_ttl=4).close()
                res["error_type"] = None
            except Exception as e:  # noqa: BLE001 - the test checks the type
                res["error_type"] = type(e).__name__
                res["message"] = str(e)
        elif what == "lease":
            import torch.distributed as dist

            rank, world, port = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=60))
            ck = Checkpointer(url, storage_options=opts, timeout=30, lease_ttl=4)
            ck.save(1, state_for(1, rank)).result(timeout=60)
            with open(f"{out}.ready{rank}", "w"):
                pass
            end = time.monotonic() + 60
            while not os.path.exists(f"{out}.go") and time.monotonic() < end:
                time.sleep(0.05)
            for step in (2, 3):
                try:
                    ck.save(step, state_for(step, rank)).result(timeout=60)
                    res[str(step)] = "committed"
                except SaveError as e:
                    res[str(step)] = {r: f.exc_type for r, f in e.failures.items()}
                    res[f"{step}-type"] = type(e).__name__
                    res["message"] = str(e)
            try:
                ck.close()
            except SaveError:
                pass  # the failures above, not yet flushed
            dist.destroy_process_group()
        elif what in ("save2", "fallback"):
            import torch.distributed as dist

            rank, world, port = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=60))
            with Checkpointer(url, storage_options=opts, timeout=60) as ck:
                if what == "save2":
                    for step in (1, 2):
                        ck.save(step, state_for(step, rank)).result(timeout=60)
                else:
                    got = ck.load()  # rank 1's shard of step 2 is corrupt: every rank falls back to 1
                    res["step"] = got["step"]
                    res["equal"] = bool(torch.equal(got["model"]["big"], state_for(1, rank)["model"]["big"]))
                    try:
                        ck.load(step=2)
                        res["explicit"] = "loaded"
                    except Exception as e:  # noqa: BLE001 - the test checks the type
                        res["explicit"] = type(e).__name__
            dist.destroy_process_group()
        else:
            import torch.distributed as dist

            rank, world, port = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=60))
            with Checkpointer(url, storage_options=opts, keep_last=1, timeout=20) as ck:
                shared = torch.arange(300_000, dtype=torch.float32)  # the same on both: written once (dedupe)
                ck.save(1, {**state_for(1, rank), "shared": shared}).result(timeout=60)
                try:
                    ck.save(2, state_for(2, rank)).result(timeout=60)
                    res["second"] = "committed"
                except SaveError as e:
                    res["second"] = {r: f.exc_type for r, f in e.failures.items()}
                    res["message"] = str(e)
                    try:
                        ck.flush(timeout=30)
                    except SaveError:
                        pass  # the same failure, already recorded
                latest = ck.latest()
                res["latest"] = None if latest is None else latest.step
                got = ck.load()
                want = state_for(got["step"], rank)
                res["equal"] = bool(torch.equal(got["model"]["big"], want["model"]["big"])) and got["rank"] == rank
                res["shared"] = bool(torch.equal(got["shared"], shared))
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
