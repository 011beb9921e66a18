"""The peer replica's push against a raw gloo send of the same bytes (issue 30).

Starts one process per simulated node (``--nodes``, ``--ranks-per-node``; ``ASYNCCKPT_NODE``),
each rank holding ``--size`` bytes as a file on ``--scratch`` (default ``/dev/shm``: the memory
tier's tmpfs). Alternating, ``--repeats`` times after a warm-up of each:

* ``raw``: every rank ``isend``s its bytes (already in a tensor) to its buddy and ``irecv``s
  its source's into a preallocated tensor (touched before), on a gloo group of its own: the
  transport's limit;
* ``raw-fresh``: the same into a tensor allocated for it (new memory, as any receiver that keeps
  the bytes needs: the page faults that ``raw`` leaves out);
* ``push``: ``Replicas.push`` of the file: read into one tensor, CRC-32C, sent with its
  description, received, checked, written into the receiver's directory, committed (fsync,
  rename), retention, and the closing store agreement;
* ``fetch``: every rank gets its files of that push back from its buddy (``Replicas.fetch``,
  ``need=True`` everywhere): the recovery of a replaced node, from the peer's memory.

``--pattern steady`` pushes as a training run does: ``push-crc`` only, one attempt, the step
increasing every round (``raw`` and ``raw-fresh`` beside it), so with ``keep >= 2`` every push after
the first ``keep`` lands in the oldest replica's recycled files. ``--phases`` adds, per rank and
round, where the push's time went (wrappers around the replica's functions: the sender's map,
posting, the receiver's open, each receive wait, its CRC, the commit's parts, the agreement).

Each figure is the slowest rank's, from a barrier to its end. Prints a table (medians, and
raw/push: the issue's ratio, target >= 0.8; fresh/push beside it) and writes ``results.json`` under ``--out``.

    python benchmarks/replica_push.py --sizes 64M,256M --repeats 5 --out /tmp/replica-bench
    python benchmarks/replica_push.py --pattern steady --phases --sizes 64M,256M --repeats 9
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's asyncckpt


def _parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


class _Phases:
    """Seconds spent in named functions of the replica (``--phases``), reset each round."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}
        self.rounds: list[dict[str, float]] = []

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.now[name] = self.now.get(name, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)

    def install(self) -> None:
        from asyncckpt.roots.replica import _held, _replicas, _wire

        for owner, attr, name in [
            (_replicas, "_open_files", "send: map files"),
            (_replicas, "send", "send: post"),
            (_replicas, "send_more", "send: trailer"),
            (_replicas, "finish", "send: wait"),
            (_replicas, "recv_desc", "recv: header wait"),
            (_held.HeldReplicas, "_recycle", "recv: recycle (rename)"),
            (_held.Incoming, "open", "recv: open+reserve+populate"),
            (_wire, "_wait", "recv: piece waits"),
            (_wire, "crc32c", "recv: CRC"),
            (_held.Incoming, "commit", "commit (all)"),
            (_held.os, "fsync", "commit: fsync files"),
            (_held, "_write", "commit: record"),
            (_held.Incoming, "_close", "commit: unmap/close"),
            (_held.DEFAULT_OPS, "fsync_dir", "commit: fsync dirs"),
            (_held.HeldReplicas, "retire", "commit: retention"),
            (_replicas.Replicas, "_agree", "agreement"),
            (_replicas.Replicas, "push", "push (all)"),
        ]:
            self.wrap(owner, attr, name)

    def take(self) -> dict[str, float]:
        out, self.now = self.now, {}
        return out


def rank_main(args: argparse.Namespace) -> None:
    import crc32c
    import torch
    import torch.distributed as dist

    from asyncckpt.ranks._distributed import resolve
    from asyncckpt.ranks._nodes import discover
    from asyncckpt.roots.replica import Replicas, buddy_of, sources_of

    rank, world = args.rank, args.world
    phases = _Phases()
    if args.phases:
        phases.install()
    os.environ["ASYNCCKPT_NODE"] = f"node{rank // args.ranks_per_node}"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))  # fmt: skip
    ctx = resolve(None, 300)
    assert ctx is not None
    nodes = discover(ctx, "bench", 60)
    raw_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=300))
    node_dir = os.path.join(args.scratch, os.environ["ASYNCCKPT_NODE"])
    rep = Replicas(ctx, nodes, os.path.join(node_dir, "replicas"), keep=args.keep, timeout=300)
    buddy, (source,) = buddy_of(nodes, rank), sources_of(nodes, rank)
    assert buddy is not None
    out: dict[str, Any] = {}
    for size in args.sizes:
        path = os.path.join(node_dir, f"own-{rank}")
        with open(path, "wb") as f:
            f.write(os.urandom(1 << 20) * (size >> 20) + os.urandom(size % (1 << 20)))
        mine = torch.empty(size, dtype=torch.uint8)
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(mine.numpy()))
        theirs = torch.empty(size, dtype=torch.uint8)
        crc = crc32c.crc32c(memoryview(mine.numpy()))  # what a save's writer computed already
        names = ("raw", "raw-fresh", "push-crc") if args.pattern == "steady" else (
            "raw", "raw-fresh", "push", "push-crc", "fetch")  # fmt: skip
        times: dict[str, list[float]] = {n: [] for n in names}
        spent: list[dict[str, float]] = []
        recycled = 0
        counts: dict[str, int] = {}

        def raw(mine: torch.Tensor = mine, theirs: torch.Tensor | None = theirs) -> None:
            if theirs is None:
                theirs = torch.empty(mine.numel(), dtype=torch.uint8)
            r = dist.irecv(theirs, group=raw_group, group_src=source)
            s = dist.isend(mine, group=raw_group, group_dst=buddy)
            s.wait()
            r.wait()

        # steady: until the oldest (keep >= 2) or the spare (keep 1: from the second commit on) is recycled
        warm = max(args.keep, 2) if args.pattern == "steady" else 1
        for i in range(args.repeats + warm):
            step = (len(out) * 1000 + i) if args.pattern == "steady" else i
            for name in names:
                dist.barrier()
                t0 = time.perf_counter()
                if name == "raw":
                    raw()
                elif name == "raw-fresh":
                    raw(theirs=None)
                elif name == "push":
                    before = rep.counts.as_json()
                    rep.push(step, f"bench-{size}", {f"rank{rank:05d}.data": path})
                    counts = {k: v - before[k] for k, v in rep.counts.as_json().items()}
                elif name == "push-crc":  # as a save pushes: its files' CRCs known from their writing
                    phases.take()
                    old = {os.stat(os.path.join(d, n)).st_ino  # every file held before: steps and spares
                           for s in rep.sources for d, _, ns in os.walk(rep.held_here.source_dir(s))
                           for n in ns if n.endswith(".data")}  # fmt: skip
                    before = rep.counts.as_json()
                    rep.push(step, f"bench-crc-{size}", {f"rank{rank:05d}.data": path}, {f"rank{rank:05d}.data": crc})
                    counts = {k: v - before[k] for k, v in rep.counts.as_json().items()}
                    new = {os.stat(os.path.join(rep.held_here.source_dir(s), f"step_{step:08d}",
                                                f"rank{s:05d}.data")).st_ino for s in rep.sources}  # fmt: skip
                    if i >= warm:
                        spent.append(phases.take())
                        recycled += bool(new & old)
                else:
                    got = rep.fetch(step, f"bench-crc-{size}", need=True)
                    assert got is not None and len(got[f"rank{rank:05d}.data"]) == size
                    del got
                took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if i >= warm:  # the first rounds are the warm-up
                    times[name].append(float(took))
        every = [None] * world
        dist.all_gather_object(every, {"phases": spent, "recycled": recycled})
        out[str(size)] = {"times": times, "counts": counts, "ranks": every}
        os.unlink(path)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(out, f)
    dist.barrier()
    os._exit(0)


def _phase_medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({k for r in rounds for k in r})
    return {k: _median([r.get(k, 0.0) for r in rounds]) for k in names}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64M,256M")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--keep", type=int, default=2, help="replicas kept per source (>= 2: the oldest's memory is reused)")
    p.add_argument("--pattern", choices=("mixed", "steady"), default="mixed",
                   help="steady: push-crc alone, one attempt, increasing steps (as a training run pushes)")
    p.add_argument("--phases", action="store_true", help="time the push's phases (per rank, medians)")
    p.add_argument("--scratch", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    p.add_argument("--out", default="bench-results/replica")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        args.sizes = [int(s) for s in args.sizes.split(",")]
        rank_main(args)
        return
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    world = args.nodes * args.ranks_per_node
    os.makedirs(args.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="replica-bench-", dir=args.scratch)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = os.path.join(args.out, "ranks.json")
    common = ["--sizes", ",".join(map(str, sizes)), "--repeats", str(args.repeats), "--nodes", str(args.nodes),
              "--ranks-per-node", str(args.ranks_per_node), "--keep", str(args.keep), "--scratch", scratch,
              "--pattern", args.pattern, *(["--phases"] if args.phases else []),
              "--port", str(port), "--world", str(world), "--result", result]  # fmt: skip
    try:
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), *common]) for r in range(world)]
        codes = [pr.wait() for pr in procs]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")
    with open(result) as f:
        got = json.load(f)
    rows = []
    head = (f"{'size':>8} {'raw s':>7} {'fresh s':>8} {'push s':>7} {'push-crc s':>10} {'GB/s':>6} "
            f"{'raw/push-crc':>12} {'fresh/push-crc':>14} {'fetch s':>8}")  # fmt: skip
    print(f"{head}  messages, bytes besides the files a rank sends; recycled pushes")
    for size in sizes:
        t = got[str(size)]["times"]
        med = {k: _median(v) for k, v in t.items()}
        raw, fresh, pcrc = med["raw"], med["raw-fresh"], med["push-crc"]
        push, fetch = med.get("push", float("nan")), med.get("fetch", float("nan"))
        c = got[str(size)]["counts"]
        ranks = got[str(size)]["ranks"]
        rows.append({"size": size, "raw_s": raw, "raw_fresh_s": fresh, "push_s": push, "raw_over_push": raw / push,
                     "fresh_over_push": fresh / push, "push_crc_s": pcrc, "raw_over_push_crc": raw / pcrc,
                     "fresh_over_push_crc": fresh / pcrc, "fetch_s": fetch, "counts": c, "samples": t,
                     "recycled": [r["recycled"] for r in ranks],
                     "phases": [_phase_medians(r["phases"]) for r in ranks]})  # fmt: skip
        print(f"{size >> 20:>7}M {raw:>7.3f} {fresh:>8.3f} {push:>7.3f} {pcrc:>10.3f} {size / pcrc / 1e9:>6.2f} "
              f"{raw / pcrc:>12.2f} {fresh / pcrc:>14.2f} {fetch:>8.3f}  {c['sent_messages']}, "
              f"{c['sent_bytes'] - size}; {rows[-1]['recycled']} of {args.repeats}")  # fmt: skip
        for r, ph in enumerate(rows[-1]["phases"]):
            if ph:
                print(f"{'':>8} rank {r} push-crc phases (medians, ms): "
                      + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in ph.items()))
    doc = {"host": platform.node(), "cpus": os.cpu_count(), "nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
           "keep": args.keep, "pattern": args.pattern,
           "scratch": args.scratch, "repeats": args.repeats, "rows": rows}  # fmt: skip
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'results.json')}")


if __name__ == "__main__":
    main()
