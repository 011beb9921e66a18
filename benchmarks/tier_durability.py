"""Time to local-disk and to persistent durability: node-local tiers against tier mode, ``s3://`` and POSIX roots.

    sudo python benchmarks/tier_durability.py [--mib 128] [--rounds 3] [--out DIR]
    sudo python benchmarks/tier_durability.py --quick          # 8 MiB a rank, 1 round (a smoke run)

Issue 30's benchmark "time to local-disk durability and to persistent durability against today's
``mirror=`` and ``s3://`` modes". In one run, on one SeaweedFS on loopback (tests/support), 4 ranks
(gloo), each saving the same state of ``--mib`` MiB (4 float32 tensors, different on every rank),
``--rounds`` times in a rotating order (medians, min-max), each case its own 4 fresh processes:

- ``node-local``: ``Checkpointer(root, node_local=True, mirror="s3://...")``, 2 simulated nodes x
  2 ranks (the tests' mount namespaces: each node's own directory bind-mounted at ``root``; needs
  root), every save to both tiers: *local* = every rank's ``handle.result()`` returned (every
  node's part durable and committed on its disk, the nodes' agreement recorded on each);
  *persistent* = every rank's ``flush()`` returned (the step's manifest object created on the store
  after every rank uploaded its own files);
- ``tier``: today's tier mode on a shared root, ``Checkpointer(shared, mirror="s3://...")``:
  *local* as above (the shared root's commit), *persistent* = ``flush()`` (rank 0 uploads every
  rank's files; the other ranks' ``flush()`` does not wait for uploads, so the slowest is rank 0's);
- ``s3``: ``Checkpointer("s3://...")``: *local* = *persistent* = ``handle.result()`` (the commit);
- ``posix``: ``Checkpointer(shared)``, a plain shared POSIX root (context): ``handle.result()``;
- ``raw-direct``: 4 processes at once, each writing the same number of bytes with ``O_DIRECT``
  (16 MiB calls from a page-aligned buffer) to a new file on the disk the roots are on, ``fsync``
  of the file and its directory: the local durability limit;
- ``raw-put``: 4 processes at once, each a multipart PUT of the same number of bytes to the same
  store with the client asyncckpt uses (obstore; ``s3_direct.raw_put``: 64 MiB parts, 8 in
  flight), after one uncounted PUT of them: the persistent durability limit.

Each Checkpointer first takes one save that is not counted (staging buffer, store probes); then,
after a barrier, the timed save. A figure runs from the earliest rank's ``save()`` call (or raw
start) to the slowest rank's return (one clock: ``CLOCK_MONOTONIC`` is system-wide). What the API
does not show: the moment the manifest object is created (``flush()`` returns after the round's
verdict reached the rank) and when each node's disk commit happened (``result()`` returns once rank
0 knows every node acknowledged). Loopback has no link: the store's times are client + server CPU
on this machine, so the table also gives the store server's CPU seconds over each case, and each
case's slowest rank's ``SaveStatistics`` (slot wait, staging, prepare) are kept in ``results.json``.
Prints a table and writes ``results.json`` and ``results.md`` to ``--out`` (``--keep-logs``: every
rank's INFO log under ``OUT/logs/``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
PATHS = [str(HERE), str(HERE / "benchmarks"), str(HERE / "tests"), str(HERE / "tests" / "support")]
sys.path[:0] = PATHS

BUCKET = "tier-durability"
CASES = ("node-local", "tier", "s3", "posix", "raw-direct", "raw-put")
NODES = ("a", "a", "b", "b")  # rank -> simulated node

RAW = r"""
import json, mmap, os, sys, time, torch
kind, target, mib, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
n = mib << 20
buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # page-aligned: O_DIRECT
torch.frombuffer(buf, dtype=torch.float32).uniform_()  # incompressible, touched
view = memoryview(buf)
if kind == "put":
    import asyncio
    from obstore.store import S3Store
    from s3_direct import raw_put
    cfg = json.loads(os.environ["S3OPTS"])
    store = S3Store(os.environ["BUCKET"], config=dict(cfg, unsigned_payload="true"),
                    client_options={"allow_http": True})
    asyncio.run(raw_put(store, target + ".warm", view))  # not counted: the connection, the first requests
open(go + ".ready." + os.path.basename(target), "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
t0 = time.monotonic()
if kind == "put":
    asyncio.run(raw_put(store, target, view))
else:
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    pos = 0
    while pos < n:
        pos += os.write(fd, view[pos:pos + (16 << 20)])
    os.fsync(fd)
    os.close(fd)
    d = os.open(os.path.dirname(target), os.O_RDONLY)
    os.fsync(d)
    os.close(d)
print(json.dumps({"t0": t0, "t1": time.monotonic()}))
"""


# ---------------------------------------------------------------------------------------- a rank
def _state(rank: int, mib: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    return {"model": {f"w{i}": torch.rand(mib << 16, generator=g) for i in range(4)}, "rank": rank}


def rank_main(case: str, rank: int, world: int, port: str, root: str, out: str) -> None:
    """One rank of ``case``: construct, one uncounted save, a barrier, the timed save; its times
    (``CLOCK_MONOTONIC``) go to ``out.<rank>.json``. Nothing but the standard library is imported
    before the node's mount namespace is entered (a namespace is per thread)."""
    if case == "node-local":
        from _rank_worker import enter_node

        enter_node(os.environ["NODE_DIRS"].split(":")[rank], root)
    os.environ["ASYNCCKPT_NODE"] = NODES[rank]
    import logging

    from _ranks import run_scenario

    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(threadName)s %(levelname)s %(message)s")

    def scenario(res: dict[str, Any]) -> None:
        import torch.distributed as dist

        from asyncckpt import Checkpointer

        timeout = float(os.environ.get("CK_TIMEOUT", "300"))
        opts = json.loads(os.environ["S3OPTS"])
        url = os.environ["URL"]
        kw: dict[str, Any] = {"timeout": timeout}
        if case == "node-local":
            ck = Checkpointer(root, node_local=True, mirror=url, storage_options=opts, **kw)
        elif case == "tier":
            ck = Checkpointer(root, mirror=url, storage_options=opts, **kw)
        elif case == "s3":
            ck = Checkpointer(url, storage_options=opts, **kw)
        else:
            ck = Checkpointer(root, **kw)
        state = _state(rank, int(os.environ["MIB"]))
        ck.save(1, state).result(timeout)  # not counted: the staging buffer, the store's first requests
        ck.flush(timeout)
        dist.barrier()
        t0 = time.monotonic()
        handle = ck.save(2, state)
        t_block = time.monotonic()
        info = handle.result(timeout)
        t_local = time.monotonic()
        ck.flush(timeout)
        t_persist = time.monotonic()
        assert ck.upload_states() == {}, ck.upload_states()
        res.update(t0=t0, t_block=t_block, t_local=t_local, t_persist=t_persist, tier=info.tier,
                   stats={k: getattr(info.statistics, k) for k in ("wait_s", "staging_s", "prepare_s", "write_s",
                                                                    "fsync_s", "commit_s")})  # fmt: skip
        ck.close(timeout)
        dist.barrier()  # rank 0 hosts the c10d store: nobody leaves before every rank closed

    run_scenario(rank, world, port, out, scenario, timeout_s=120)


# ---------------------------------------------------------------------------------------- the driver
def _ranks(case: str, tmp: Path, env: dict[str, str], tag: str, keep: Path | None) -> dict[str, float]:
    """One case's 4 ranks: local, persistent and blocking seconds (earliest call to slowest return);
    their logs copied under ``keep`` when given."""
    from _ranks import free_port, rank_results, run_ranks

    logs = tmp / f"logs-{tag}"
    logs.mkdir()
    out = tmp / f"{tag}-result"
    nodes = [tmp / f"node{n}-{tag}" for n in ("A", "B")]
    root = tmp / "ck" if case == "node-local" else tmp / f"shared-{tag}"
    for d in (*nodes, root):
        d.mkdir(exist_ok=True)
    port = free_port()
    env = dict(env, NODE_DIRS=":".join(str(nodes[0 if n == "a" else 1]) for n in NODES))
    try:
        hung = run_ranks(lambda r: [__file__, "--rank", case, str(r), "4", str(port), str(root), str(out)], 4, logs,
                         900, extra_env=env)  # fmt: skip
        res = rank_results(out, logs, hung, 4)
    finally:
        if keep is not None:
            shutil.copytree(logs, keep / tag)
        for d in (*nodes, *([] if case == "node-local" else [root])):
            shutil.rmtree(d, ignore_errors=True)
    assert case != "node-local" or os.listdir(root) == [], "a node's mount leaked out of its namespace"
    t0 = min(r["t0"] for r in res.values())
    upload = re.findall(r"uploaded step 2 .* in ([0-9.]+)s", (logs / "rank0.log").read_text(errors="replace"))
    extra = {"upload round": float(upload[0])} if upload else {}
    return {**extra, "local": max(r["t_local"] for r in res.values()) - t0,
            "persistent": max(r["t_persist"] for r in res.values()) - t0,
            "blocking": max(r["t_block"] - r["t0"] for r in res.values()),
            # where save()'s blocking went on its slowest rank (SaveStatistics)
            **{f"max {k}": max(r["stats"][k] for r in res.values()) for k in ("wait_s", "staging_s", "prepare_s")}}


def _raw(kind: str, tmp: Path, env: dict[str, str], tag: str, mib: int) -> float:
    """4 processes at once (after each filled its buffer): earliest start to slowest end."""
    go = tmp / f"go-{tag}"
    disk = [tmp / f"raw{n}-{tag}" for n in ("A", "B")]
    for d in disk:
        d.mkdir()
    targets = ([f"raw/{tag}/rank{r}" for r in range(4)] if kind == "put"
               else [str(disk[0 if n == "a" else 1] / f"rank{r}") for r, n in enumerate(NODES)])  # fmt: skip
    penv = dict(os.environ, **env, PYTHONPATH=os.pathsep.join(PATHS))
    procs = [subprocess.Popen([sys.executable, "-c", RAW, kind, t, str(mib), str(go)], stdout=subprocess.PIPE,
                              text=True, env=penv) for t in targets]  # fmt: skip
    try:
        end = time.monotonic() + 300
        while len([p for p in tmp.iterdir() if p.name.startswith(go.name + ".ready.")]) < 4:
            assert time.monotonic() < end and all(p.poll() is None for p in procs), "a raw process did not start"
            time.sleep(0.01)
        go.touch()
        outs = [p.communicate(timeout=600)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for d in disk:
            shutil.rmtree(d, ignore_errors=True)
        for p in tmp.iterdir():
            if p.name.startswith(go.name):
                p.unlink()
    times = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    return max(t["t1"] for t in times) - min(t["t0"] for t in times)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its waited-for children so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _fmt(v: list[float]) -> str:
    return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"


def report(data: dict[str, Any]) -> str:
    """The markdown table of ``data`` (what ``results.json`` holds): medians (min-max) in seconds,
    each figure over its limit (the raw O_DIRECT write for local, the raw PUT for persistent), and
    the upload round of the modes with ``mirror=`` (rank 0's log: from the local commit handed to
    the upload to the round's outcome, i.e. persistent minus local, less the hand-over), and the
    store server's CPU seconds over the case (its uncounted save and its timed one: two uploads of
    the same bytes in every case that reaches the store)."""
    t = data["times"]
    raw_d, raw_p = statistics.median(t["raw-direct"]["local"]), statistics.median(t["raw-put"]["persistent"])
    lines = [f"# Time to local and to persistent durability: 4 ranks ({data['layout']}), {data['mib']} MiB a rank, "
             f"{data['rounds']} rounds (load average {data['load_avg'][0]:.1f} at the end)", "",
             "| mode | `save()` blocking (s) | local durable (s) | / raw O_DIRECT | persistent durable (s) | / raw PUT "
             "| upload round (s) | store server CPU (s) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    names = {"node-local": "node-local disks + `s3://` (`node_local=True, mirror=`)",
             "tier": "tier mode, shared root (`mirror=`)", "s3": "`s3://` root", "posix": "shared POSIX root",
             "raw-direct": "raw O_DIRECT write + fsync, 4 at once", "raw-put": "raw multipart PUT (obstore), 4 at once"}
    for case in CASES:
        v = t[case]
        blk = _fmt(v["blocking"]) if "blocking" in v else "-"
        loc = f"{_fmt(v['local'])} | {statistics.median(v['local']) / raw_d:.2f}x" if "local" in v else "- | -"
        per = (f"{_fmt(v['persistent'])} | {statistics.median(v['persistent']) / raw_p:.2f}x"
               if "persistent" in v else "- | -")  # fmt: skip
        up = _fmt(v["upload round"]) if "upload round" in v else "-"
        cpu = _fmt(v["server cpu"]) if "server cpu" in v and case != "posix" else "-"
        lines.append(f"| {names[case]} | {blk} | {loc} | {per} | {up} | {cpu} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=128, help="MiB of state a rank")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "bench-results" / "tier-durability")
    ap.add_argument("--quick", action="store_true", help="8 MiB a rank, 1 round (unless given)")
    ap.add_argument("--keep-logs", action="store_true", help="copy every rank's log (INFO) to OUT/logs/")
    ap.add_argument("--cases", default=",".join(CASES), help="a subset of " + ",".join(CASES))
    args = ap.parse_args()
    if args.quick:
        args.mib, args.rounds = (8 if "--mib" not in sys.argv else args.mib), (1 if "--rounds" not in sys.argv
                                                                                else args.rounds)  # fmt: skip
    cases = [c for c in args.cases.split(",") if c]
    assert set(cases) <= set(CASES), cases
    if os.geteuid() != 0:
        sys.exit("needs root: the node-local case runs each simulated node in a mount namespace of its own")
    from s3fixtures import opts
    from s3server import S3Server

    tmp = Path(tempfile.mkdtemp(prefix="tier-durability-", dir="/var/tmp"))
    # SeaweedFS reclaims deleted space only when it vacuums: room for every save of every round
    server = S3Server(volumes=max(64, (7 * 4 * args.mib * args.rounds) // 256 + 32))
    times: dict[str, dict[str, list[float]]] = {c: {} for c in cases}
    keep = args.out / "logs" if args.keep_logs else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    try:
        server.start()
        server.create_bucket(BUCKET)
        env = {"MIB": str(args.mib), "S3OPTS": json.dumps(opts(server.endpoint)), "BUCKET": BUCKET,
               "CK_TIMEOUT": "300"}  # fmt: skip
        for k in range(args.rounds):
            for case in cases[k % len(cases):] + cases[: k % len(cases)]:
                tag = f"{case}-{k}-{uuid.uuid4().hex[:6]}"
                os.sync()  # every case starts without the previous one's dirty pages
                assert server.proc is not None
                cpu0 = _cpu_s(server.proc.pid)
                if case == "raw-direct":
                    got = {"local": _raw("direct", tmp, env, tag, args.mib)}
                elif case == "raw-put":
                    got = {"persistent": _raw("put", tmp, env, tag, args.mib)}
                else:
                    got = _ranks(case, tmp, dict(env, URL=f"s3://{BUCKET}/{tag}"), tag, keep)
                    if case in ("s3", "posix"):  # one commit: durable where it is, nothing more
                        got.pop("persistent" if case == "posix" else "local")
                if case != "raw-direct":  # the server's CPU for the case's two saves (or PUTs) of every rank
                    got["server cpu"] = _cpu_s(server.proc.pid) - cpu0
                for key, v in got.items():
                    times[case].setdefault(key, []).append(v)
                print(f"round {k + 1}: {case} " + ", ".join(f"{key} {v:.2f} s" for key, v in got.items()), flush=True)
    finally:
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)
    data = {"mib": args.mib, "rounds": args.rounds, "layout": "2 nodes x 2 ranks where the mode has nodes",
            "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "when": time.time(), "times": times}  # fmt: skip
    table = report(data) if set(cases) == set(CASES) else json.dumps(times, indent=1)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    (args.out / "results.md").write_text(table + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6], sys.argv[7])
    else:
        main()
