"""Where the durable save's gap to the raw write comes from at large sizes (issue 32).

The growth run's raw limit writes a bounded file image (256 MiB, over and over) with
O_DIRECT. A save writes every byte of its staging buffer once, after copying the state into
it and while computing its CRC-32C. This run writes the same number of bytes with O_DIRECT
from a buffer of the full size (the staging buffer's shape), alternating, and adds the save's
other work one piece at a time, each in its own thread beside the writer:

* ``image``: the growth run's raw limit (a 256 MiB image over and over);
* ``full``: every byte from a full-size page-aligned buffer;
* ``full+copy``: ``full`` while ``copy_`` fills that buffer from a tensor of the same size,
  the writer never ahead of the copy (the save's staging, on torch's threads);
* ``full+crc``: ``full`` while another thread computes the buffer's CRC-32C (16 MiB calls);
* ``full+copy+crc``: both, the CRC starting once the copy ended (the save's order);
* ``save``: ``Checkpointer.save()`` of that tensor until ``handle.result()`` (the durable time).

    python benchmarks/durable_gap.py --size 8G --repeats 3 --out /tmp/gap

Prints a table (medians, and each variant against ``image``) and writes ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import crc32c
import torch
from measure import fsync_dir, summary

import asyncckpt

CHUNK = 16 * 1024 * 1024
IMAGE = 256 * 1024 * 1024


def _parse_size(text: str) -> int:
    units = {"M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


class Progress:
    """How many bytes of the buffer the copy has filled (the writer waits for them)."""

    def __init__(self, done: int) -> None:
        self.cond = threading.Condition()
        self.done = done

    def advance(self, n: int) -> None:
        with self.cond:
            self.done = n
            self.cond.notify_all()

    def wait_for(self, n: int) -> None:
        with self.cond:
            while self.done < n:
                self.cond.wait()


def _write(scratch: str, view: memoryview, size: int, image: int, progress: Progress | None) -> float:
    """O_DIRECT write of ``size`` bytes (``view`` over and over when it is ``image`` long) + fsyncs."""
    path = os.path.join(scratch, f"f{time.monotonic_ns()}")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    try:
        pos = 0
        while pos < size:
            n = min(CHUNK, size - pos)
            if progress is not None:
                progress.wait_for(pos + n)
            off = pos % image
            pos += os.write(fd, view[off : off + n])
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(scratch)
    elapsed = time.perf_counter() - t0
    os.unlink(path)
    fsync_dir(scratch)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="8G")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scratch", default=None, help="a directory on the disk to measure (default: /var/tmp)")
    ap.add_argument("--out", default="/tmp/durable-gap")
    ap.add_argument("--no-save", action="store_true", help="leave out `save` (its staging buffer is a third copy)")
    args = ap.parse_args()
    size = _parse_size(args.size)
    scratch = tempfile.mkdtemp(prefix="gap-", dir=args.scratch or "/var/tmp")
    os.makedirs(args.out, exist_ok=True)

    src = torch.randint(0, 255, (size,), dtype=torch.uint8)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    view = memoryview(buf)
    dst = torch.frombuffer(buf, dtype=torch.uint8)
    dst.copy_(src)
    image = memoryview(mmap.mmap(-1, IMAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
    image[:] = view[:IMAGE]

    def copy_into(progress: Progress) -> None:
        for off in range(0, size, CHUNK * 4):
            end = min(off + CHUNK * 4, size)
            dst[off:end].copy_(src[off:end])
            progress.advance(end)

    def crc_all() -> None:
        v = 0
        for off in range(0, size, CHUNK):
            v = crc32c.crc32c(view[off : off + CHUNK], v)

    def with_threads(work: Callable[[Progress], None] | None, crc: bool) -> float:
        progress = Progress(0 if work is not None else size)
        result: list[float] = []

        def side() -> None:
            if work is not None:
                work(progress)
            if crc:
                crc_all()

        t = threading.Thread(target=side)
        w = threading.Thread(target=lambda: result.append(_write(scratch, view, size, size, progress)))
        w.start()
        t.start()
        w.join()
        t.join()
        return result[0]

    root = os.path.join(scratch, "ck")
    ck = asyncckpt.Checkpointer(root, keep_last=1)
    step = [0]

    def save() -> float:
        step[0] += 1
        t0 = time.perf_counter()
        ck.save(step[0], {"w": src}).result(timeout=600)
        return time.perf_counter() - t0

    variants: dict[str, Callable[[], float]] = {
        "image": lambda: _write(scratch, image, size, IMAGE, None),
        "full": lambda: with_threads(None, False),
        "full+copy": lambda: with_threads(copy_into, False),
        "full+crc": lambda: with_threads(None, True),
        "full+copy+crc": lambda: with_threads(copy_into, True),
    }
    if not args.no_save:
        variants["save"] = save
    for fn in variants.values():  # warm-up: first file, first save's buffers
        fn()
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):  # round-robin: a noisy neighbour slows every variant alike
        for name, fn in variants.items():
            samples[name].append(fn())
    ck.close()
    shutil.rmtree(scratch, ignore_errors=True)

    stats = {k: summary(v) for k, v in samples.items()}
    base = stats["image"]["median"]
    print(f"\nO_DIRECT writes of {size / 2**30:.2f} GiB, medians of {args.repeats} (load {os.getloadavg()[0]:.2f})")
    print("| variant | median s | min s | x image |\n|---|---|---|---|")
    for k, s in stats.items():
        print(f"| {k} | {s['median']:.3f} | {s['min']:.3f} | {s['median'] / base:.2f}x |")
    meta = {"size": size, "repeats": args.repeats, "host": platform.node(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "load": os.getloadavg()}  # fmt: skip
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": stats}, f, indent=1)


if __name__ == "__main__":
    main()
