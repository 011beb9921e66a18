"""Resharded load, side by side: a state saved on 4 gloo ranks loaded on 2, against the raw
read of the same bytes and against ``torch.distributed.checkpoint.load``.

    python benchmarks/reshard_load.py --mib 256 --repeats 5 --out benchmarks/results/<dir>

An FSDP2 model of ``--mib`` MiB of fp32 parameters (square ``Linear`` layers, no bias) is
saved once on 4 gloo ranks by asyncckpt and once by ``dcp.save``. Then 2 gloo ranks take
fresh FSDP2 targets (another seed) and, round-robin so that a noisy neighbour hits every
variant alike, time each variant cold (page cache dropped: ``drop_caches`` as root, else
``posix_fadvise(DONTNEED)`` on every file of both checkpoints) and warm (right after the same
variant ran). One sample is barrier to barrier: the slower rank's time.

* ``raw read x1`` / ``x4``: every rank ``preadv``s exactly the byte ranges of the asyncckpt
  files its shard needs (from the index), 4 MiB calls, into one preallocated buffer, from 1
  or 4 threads; the faster of the two (by median, per column) is the limit, measured in the
  same run;
* ``asyncckpt load(into=)``: ``Checkpointer.load(into={"model": msd})`` (verified, the
  default: one pass straight into the targets, each block's CRC checked as it lands);
* ``asyncckpt load(into=, verify=False)``: one pass, no checksum;
* ``asyncckpt load(into=, verify_first=True)``: two passes: the first checks every needed
  block, the second reads into the targets once every rank agreed (a corrupt chunk leaves
  every target untouched);
* ``dcp.load``: ``torch.distributed.checkpoint.load`` of the DCP checkpoint into the same
  kind of targets.

The verified load's phases are timed separately (rank 0) as its profile. Prints a
markdown table with the target (resharded load >= 0.8x the raw read, issue 11) and its
verdict, and writes ``results.json`` and ``results.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (HERE, REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

TARGET = 0.8
VARIANTS = (
    "raw read x1",
    "raw read x4",
    "asyncckpt load(into=)",
    "asyncckpt load(into=, verify=False)",
    "asyncckpt load(into=, verify_first=True)",
    "dcp.load",
)


# ---------------------------------------------------------------------- the ranks
def _model(mib: int, seed: int) -> Any:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    width = 1024
    layers = max(1, (mib << 20) // (width * width * 4))
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed * 1000 + int(os.environ["RANK"]))
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().copy_(torch.randn(p.to_local().shape, generator=g))
    return model


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )


def rank_save(rank: int, port: int, mib: int, root: str, dcp_dir: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import asyncckpt

    _init(rank, 4, port)
    model = _model(mib, seed=1)
    msd = get_state_dict(model, [])[0]
    with asyncckpt.Checkpointer(root) as ck:
        ck.save(1, {"model": msd}).result(timeout=600)
    dcp.save({"model": msd}, checkpoint_id=dcp_dir)
    dist.barrier()
    return {}


def _needed_ranges(root: str, msd: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(file, first byte, length) of every copy this rank's shards need, as the loader plans them."""
    from asyncckpt.format import _index
    from asyncckpt.format._reshard import plan_reads
    from asyncckpt.loading._load_global import targets_of
    from asyncckpt.roots.posix._discovery import read_manifest

    step_dir = os.path.join(root, "step_00000001")
    manifest = read_manifest(step_dir)
    with open(os.path.join(step_dir, _index.INDEX), "rb") as f:
        index = _index.parse(f.read(), manifest.world_size, {e.name: e.size for e in manifest.files})
    out = []
    for name, (info, _) in targets_of({"model": msd}, ()).items():
        meta = index["tensors"][name]
        if info.box is None or info.box.empty:
            continue
        for cr in plan_reads(meta["chunks"], info.box, info.local.element_size()):
            out.extend((os.path.join(step_dir, cr.chunk.file), r.src, r.length) for r in cr.copies())
    return out


def _raw_read(ranges: list[tuple[str, int, int]], buf: memoryview, threads: int = 4, piece: int = 4 << 20) -> None:
    """``preadv`` every range into ``buf`` (back to back), ``threads`` threads over pieces."""
    fds = {f: os.open(f, os.O_RDONLY) for f in {r[0] for r in ranges}}
    jobs, at = [], 0
    for f, src, n in ranges:
        for i in range(0, n, piece):
            k = min(piece, n - i)
            jobs.append((fds[f], src + i, at + i, k))
        at += n
    per = -(-len(jobs) // threads)

    def one(part: list[tuple[int, int, int, int]]) -> None:
        for fd, src, dst, k in part:
            pos = 0
            while pos < k:
                got = os.preadv(fd, [buf[dst + pos : dst + k]], src + pos)
                if got <= 0:
                    raise OSError("short read")
                pos += got

    ts = [threading.Thread(target=one, args=(jobs[i * per : (i + 1) * per],)) for i in range(threads)]
    try:
        for t in ts:
            t.start()
    finally:
        for t in ts:
            t.join()
        for fd in fds.values():
            os.close(fd)


def _drop_cache(dirs: list[str]) -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        from measure import drop_cache

        drop_cache(dirs)
        return "fadvise"


def rank_load(rank: int, port: int, mib: int, root: str, dcp_dir: str, repeats: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import asyncckpt
    from asyncckpt.loading import _load_global

    _init(rank, 2, port)
    model = _model(mib, seed=2)
    msd = get_state_dict(model, [])[0]
    ranges = _needed_ranges(root, msd)
    nbytes = sum(r[2] for r in ranges)
    local = sum(v.to_local().numel() * v.to_local().element_size() for v in msd.values())
    buf = memoryview(bytearray(nbytes))
    # the verified load's profile: its phases, timed where they run (rank 0, that variant only)
    from asyncckpt.loading import _resume
    from asyncckpt.ranks import _agree

    phases: dict[str, list[float]] = {}
    profiling = {"on": False}

    def timed(owner: Any, attr: str, key: str) -> None:
        fn = getattr(owner, attr)
        phases[key] = []

        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if profiling["on"]:
                    phases[key].append(time.perf_counter() - t0)

        setattr(owner, attr, wrapper)

    timed(_load_global, "_load", "plan: manifest, index, trees, targets")
    timed(_load_global._Plan, "run_first", "read + check the needed blocks (into the targets)")
    timed(_agree, "agree", "agreement of the ranks (c10d store)")
    timed(_load_global._Plan, "run_second", "after the read: non-contiguous targets' copies")
    timed(_resume, "attempt", "attempt total (pin, plan, read)")
    ck = asyncckpt.Checkpointer(root)

    fns = {
        "raw read x1": lambda: _raw_read(ranges, buf, threads=1),
        "raw read x4": lambda: _raw_read(ranges, buf, threads=4),
        "asyncckpt load(into=)": lambda: ck.load(1, into={"model": msd}),
        "asyncckpt load(into=, verify=False)": lambda: ck.load(1, into={"model": msd}, verify=False),
        "asyncckpt load(into=, verify_first=True)": lambda: ck.load(1, into={"model": msd}, verify_first=True),
        "dcp.load": lambda: dcp.load({"model": msd}, checkpoint_id=dcp_dir),
    }
    times: dict[str, dict[str, list[float]]] = {v: {"cold": [], "warm": []} for v in VARIANTS}
    how = ""
    for fn in fns.values():
        fn()  # warm-up: imports, allocator, thread pools
    for mode in ("cold", "warm"):
        for _ in range(repeats):
            for name in VARIANTS:
                if mode == "cold":
                    dist.barrier()
                    if rank == 0:
                        how = _drop_cache([root, dcp_dir])
                else:
                    fns[name]()
                dist.barrier()
                profiling["on"] = name == "asyncckpt load(into=)" and rank == 0
                t0 = time.perf_counter()
                fns[name]()
                dist.barrier()
                times[name][mode].append(time.perf_counter() - t0)
                profiling["on"] = False
                if rank == 0:
                    print(f"{mode} {name}: {times[name][mode][-1]:.3f} s", file=sys.stderr, flush=True)
    # peak extra memory of one cold verified load and of one cold dcp.load (rank 0's process)
    from measure import PeakMemory

    rss = {}
    for name in ("asyncckpt load(into=)", "dcp.load"):
        dist.barrier()
        if rank == 0:
            _drop_cache([root, dcp_dir])
        dist.barrier()
        with PeakMemory() as pm:
            fns[name]()
        rss[name] = pm.extra_bytes
    # correctness: after the last load the targets hold the saved values (vs DCP's load)
    ck.load(1, into={"model": msd})
    mine = {k: v.to_local().clone() for k, v in msd.items()}
    dcp.load({"model": msd}, checkpoint_id=dcp_dir)
    equal = all(torch.equal(mine[k], v.to_local()) for k, v in msd.items())
    ck.close()
    return {
        "needed_bytes": nbytes,
        "local_bytes": local,
        "ranges": len(ranges),
        "times": times,
        "phases": phases,
        "drop": how,
        "peak_extra_rss": rss,
        "bit_equal_to_dcp_load": equal,
    }


def _rank_main() -> int:
    role, rank, port, mib, root, dcp_dir, repeats, out = sys.argv[2:10]
    try:
        if role == "save":
            res = rank_save(int(rank), int(port), int(mib), root, dcp_dir)
        else:
            res = rank_load(int(rank), int(port), int(mib), root, dcp_dir, int(repeats))
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        import traceback

        res = {"crash": "".join(traceback.format_exception(e))}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(res, f)
    os._exit(0)


# ---------------------------------------------------------------------- the driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(role: str, world: int, args: list[str], out: str, deadline_s: float) -> list[dict[str, Any]]:
    port = str(_free_port())
    procs = [
        subprocess.Popen([sys.executable, __file__, "--rank", role, str(r), port, *args, out]) for r in range(world)
    ]
    end = time.monotonic() + deadline_s
    for p in procs:
        try:
            p.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{role} ranks still running after {deadline_s:.0f} s") from None
    res = []
    for r in range(world):
        with open(f"{out}.{r}.json") as f:
            got = json.load(f)
        if "crash" in got:
            raise RuntimeError(f"{role} rank {r} failed:\n{got['crash']}")
        res.append(got)
    return res


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def run(mib: int, repeats: int, scratch: str) -> dict[str, Any]:
    import torch

    from asyncckpt.format import _index
    from asyncckpt.loading import _readinto

    root, dcp_dir, out = (os.path.join(scratch, n) for n in ("ack", "dcp", "res"))
    common = [str(mib), root, dcp_dir, str(repeats)]
    t0 = time.perf_counter()
    _spawn("save", 4, common, out, 900)
    save_s = time.perf_counter() - t0
    ranks = _spawn("load", 2, common, out, 1800)
    with open(os.path.join(root, "step_00000001", "index.json")) as f:
        block = json.load(f).get("block")
    times: dict[str, dict[str, Any]] = {}
    for name in VARIANTS:
        times[name] = {}
        for mode in ("cold", "warm"):
            # barrier to barrier: every rank measured the same interval; rank 0's is the record
            xs = ranks[0]["times"][name][mode]
            times[name][mode] = {"median": statistics.median(xs), "samples": xs}
    phases = {}
    for key, xs in ranks[0]["phases"].items():
        # one sample per verified load, the cold ones first (a phase called once per load)
        phases[key] = {"cold": statistics.median(xs[:repeats]), "warm": statistics.median(xs[repeats:])}
    return {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "loadavg_at_end": os.getloadavg(),
        },
        "state": {
            "mib": mib,
            "asyncckpt_bytes": _du(root),
            "dcp_bytes": _du(dcp_dir),
            "needed_bytes_per_rank": [r["needed_bytes"] for r in ranks],
            "local_bytes_per_rank": [r["local_bytes"] for r in ranks],
            "copies_per_rank": [r["ranges"] for r in ranks],
        },
        "save_on_4_s": save_s,
        "repeats": repeats,
        "block_bytes": block,
        "default_block_bytes": _index.BLOCK,
        "threads": _readinto.THREADS,
        "bounce_bytes": _readinto.BOUNCE,
        "cache_drop": ranks[0]["drop"],
        "times": times,
        "profile_rank0": phases,
        "bit_equal_to_dcp_load": all(r["bit_equal_to_dcp_load"] for r in ranks),
        "peak_extra_rss_rank0": ranks[0]["peak_extra_rss"],
    }


def report(r: dict[str, Any]) -> str:
    t = r["times"]
    nbytes = max(r["state"]["needed_bytes_per_rank"])

    def med(name: str, mode: str) -> float:
        return float(t[name][mode]["median"])

    m = r["machine"]
    lines = [
        f"# Resharded load 4 -> 2 ranks, FSDP2 model of {r['state']['mib']} MiB, median of {r['repeats']}",
        "",
        f"{m['platform']}, {m['cpus']} CPUs, torch {m['torch']}, {m['when']}, load average at the end "
        f"{m['loadavg_at_end'][0]:.1f}; asyncckpt: {r['threads']} I/O threads, "
        f"{r['bounce_bytes'] >> 20} MiB bounce buffers, {r['block_bytes'] >> 10} KiB block CRCs; "
        f"cold = {r['cache_drop']}; each rank needs {nbytes / 2**20:.0f} MiB; "
        f"asyncckpt targets bit-equal to dcp.load's: {r['bit_equal_to_dcp_load']}",
        "",
        "The limit (raw) is the faster of the two raw reads, per column.",
        "",
        "| variant | cold s | cold GB/s per rank | cold vs raw | warm s | warm GB/s per rank | warm vs raw |",
        "|---|---|---|---|---|---|---|",
    ]
    raw = {mode: min(med("raw read x1", mode), med("raw read x4", mode)) for mode in ("cold", "warm")}
    for name in t:
        c, w = med(name, "cold"), med(name, "warm")
        lines.append(
            f"| {name} | {c:.3f} | {nbytes / c / 1e9:.2f} | {raw['cold'] / c:.2f}x | "
            f"{w:.3f} | {nbytes / w / 1e9:.2f} | {raw['warm'] / w:.2f}x |"
        )
    a = "asyncckpt load(into=)"
    lines += ["", "| target (issue 11) | measured | verdict |", "|---|---|---|"]
    for mode in ("cold", "warm"):
        ratio = raw[mode] / med(a, mode)
        verdict = "met" if ratio >= TARGET else "missed"
        lines.append(f"| resharded load ({mode}, verified) >= {TARGET}x raw read | {ratio:.2f}x | {verdict} |")
    for mode in ("cold", "warm"):
        lines.append(f"| vs dcp.load ({mode}) | {med('dcp.load', mode) / med(a, mode):.2f}x faster | |")
    lines += ["", "| peak extra RSS, one cold load (rank 0) | MiB |", "|---|---|"]
    for name, b in r["peak_extra_rss_rank0"].items():
        lines.append(f"| {name} | {b / 2**20:.1f} |")
    lines += ["", "Profile of the verified load (rank 0, median s):", "", "| phase | cold | warm |", "|---|---|---|"]
    for key, d in r["profile_rank0"].items():
        lines.append(f"| {key} | {d['cold']:.3f} | {d['warm']:.3f} |")
    prof = r["profile_rank0"]
    # one pass: "attempt total" holds the plan, the read and the copies after it; add the agreement
    known = ("attempt total (pin, plan, read)", "agreement of the ranks (c10d store)")
    rest = {mode: med(a, mode) - sum(prof[k][mode] for k in known) for mode in ("cold", "warm")}
    lines.append(f"| rest: the leader's step choice, closing barrier | {rest['cold']:.3f} | {rest['warm']:.3f} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank"]:
        return _rank_main()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="MiB of fp32 parameters (default 256)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(REPO, "bench-results", "reshard_load"))
    ap.add_argument("--scratch", default=None)
    args = ap.parse_args(argv)
    if args.repeats < 5:
        ap.error("--repeats must be >= 5")
    scratch = args.scratch or tempfile.mkdtemp(prefix="asyncckpt-reshard-")
    os.makedirs(args.out, exist_ok=True)
    try:
        result = run(args.mib, args.repeats, scratch)
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    md = report(result)
    print(md)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
