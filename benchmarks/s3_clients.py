"""S3 clients side by side on a loopback SeaweedFS server: upload from a memoryview, ranged GETs.

    python benchmarks/s3_clients.py                    # 1 GiB, 64 MiB parts, 8 in flight
    python benchmarks/s3_clients.py --size 256M --repeats 2
    python benchmarks/s3_clients.py --help

Upload methods (each sends the same buffer, multipart, same part size and concurrency):

* ``asyncckpt``   - :meth:`asyncckpt.roots.objstore._client.ObjectStore.put_file` (obstore underneath, plus
  CRC-32C of the source alongside and a HEAD to check the stored size);
* ``obstore``     - raw ``obstore.put_async`` of part-sized memoryview slices, unsigned payload;
* ``aiobotocore`` - create / upload_part / complete, one ``bytes`` copy per part (its body
  must be bytes), ``request_checksum_calculation="when_required"``;
* ``s3fs``        - ``S3FileSystem._pipe_file`` (needs the whole object as bytes: one copy).

Download methods: parallel ranged GETs of ``--part`` bytes into one preallocated buffer
(``asyncckpt`` get_range_into, raw obstore ``get_range_async`` + copy, aiobotocore streaming
``readinto``-style chunks, s3fs ``_cat_file``). Every round trip is checked by CRC-32C.

Each case runs in its own subprocess so its CPU seconds (user+sys, all threads) and its peak
extra RSS (VmHWM minus VmRSS after the buffer was allocated and touched) are its own. The
server's CPU seconds per case are read from /proc. Loopback has no network limit: wall time
measures CPU (client + server) on this machine, not a link. A client that is not installed
is reported as skipped. Results go to ``--out`` (default benchmarks/results/s3-<date>/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(1, os.path.join(REPO, "tests", "support"))

MiB = 1 << 20
BUCKET = "bench-bucket"
PUTS = ["asyncckpt", "obstore", "aiobotocore", "s3fs"]
GETS = ["asyncckpt", "obstore", "aiobotocore", "s3fs"]


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_of(pid: int) -> float:
    """CPU seconds of ``pid`` and its threads (the weed server)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return float("nan")


# -- worker side (one case per process) ------------------------------------------------------


def _opts(endpoint: str) -> dict[str, str]:
    return {"endpoint": endpoint, "access_key_id": "bench", "secret_access_key": "bench-secret", "region": "us-east-1"}


async def _put(method: str, endpoint: str, key: str, mv: memoryview, part: int, conc: int) -> None:
    size = mv.nbytes
    if method == "asyncckpt":
        from asyncckpt.roots.objstore._client import ObjectStore

        st = ObjectStore(f"s3://{BUCKET}", _opts(endpoint), part_size=part, max_concurrency=conc)
        await st.put_file(key, mv, time.monotonic() + 3600)
    elif method == "obstore":
        import obstore
        from obstore.store import S3Store

        raw = S3Store(BUCKET, endpoint=endpoint, access_key_id="bench", secret_access_key="bench-secret",
                      region="us-east-1", unsigned_payload=True,
                      client_options={"allow_http": True, "timeout": "600s"})
        chunks = [mv[i : i + part] for i in range(0, size, part)]
        await obstore.put_async(raw, key, chunks, chunk_size=part, max_concurrency=conc, use_multipart=True)
    elif method == "aiobotocore":
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        cfg = AioConfig(request_checksum_calculation="when_required", response_checksum_validation="when_required",
                        max_pool_connections=conc, s3={"addressing_style": "path"})
        async with get_session().create_client("s3", endpoint_url=endpoint, aws_access_key_id="bench",
                                               aws_secret_access_key="bench-secret", region_name="us-east-1",
                                               config=cfg) as c:
            up = await c.create_multipart_upload(Bucket=BUCKET, Key=key)
            uid = up["UploadId"]
            sem = asyncio.Semaphore(conc)

            async def one(n: int, off: int) -> dict[str, Any]:
                async with sem:
                    r = await c.upload_part(Bucket=BUCKET, Key=key, UploadId=uid, PartNumber=n,
                                            Body=bytes(mv[off : off + part]))
                return {"PartNumber": n, "ETag": r["ETag"]}

            parts = await asyncio.gather(*(one(i + 1, off) for i, off in enumerate(range(0, size, part))))
            await c.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=uid, MultipartUpload={"Parts": parts})
    elif method == "s3fs":
        import s3fs

        fs = s3fs.S3FileSystem(key="bench", secret="bench-secret", asynchronous=True,
                               client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"},
                               max_concurrency=conc)
        session = await fs.set_session()
        try:
            await fs._pipe_file(f"{BUCKET}/{key}", bytes(mv), chunksize=part)
        finally:
            await session.close()
    else:
        raise ValueError(method)


async def _get(method: str, endpoint: str, key: str, out: memoryview, part: int, conc: int) -> None:
    size = out.nbytes
    sem = asyncio.Semaphore(conc)
    ranges = list(range(0, size, part))
    if method == "asyncckpt":
        from asyncckpt.roots.objstore._client import ObjectStore

        st = ObjectStore(f"s3://{BUCKET}", _opts(endpoint), part_size=part, max_concurrency=conc)
        await st.get_range_into(key, 0, out, time.monotonic() + 3600)
    elif method == "obstore":
        import obstore
        from obstore.store import S3Store

        raw = S3Store(BUCKET, endpoint=endpoint, access_key_id="bench", secret_access_key="bench-secret",
                      region="us-east-1", client_options={"allow_http": True, "timeout": "600s"})

        async def one(off: int) -> None:
            async with sem:
                b = await obstore.get_range_async(raw, key, start=off, length=min(part, size - off))
            out[off : off + len(memoryview(b))] = memoryview(b)

        await asyncio.gather(*(one(o) for o in ranges))
    elif method == "aiobotocore":
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        cfg = AioConfig(request_checksum_calculation="when_required", response_checksum_validation="when_required",
                        max_pool_connections=conc, s3={"addressing_style": "path"})
        async with get_session().create_client("s3", endpoint_url=endpoint, aws_access_key_id="bench",
                                               aws_secret_access_key="bench-secret", region_name="us-east-1",
                                               config=cfg) as c:

            async def one(off: int) -> None:
                n = min(part, size - off)
                async with sem:
                    r = await c.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={off}-{off + n - 1}")
                    pos = off
                    async for chunk in r["Body"].iter_chunks(MiB):
                        out[pos : pos + len(chunk)] = chunk
                        pos += len(chunk)

            await asyncio.gather(*(one(o) for o in ranges))
    elif method == "s3fs":
        import s3fs

        fs = s3fs.S3FileSystem(key="bench", secret="bench-secret", asynchronous=True,
                               client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"})
        session = await fs.set_session()
        try:

            async def one(off: int) -> None:
                n = min(part, size - off)
                async with sem:
                    b = await fs._cat_file(f"{BUCKET}/{key}", start=off, end=off + n)
                out[off : off + n] = b

            await asyncio.gather(*(one(o) for o in ranges))
        finally:
            await session.close()
    else:
        raise ValueError(method)


def worker(args: argparse.Namespace) -> None:
    import numpy as np

    from asyncckpt.format._checksum import crc32c

    size = args.size
    buf = bytearray(size)
    mv = memoryview(buf)
    rng = np.random.default_rng(args.seed)
    view = np.frombuffer(buf, dtype=np.uint8)
    for off in range(0, size, 64 * MiB):  # random, touched: every page resident before the case
        view[off : off + 64 * MiB] = rng.integers(0, 256, min(64 * MiB, size - off), dtype=np.uint8)
    expected = crc32c(mv)
    del rng
    _reset_peak_rss()  # the random fill's temporaries must not count as the case's peak
    base_rss = _status_kib("VmRSS")
    cpu0, t0 = _cpu_self(), time.perf_counter()
    if args.op == "put":
        asyncio.run(_put(args.method, args.endpoint, args.key, mv, args.part, args.concurrency))
    else:
        view[:] = 0  # the same (resident) buffer, cleared so the CRC check proves the read
        cpu0, t0 = _cpu_self(), time.perf_counter()
        asyncio.run(_get(args.method, args.endpoint, args.key, mv, args.part, args.concurrency))
    wall, cpu = time.perf_counter() - t0, _cpu_self() - cpu0
    ok = args.op == "put" or crc32c(mv) == args.expect_crc
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "extra_rss_mib": (_status_kib("VmHWM") - base_rss) / 1024,
                      "crc32c": expected, "ok": ok}))


# -- driver --------------------------------------------------------------------------------------


def _available(method: str) -> str | None:
    mod = {"asyncckpt": "obstore", "obstore": "obstore", "aiobotocore": "aiobotocore", "s3fs": "s3fs"}[method]
    try:
        __import__(mod)
    except ImportError as e:
        return f"not installed ({e})"
    return None


def _delete(endpoint: str, key: str) -> None:
    import obstore
    from obstore.store import S3Store

    raw = S3Store(BUCKET, endpoint=endpoint, access_key_id="bench", secret_access_key="bench-secret",
                  region="us-east-1", client_options={"allow_http": True})
    obstore.delete(raw, key)


def _case(args: argparse.Namespace, op: str, method: str, endpoint: str, key: str, server_pid: int,
          expect_crc: int = 0) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--op", op, "--method", method,
           "--endpoint", endpoint, "--key", key, "--size", str(args.size), "--part", str(args.part),
           "--concurrency", str(args.concurrency), "--expect-crc", str(expect_crc)]
    s0 = _cpu_of(server_pid)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=dict(os.environ, PYTHONPATH=REPO))
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.splitlines() if "Error" in ln] or p.stderr.strip().splitlines() or ["?"]
        return {"error": lines[-1][:300]}
    res: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    res["server_cpu_s"] = _cpu_of(server_pid) - s0
    res["mib_s"] = args.size / MiB / res["wall_s"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=parse_size("1G"))
    ap.add_argument("--part", type=parse_size, default=64 * MiB)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--methods", default=",".join(PUTS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--op", default="put", help=argparse.SUPPRESS)
    ap.add_argument("--method", default="", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    ap.add_argument("--key", default="", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--expect-crc", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    from s3server import S3Server

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    results: dict[str, Any] = {
        "size": args.size, "part": args.part, "concurrency": args.concurrency, "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_before": os.getloadavg()},
        "put": {}, "get": {}, "skipped": {},
    }
    with S3Server(volumes=64) as server:  # 16 GiB of capacity; each case's object is deleted after it
        server.create_bucket(BUCKET)
        assert server.proc is not None
        pid = server.proc.pid
        # warm-up: the first writes to a new bucket make the server allocate its volumes
        if _available("obstore") is None:
            _case(args, "put", "obstore", server.endpoint, "warm-up.bin", pid)
            _delete(server.endpoint, "warm-up.bin")
        ref_key, ref_crc = None, 0
        ready = []
        for m in methods:
            why = _available(m)
            if why:
                results["skipped"][m] = why
                print(f"skip {m}: {why}", flush=True)
            else:
                ready.append(m)
                results["put"][m] = []
        for r in range(args.repeats):  # interleaved, so drift of a shared machine hits every client
            for m in ready:
                key = f"put-{m}-{r}.bin"
                res = _case(args, "put", m, server.endpoint, key, pid)
                results["put"][m].append(res)
                print(f"put {m:12s} {json.dumps(res)}", flush=True)
                if "error" not in res and ref_key is None and m in ("asyncckpt", "obstore"):
                    ref_key, ref_crc = key, res["crc32c"]
                else:
                    _delete(server.endpoint, key)
        if ref_key is not None:
            _case(args, "get", "obstore", server.endpoint, ref_key, pid, ref_crc)  # warm-up read
            getters = [m for m in ready if m in GETS]
            for m in getters:
                results["get"][m] = []
            for _ in range(args.repeats):
                for m in getters:
                    res = _case(args, "get", m, server.endpoint, ref_key, pid, ref_crc)
                    results["get"][m].append(res)
                    print(f"get {m:12s} {json.dumps(res)}", flush=True)
    results["machine"]["load_after"] = os.getloadavg()
    out = args.out or os.path.join(HERE, "results", f"s3-{time.strftime('%Y-%m-%d')}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "s3_clients.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    print(f"wrote {os.path.join(out, 's3_clients.json')}")


def table(results: dict[str, Any]) -> str:
    def best(runs: list[dict[str, Any]], k: str) -> str:
        vals = [r[k] for r in runs if "error" not in r]
        return f"{min(vals):.2f}" if vals else "error"

    size = results["size"] / MiB
    lines = [f"{size:.0f} MiB, {results['part'] // MiB} MiB parts, {results['concurrency']} in flight "
             f"(best of {results['repeats']}; loopback, CPU-bound)",
             "| op | client | wall s | MiB/s | client CPU s | server CPU s | extra peak RSS MiB | check |",
             "|---|---|---|---|---|---|---|---|"]
    for op in ("put", "get"):
        for m, runs in results[op].items():
            ok = [r for r in runs if "error" not in r]
            if not ok:
                lines.append(f"| {op} | {m} | error: {runs[0].get('error', '')[:80]} | | | | | |")
                continue
            lines.append(f"| {op} | {m} | {best(ok, 'wall_s')} | {max(r['mib_s'] for r in ok):.0f} | "
                         f"{best(ok, 'cpu_s')} | {best(ok, 'server_cpu_s')} | {best(ok, 'extra_rss_mib')} | "
                         f"{'crc ok' if all(r['ok'] for r in ok) else 'MISMATCH'} |")
    for m, why in results["skipped"].items():
        lines.append(f"| - | {m} | skipped: {why} | | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
