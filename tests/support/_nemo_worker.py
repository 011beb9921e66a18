"""A rank running NeMo Automodel's own ``_ensure_dirs`` (``_nemo.load()``) under the FUSE fault.

Run as ``python _nemo_worker.py MODE RANK WORLD PORT BASE OUT`` (MODE ``plain`` or
``patched``). Every rank creates its own state directory ``BASE/<step>/rank<R>`` through
``_ensure_dirs`` (NeMo's: ``_create_dirs`` then a barrier; patched: ``asyncckpt.ensure_dir``
on every rank through ``on_every_rank``). The test's FUSE rule makes rank 2's mkdir answer
EEXIST while the directory stays invisible for a while. Events (JSON lines, wall-clock
times) go to OUT as they happen, so the test sees a rank that is still blocked.

``plain``: rank 2's error is caught (a rank that lives on, as in a job whose exception
handler logs and retries), it stays alive ``HOLD_S`` seconds, then exits.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import _nemo
import torch.distributed as dist

HOLD_S = 6.0


def main() -> None:
    mode, rank, world, port, base, out = (
        sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6],
    )  # fmt: skip
    log = open(out, "a", buffering=1)

    def event(kind: str, **kw: Any) -> None:
        log.write(json.dumps({"t": time.time(), "rank": rank, "event": kind, **kw}) + "\n")

    nemo = _nemo.load()
    assert nemo is not None
    if mode == "patched":
        _nemo.patch(nemo, mkdir_timeout=1.0, ranks_timeout=30.0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    steps = ["epoch_1_step_297"] if mode == "plain" else ["epoch_1_step_297", "epoch_1_step_298"]
    for step in steps:
        event("enter", step=step)
        t0 = time.monotonic()
        try:
            nemo.module._ensure_dirs(os.path.join(base, step, f"rank{rank}"))
            event("returned", step=step, s=time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - recorded for the test
            d: dict[str, Any] = {"type": type(e).__name__, "msg": str(e), "s": time.monotonic() - t0}
            failures = getattr(e, "failures", None)
            if failures is not None:
                d["failures"] = {str(r): [f.exc_type, f.errno, f.path] for r, f in failures.items()}
            event("raised", step=step, **d)
            if mode == "plain" and rank == 2:
                time.sleep(HOLD_S)  # alive, not in the barrier: the others wait for it
                event("exit")
                os._exit(1)
            if mode == "plain":
                event("trace", text=traceback.format_exc()[-400:])
                os._exit(1)
    # rank 0 hosts the store: it stays until every rank is done
    store = dist.distributed_c10d._get_default_store()
    store.set(f"test/done/{rank}", "1")
    if rank == 0:
        store.wait([f"test/done/{r}" for r in range(world)], timedelta(seconds=60))
    event("exit")
    os._exit(0)


if __name__ == "__main__":
    main()
