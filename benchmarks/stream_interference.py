"""What streaming the staged prefix to disk costs the staging copy, outside the library.

    python benchmarks/stream_interference.py --mib 1024 --tensors 10000 --repeats 9 --out DIR

``save()`` copies the state into a page-aligned buffer in file order (8 MiB groups, the
calling thread and one helper thread, ``memmove`` per tensor) while the writer already writes
the staged prefix with O_DIRECT (16 MiB ``pwrite`` calls). This script rebuilds just that,
without asyncckpt, and times the copy (what ``save()`` blocks for) in three ways, round-robin
so that a noisy neighbour hits each alike:

* ``copy alone``: no writes;
* ``copy + stream``: one thread writes each 16 MiB piece of the buffer once it is copied,
  with O_DIRECT, to a file in ``--dir`` (the library's streaming, without its event loop);
* ``copy + other writes``: the same writes, started at the same time, from another buffer
  (the disk's load without the buffer being written as it is copied).

Prints a markdown table (medians, and each against ``copy alone``) and writes
``results.json`` to ``--out``. The writes outlast the copy; each round waits for them.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import mmap
import os
import sys
import tempfile
import threading
import time
from typing import Any

import torch
from measure import report_medians

GROUP = 8 << 20  # the library's staging group
PIECE = 16 << 20  # the library's write piece
MODES = ("copy alone", "copy + stream", "copy + other writes")
_DIRECT = getattr(os, "O_DIRECT", 0)


class Bench:
    def __init__(self, mib: int, tensors: int, directory: str) -> None:
        per = (mib << 20) // tensors // 4
        self.src = [torch.rand(per) for _ in range(tensors)]
        self.nbytes = per * 4
        self.size = self.nbytes * tensors
        self.buf = mmap.mmap(-1, self.size + PIECE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.other = mmap.mmap(-1, self.size + PIECE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for m in (self.buf, self.other):  # fault every page in now, not in a timed copy
            ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(m)), 1, len(m))
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        self.dst = [base + i * self.nbytes for i in range(tensors)]
        per_group = max(1, GROUP // self.nbytes)
        self.groups = [(i, min(i + per_group, tensors)) for i in range(0, tensors, per_group)]
        self.group_bytes = per_group * self.nbytes
        self.path = os.path.join(directory, f"stream-interference-{os.getpid()}.bin")

    def _writer(self, source: mmap.mmap, reached: Any) -> threading.Thread:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _DIRECT, 0o600)
        view = memoryview(source)

        def run() -> None:
            try:
                for off in range(0, self.size, PIECE):
                    end = min(off + PIECE, self.size)
                    if reached is not None:
                        reached(end)
                    os.pwrite(fd, view[off : off + PIECE], off)  # whole pages: O_DIRECT
            finally:
                os.close(fd)

        t = threading.Thread(target=run)
        t.start()
        return t

    def once(self, mode: str) -> float:
        counter = itertools.count()
        done = [False] * len(self.groups)
        cond = threading.Condition()
        staged = [0]  # groups copied, from the first

        def reached(end: int) -> None:
            need = min(-(-end // self.group_bytes), len(self.groups))
            with cond:
                while staged[0] < need:
                    cond.wait()

        def copy() -> None:
            src, dst, n = self.src, self.dst, self.nbytes
            while True:
                g = next(counter)
                if g >= len(self.groups):
                    return
                lo, hi = self.groups[g]
                for i in range(lo, hi):
                    ctypes.memmove(dst[i], src[i].data_ptr(), n)
                with cond:
                    done[g] = True
                    k = staged[0]
                    while k < len(done) and done[k]:
                        k += 1
                    staged[0] = k
                    cond.notify_all()

        writer = None
        if mode == "copy + stream":
            writer = self._writer(self.buf, reached)
        elif mode == "copy + other writes":
            writer = self._writer(self.other, None)
        t0 = time.perf_counter()
        helper = threading.Thread(target=copy)
        helper.start()
        copy()
        helper.join()
        elapsed = time.perf_counter() - t0
        if writer is not None:
            writer.join()
        return elapsed

    def close(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--tensors", type=int, default=10000)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--dir", default=None, help="where the written file goes (default: a new dir under /var/tmp)")
    p.add_argument("--out", default=None, help="directory for results.json (default: print only)")
    args = p.parse_args(argv)
    if not _DIRECT:
        print("O_DIRECT is not available on this platform", file=sys.stderr)
        return 2
    directory = args.dir or tempfile.mkdtemp(prefix="stream-interference-", dir="/var/tmp")
    bench = Bench(args.mib, args.tensors, directory)
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for m in MODES:  # warm-up round
            bench.once(m)
        for _ in range(args.repeats):
            for m in MODES:
                samples[m].append(bench.once(m))
    finally:
        bench.close()
    print(f"{args.mib} MiB in {args.tensors} tensors, 2 copy threads, median of {args.repeats}\n")
    report_medians("staging copy", samples, "copy alone", args, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
