"""Warm load(into=) of the small state: the caller thread's CPU, the process CPU (all threads) and
the wall time per tensor, one JSON line (the run's ``load-cpu-300k.jsonl``).

    PYTHONPATH=<checkout> python load_cpu.py 300000 /var/tmp/root 3     # from the repository root
"""

import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from states import StateSpec, build_state, mutate

import asyncckpt

n, root, reps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
state = build_state(StateSpec("small", 1 << 30, n))
if not os.path.exists(os.path.join(root, "step_00000001")):
    with asyncckpt.Checkpointer(root) as ck:
        ck.save(1, state).result()
mutate(state)
asyncckpt.load(root, 1, into=state)  # warm: the files in the page cache, so the figures are the load's own work
cs, ps, ws = [], [], []


def pcpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


for _ in range(reps):
    p0, c0, t0 = pcpu(), time.thread_time(), time.perf_counter()
    asyncckpt.load(root, 1, into=state)
    t1, c1, p1 = time.perf_counter(), time.thread_time(), pcpu()
    cs.append((c1 - c0) * 1e6 / n)
    ps.append((p1 - p0) * 1e6 / n)
    ws.append((t1 - t0) * 1e6 / n)
print(json.dumps({"module": asyncckpt.__file__, "n": n, "caller_cpu_us": cs, "process_cpu_us": ps, "wall_us": ws}))
