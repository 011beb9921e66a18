"""The memory a load of many small tensors takes beyond the state itself (issue 32: at most
1 KB a tensor up to 300,000 tensors). 100,000 tensors of an Adam-shaped state, each load in a
process of its own (one that saved, or loaded before, would reuse that memory and hide the
load's own): the peak RSS (VmHWM) above the RSS when the load starts; with ``into=``
everything counts, without it everything above the returned tensors' bytes (their own
objects and the returned containers included).

Before the slots stood in for the tensors when the targets were planned, the header's bytes
were dropped after their CRC, the tree was parsed compact (tensors resolved as it is read)
and emptied as the state was built, and the reads' destinations became runs: 1,466 and 1,635
bytes a tensor (``into=``, fresh); after: ~895 and ~965.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

N = 100_000
#: bytes a tensor asserted: the issue's bound (what a load took before is well above it)
LIMIT = {"into": 1024, "fresh": 1024}

#: (three processes of 100,000 tensors: ~12 s on a quiet 2-core machine)
pytestmark = [
    pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's VmHWM reset"),
]

_CHILD = r"""
import ctypes, gc, json, sys
import torch
from asyncckpt import Checkpointer, load

mode, n, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
k = n // 4
model = {f"blocks.{i // 100}.p{i % 100}": torch.full((4,), float(i)) for i in range(k)}
optim = {i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.ones(4)} for i in range(k)}
state = {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 0.1, "params": list(range(k))}]}}
if mode == "save":
    with Checkpointer(root) as ck:
        ck.save(1, state).result()
    sys.exit(0)


def rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise AssertionError(field)


for t in model.values():
    t.zero_()
nbytes = sum(t.nbytes for t in model.values()) + sum(t.nbytes for s in optim.values() for t in s.values())
if mode == "fresh":
    del model, optim, state
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := the current RSS
before = rss("VmRSS:")
got = load(root, 1, into=state) if mode == "into" else load(root, 1)
extra = rss("VmHWM:") - before - (nbytes if mode == "fresh" else 0)
assert torch.equal(got["model"]["blocks.0.p7"], torch.full((4,), 7.0))
if mode == "into":
    assert got["model"]["blocks.0.p7"] is model["blocks.0.p7"]
print(json.dumps(extra / n))
"""


def _child(*args: str) -> str:
    cmd = [sys.executable, "-c", _CHILD, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=100, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow  # > 15 s in make test's parallel phase: make test-slow (and CI) runs it
def test_a_load_of_100k_tensors_takes_well_under_a_kilobyte_each(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    _child("save", str(N), root)  # (each load in a process of its own: none reuses another's memory)
    into = json.loads(_child("into", str(N), root).splitlines()[-1])
    assert into <= LIMIT["into"], f"load(into=) took {into:.0f} bytes a tensor beyond the state"
    fresh = json.loads(_child("fresh", str(N), root).splitlines()[-1])
    assert fresh <= LIMIT["fresh"], f"load() took {fresh:.0f} bytes a tensor beyond its tensors"
