"""A process whose I/O the no-signal-death tests (tests/test_no_sigbus.py) break from outside.

Run as ``python _sigbus_worker.py MODE ROOT URL ENDPOINT [CUE]``:

- ``tier``: a training process in tier mode: ``Checkpointer(ROOT, mirror=URL)`` saves step 1
  (``MIB`` MiB), then ``flush()`` waits for its upload; then, once the file ``CUE`` appears
  (the test's cue, sent after it changed the fault; a minute at most), saves step 2 and
  flushes again, and closes;
- ``pull``: ``asyncckpt.remote.pull(URL, ROOT)``, as the README's resume recipe calls it.

Prints one JSON line per phase (``{"phase": ..., "ok": true}`` or the error's type, errno,
message and, for a ``SaveError``, its cause's type and errno) and exits 0: a process that
dies of a signal (SIGBUS: -7) prints nothing more and its return code says so.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

MIB = 12  # larger than the tests' 8 MiB file systems


def _report(phase: str, error: BaseException | None = None) -> None:
    out: dict[str, Any] = {"phase": phase, "ok": error is None}
    if error is not None:
        out.update(type=type(error).__name__, errno=getattr(error, "errno", None), message=str(error))
        cause = error.__cause__
        if cause is not None:
            out.update(cause=type(cause).__name__, cause_errno=getattr(cause, "errno", None))
    print(json.dumps(out), flush=True)


def _opts(endpoint: str) -> dict[str, str]:
    return {"endpoint": endpoint, "access_key_id": "asyncckpt-test-key",
            "secret_access_key": "asyncckpt-test-secret", "region": "us-east-1"}


def tier(root: str, url: str, endpoint: str, cue: str) -> None:
    import torch

    from asyncckpt import Checkpointer

    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(MIB * 2**18, generator=g), "step": 1}
    ck = Checkpointer(root, mirror=url, storage_options=_opts(endpoint), timeout=60)
    try:
        for step in (1, 2):
            if step == 2:
                until = time.monotonic() + 60
                while not os.path.exists(cue) and time.monotonic() < until:
                    time.sleep(0.05)
                if not os.path.exists(cue):
                    return
            try:
                ck.save(step, dict(state, step=step)).result(timeout=60)
                _report(f"save {step}")
            except Exception as e:  # noqa: BLE001 - reported to the test
                _report(f"save {step}", e)
                continue
            try:
                ck.flush(timeout=90)
                _report(f"flush {step}")
            except Exception as e:  # noqa: BLE001 - reported to the test
                _report(f"flush {step}", e)
    finally:
        try:
            ck.close()
            _report("close")
        except Exception as e:  # noqa: BLE001 - reported to the test
            _report("close", e)


def pull(root: str, url: str, endpoint: str, cue: str) -> None:
    from asyncckpt import remote

    try:
        remote.pull(url, root, storage_options=_opts(endpoint), deadline_s=60)
        _report("pull")
    except Exception as e:  # noqa: BLE001 - reported to the test
        _report("pull", e)


if __name__ == "__main__":
    mode, root_arg, url_arg, endpoint_arg = sys.argv[1:5]
    cue_arg = sys.argv[5] if len(sys.argv) > 5 else ""
    {"tier": tier, "pull": pull}[mode](root_arg, url_arg, endpoint_arg, cue_arg)
    print(json.dumps({"phase": "alive", "ok": True}), flush=True)
