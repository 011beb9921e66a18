"""push / pull / remote load of one checkpoint against raw obstore, on a loopback SeaweedFS.

    python benchmarks/s3_push_pull.py              # 256 MiB, 3 repeats
    python benchmarks/s3_push_pull.py --size-mib 1024 --repeats 1

In one run, on one server: a Checkpointer writes the state (4 float32 tensors) locally, then
per repeat (fresh prefixes): raw obstore multipart PUT of the same bytes from a memoryview
(64 MiB parts, 8 in flight, unsigned payload), ``asyncckpt.remote.push`` (the local files read
with pread in 16 MiB parts, CRC-32C alongside, HEAD, conditional manifest create), raw obstore
parallel ranged GETs into one buffer, ``asyncckpt.remote.pull`` (the files' space reserved,
ranged GETs written with pwrite, CRC-32C, fsync, rename) and ``asyncckpt.load(url)`` (ranged
GETs into fresh tensors, CRC-32C). Loopback has no link limit: the times measure client +
server CPU on this machine (the server spends ~15 CPU-s per GiB written), so compare the
ratios, not the MiB/s, with a real network.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

import obstore
import torch
from obstore.store import S3Store
from s3server import S3Server

import asyncckpt
from asyncckpt import Checkpointer, remote

MiB = 1024 * 1024
PART = 64 * MiB
BUCKET = "bench"


def raw_store(endpoint: str, opts: dict[str, str], prefix: str) -> S3Store:
    cfg = {k: v for k, v in opts.items() if k != "endpoint"}
    return S3Store(BUCKET, prefix=prefix, endpoint=endpoint, config={**cfg, "unsigned_payload": "true"},  # type: ignore[arg-type]
                   client_options={"allow_http": True})


async def raw_put(st: S3Store, data: memoryview) -> None:
    chunks = [data[i : i + PART] for i in range(0, data.nbytes, PART)]
    await obstore.put_async(st, "blob", chunks, use_multipart=True, chunk_size=PART, max_concurrency=8)


async def raw_get(st: S3Store, out: memoryview) -> None:
    sem = asyncio.Semaphore(8)

    async def one(start: int) -> None:
        n = min(PART, out.nbytes - start)
        async with sem:
            got = await obstore.get_range_async(st, "blob", start=start, length=n)
        out[start : start + n] = memoryview(got)

    await asyncio.gather(*(one(s) for s in range(0, out.nbytes, PART)))


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    size = args.size_mib * MiB
    work = Path(tempfile.mkdtemp(prefix="s3bench-"))
    server = S3Server(volumes=64)
    try:
        server.start()
        server.create_bucket(BUCKET)
        opts = server.storage_options()
        g = torch.Generator().manual_seed(0)
        state = {f"t{i}": torch.randn(size // 16, generator=g) for i in range(4)}
        root = work / "ck"
        with Checkpointer(root) as ck:
            ck.save(1, state).result(timeout=600)
        blob = bytearray(os.urandom(size))
        rows: dict[str, list[float]] = {k: [] for k in ("raw put", "push", "raw get", "pull", "load(url)")}
        for _ in range(args.repeats):
            tag = uuid.uuid4().hex[:8]
            st = raw_store(server.endpoint, opts, f"raw-{tag}")
            url = f"s3://{BUCKET}/ck-{tag}"
            rows["raw put"].append(timed(lambda: asyncio.run(raw_put(st, memoryview(blob)))))  # noqa: B023
            rows["push"].append(timed(lambda: remote.push(root, url, storage_options=opts)))  # noqa: B023
            out = bytearray(size)
            rows["raw get"].append(timed(lambda: asyncio.run(raw_get(st, memoryview(out)))))  # noqa: B023
            assert out == blob
            dest = work / f"pulled-{tag}"
            rows["pull"].append(timed(lambda: remote.pull(url, dest, storage_options=opts)))  # noqa: B023
            got: dict[str, torch.Tensor] = {}
            rows["load(url)"].append(timed(lambda: got.update(asyncckpt.load(url, storage_options=opts))))  # noqa: B023
            assert all(torch.equal(got[k], v) for k, v in state.items())
            shutil.rmtree(dest)
        print(f"{args.size_mib} MiB, 64 MiB parts, 8 in flight, SeaweedFS on loopback, {os.cpu_count()} CPUs, "
              f"median of {args.repeats}")
        for name, ts in rows.items():
            med = statistics.median(ts)
            print(f"  {name:10s} {med:6.2f} s  {args.size_mib / med:7.0f} MiB/s")
        print(f"  push / raw put: {statistics.median(rows['raw put']) / statistics.median(rows['push']):.2f}x speed; "
              f"pull / raw get: {statistics.median(rows['raw get']) / statistics.median(rows['pull']):.2f}x; "
              f"load / raw get: {statistics.median(rows['raw get']) / statistics.median(rows['load(url)']):.2f}x")
    finally:
        server.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
