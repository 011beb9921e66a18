"""What a forked child costs the parent's next save (a DataLoader worker started by fork).

    python benchmarks/fork_child.py --mib 256 --repeats 7 --out DIR

Saves a state of ``--mib`` MiB (64 tensors) with a ``Checkpointer`` and times ``save()``'s
blocking part in two situations, alternating: no child, and right after ``os.fork()`` of a
child that sleeps until the save returned (what DataLoader workers do to the staging buffer's
pages: if the child shared them copy-on-write, the parent's copy into each page would fault
and copy it first). ``--huge`` uses ``Checkpointer(huge_pages=True)``. Prints a markdown
table of medians and writes ``results.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (HERE, REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
from measure import report_medians  # noqa: E402

from asyncckpt import Checkpointer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--huge", action="store_true", help="Checkpointer(huge_pages=True)")
    p.add_argument("--out", default=None, help="directory for results.json (default: print only)")
    args = p.parse_args(argv)
    if not hasattr(os, "fork"):
        print("needs fork()", file=sys.stderr)
        return 2
    per = (args.mib << 20) // 64 // 4
    state = {f"w{i}": torch.rand(per) for i in range(64)}
    root = tempfile.mkdtemp(prefix="fork-child-", dir="/var/tmp")
    samples: dict[str, list[float]] = {"no child": [], "child alive": []}
    step = 0
    try:
        with Checkpointer(root, keep_last=1, huge_pages=args.huge) as ck:
            for _ in range(3):  # warm-up: the staging buffer exists, the layout is planned
                step += 1
                ck.save(step, state).result()
            for _ in range(args.repeats):
                for case in samples:
                    pid = -1
                    if case == "child alive":
                        pid = os.fork()
                        if pid == 0:  # the child: lives through the parent's save, touches nothing
                            time.sleep(5.0)
                            os._exit(0)
                        time.sleep(0.05)
                    step += 1
                    t0 = time.perf_counter()
                    handle = ck.save(step, state)
                    samples[case].append(time.perf_counter() - t0)
                    if pid > 0:
                        os.kill(pid, 9)
                        os.waitpid(pid, 0)
                    handle.result()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.mib} MiB in 64 tensors, huge_pages={args.huge}, median of {args.repeats}\n")
    report_medians("save() blocking", samples, "no child", args, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
