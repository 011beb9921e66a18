"""Sharded (FSDP2) and DDP saves on gloo ranks: asyncckpt against DCP, next to the limits.

    python benchmarks/sharded_save.py --worlds 2,4 --mb 64 --ddp-mb 32 --repeats 5 \\
        --out benchmarks/results/<name>

**FSDP2** (one launch per world size): a stack of ``nn.Linear`` layers of ``--mb`` MB of fp32
parameters in all, ``fully_shard`` on a 1-D mesh, one Adam step (so the state is the model
plus two moments, all DTensors), saved as ``get_state_dict(model, optim)``. Methods, round
robin within each repetition so every method sees the same machine:

- ``asyncckpt``: ``Checkpointer(root).save(step, state)``;
- ``dcp.async_save (cached stager)``: one ``DefaultStager`` reused for every save (plain CPU
  copies: no CUDA here, so its pinned and non-blocking options are off; shared memory off),
  thread checkpointer - the best configuration of ``benchmarks/methods.py`` on this machine;
- ``dcp.async_save (default)``: a fresh default stager per save;
- ``dcp.save``: blocking.

**Blocking** = the longest ``save()`` call over the ranks (for DCP until the state may be
mutated). **Durable** = from the call until the checkpoint is committed on every rank (the
asyncckpt handle; DCP's future, then an fsync of its directory by rank 0). **Limits**,
measured in the same run on every rank at once, under the same conditions as every method
(all ranks after 0.1 s of matrix products standing in for the training step before a save,
then one barrier; the slowest rank counts): ``memcpy`` of the rank's local bytes
into a preallocated buffer, and a raw write of them (``os.pwrite`` + ``fsync``, O_DIRECT and
buffered, the faster counts). They bracket asyncckpt's save in each repetition (the memcpy
right before it, the raw write right after it), so the targets are judged per repetition
(asyncckpt against the limits measured next to it, on the same machine state: ``paired``) and
the verdict is the median of those ratios; the ratio of the medians is printed next to it.
Targets (issue 10): blocking <= 1.3x memcpy, durable <= 1.3x the raw write, both at the
slowest rank. ``--no-dcp`` runs asyncckpt and the limits only.

**DDP** (in the launch of 4 ranks): ``--ddp-mb`` MB replicated per rank plus a 5 kB per-rank
RNG state: asyncckpt with dedupe (the default) and without (the replicated write), ``dcp.save``
and ``dcp.async_save``. Target: dedupe's time to durable <= 0.4x the replicated write.

Medians of ``--repeats`` (after one warm-up save per method). Writes ``sharded_save.json``
and ``sharded_save.md`` (the tables) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

ALIGN = 4096
TARGET_BLOCK, TARGET_DURABLE, TARGET_DDP = 1.3, 1.3, 0.4


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def busy(seconds: float) -> None:
    """A stand-in for the training step that precedes a save: every measured method and limit
    starts right after ``seconds`` of matrix products on every rank. On this VM the first ~50 ms
    of work after an idle vCPU run up to 2x slower (a memmove of 189 MB: 22-30 ms busy, 50-70 ms
    after a 0.2-2 s sleep), so without it whichever item follows an idle wait (fsyncs, another
    rank) looks slower than the item that follows a busy one."""
    import torch

    a = torch.ones(256, 256)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = torch.tanh(a @ a * (1 / 256))


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def local_tensors(obj: Any) -> list[Any]:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return [obj.to_local()]
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in local_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in local_tensors(v)]
    return []


class Limits:
    """memcpy and raw write (+fsync) of this rank's local bytes."""

    def __init__(self, tensors: list[Any], scratch: str) -> None:
        import torch

        self.tensors = [t.detach().reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
        self.nbytes = sum(t.numel() for t in self.tensors)
        size = max(ALIGN, -(-self.nbytes // ALIGN) * ALIGN)
        self.buf = mmap.mmap(-1, size)
        self.flat = torch.frombuffer(self.buf, dtype=torch.uint8)
        self.flat.fill_(1)  # fault the pages in once, outside the timing
        self.scratch = scratch
        self.n = 0

    def memcpy(self) -> float:
        import torch

        views, off = [], 0
        for t in self.tensors:
            views.append(self.flat[off : off + t.numel()])
            off += t.numel()
        t0 = time.perf_counter()
        torch._foreach_copy_(views, self.tensors)
        return time.perf_counter() - t0

    def write(self, direct: bool) -> float:
        self.n += 1
        path = os.path.join(self.scratch, f"raw{self.n}")
        size = len(self.buf) if direct else self.nbytes
        mv = memoryview(self.buf)
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0), 0o644)
        try:
            off = 0
            while off < size:
                off += os.pwrite(fd, mv[off : min(off + (16 << 20), size)], off)
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(self.scratch)
        dt = time.perf_counter() - t0
        os.unlink(path)
        return dt


def fsdp_state(mb: int, world: int) -> tuple[Any, Any, Any]:
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    width = 1024
    layers = max(1, mb * 1_000_000 // 4 // (width * width + width))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    return model, optim, {"model": msd, "optim": osd}


class Methods:
    """Each method: ``save(step) -> (blocking_s, finish)``; ``finish()`` waits until durable."""

    def __init__(self, root: str, state: Any, rank: int, ddp: bool, with_dcp: bool = True) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        from asyncckpt import Checkpointer

        self.dcp, self.root, self.state, self.rank = dcp, root, state, rank
        self.cks: dict[str, Any] = {}
        if ddp:
            self.cks["asyncckpt, dedupe (default)"] = Checkpointer(os.path.join(root, "dd"))
            self.cks["asyncckpt, replicated (dedupe=False)"] = Checkpointer(os.path.join(root, "rep"), dedupe=False)
        else:
            self.cks["asyncckpt"] = Checkpointer(os.path.join(root, "ack"))
        self.stager = DefaultStager(
            StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                           use_non_blocking_copy=False)
        )  # fmt: skip
        dcp_names = ["dcp.async_save (cached stager)", "dcp.async_save (default)", "dcp.save"]
        self.names = [*self.cks, *(n for n in dcp_names if with_dcp)]

    def path(self, name: str, step: int) -> str:
        return os.path.join(self.root, name.replace(" ", "_").replace("(", "").replace(")", ""), f"step_{step}")

    def save(self, name: str, step: int) -> tuple[float, Any]:
        if name in self.cks:
            t0 = time.perf_counter()
            h = self.cks[name].save(step, self.state)
            return time.perf_counter() - t0, lambda: h.result(timeout=600)
        path = self.path(name, step)
        if name == "dcp.save":
            t0 = time.perf_counter()
            self.dcp.save(self.state, checkpoint_id=path)
            if self.rank == 0:
                _fsync_dir(path)
            return time.perf_counter() - t0, lambda: None
        kw: dict[str, Any] = {"checkpoint_id": path}
        if "cached" in name:
            kw["async_stager"] = self.stager
        t0 = time.perf_counter()
        res = self.dcp.async_save(self.state, **kw)
        if hasattr(res, "staging_completion"):  # mutation is safe only after staging
            res.staging_completion.result()
            res = res.upload_completion
        blocking = time.perf_counter() - t0

        def finish() -> None:
            res.result()
            if self.rank == 0:
                _fsync_dir(path)

        return blocking, finish

    def retire(self, name: str, step: int) -> None:
        """Rank 0, outside the timing: remove the previous step of ``name``."""
        if name in self.cks:
            p = os.path.join(self.cks[name].root, f"step_{step:08d}")
        else:
            p = self.path(name, step)
        shutil.rmtree(p, ignore_errors=True)

    def written(self, name: str, step: int) -> int:
        if name in self.cks:
            return _du(os.path.join(self.cks[name].root, f"step_{step:08d}"))
        return _du(self.path(name, step))

    def close(self) -> None:
        for ck in self.cks.values():
            ck.close()


def run_config(args: argparse.Namespace, rank: int, world: int, kind: str) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    root = os.path.join(args.root, f"{kind}{world}")
    if kind == "fsdp":
        _, _, state = fsdp_state(args.mb, world)
    else:
        g = torch.Generator().manual_seed(0)
        n = args.ddp_mb * 1_000_000 // 4 // 8
        state = {
            "model": {f"w{i}": torch.randn(n, generator=g) for i in range(8)},
            "rng": torch.full((5056,), rank, dtype=torch.uint8),
        }
    if rank == 0:
        os.makedirs(root, exist_ok=True)
    dist.barrier()
    scratch = os.path.join(root, f"limits{rank}")
    os.makedirs(scratch, exist_ok=True)
    lim = Limits(local_tensors(state), scratch)
    m = Methods(root, state, rank, ddp=kind == "ddp", with_dcp=not args.no_dcp)
    rows: dict[str, list[tuple[float, float]]] = {n: [] for n in [*m.names, "memcpy", "raw write"]}
    nbytes: dict[str, int] = {}
    for step in range(args.repeats + 1):
        # the limits bracket asyncckpt's save: the memcpy right before it, the raw write right
        # after it, each on the same machine state as the save it is compared with (all ranks
        # at once after a barrier, like every method), so their ratio is taken per repetition
        # (``paired``), not only of medians
        order = ["memcpy", m.names[0], "raw write", *m.names[1:]]
        for name in order:
            busy(0.1)
            dist.barrier()
            if name == "memcpy":
                blocking = durable = lim.memcpy()
            elif name == "raw write":  # the better of O_DIRECT and buffered, each with fsync
                blocking = durable = min(lim.write(True), lim.write(False))
            else:
                t0 = time.perf_counter()
                blocking, finish = m.save(name, step)
                finish()
                durable = time.perf_counter() - t0
            got = [None] * world
            dist.all_gather_object(got, (blocking, durable))
            if rank == 0:
                if name in m.cks or name.startswith("dcp"):
                    nbytes[name] = m.written(name, step)
                    if step > 0:
                        m.retire(name, step - 1)
                if step > 0:
                    rows[name].append((max(b for b, _ in got), max(d for _, d in got)))  # type: ignore[misc]
    m.close()
    local = [0] * world
    dist.all_gather_object(local, lim.nbytes)
    dist.barrier()
    if rank != 0:
        return None
    out: dict[str, Any] = {"kind": kind, "world": world, "local_bytes": local, "methods": {}}
    if kind == "fsdp":  # per repetition: asyncckpt against the limits measured right before it
        a = rows["asyncckpt"]
        out["paired"] = {
            "blocking_vs_memcpy": [round(x[0] / y[0], 3) for x, y in zip(a, rows["memcpy"], strict=True)],
            "durable_vs_raw": [round(x[1] / y[1], 3) for x, y in zip(a, rows["raw write"], strict=True)],
        }
    for name, xs in rows.items():
        out["methods"][name] = {
            "blocking_s": statistics.median(b for b, _ in xs),
            "durable_s": statistics.median(d for _, d in xs),
            "blocking_all": [round(b, 4) for b, _ in xs],
            "durable_all": [round(d, 4) for _, d in xs],
            "written_bytes": nbytes.get(name),
        }
    shutil.rmtree(root, ignore_errors=True)
    return out


def rank_main(args: argparse.Namespace, rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2 to 4 ranks share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=600),
    )  # fmt: skip
    results = [run_config(args, rank, world, "fsdp")]
    if world == 4 and args.ddp_mb > 0:
        results.append(run_config(args, rank, world, "ddp"))
    if rank == 0:
        print("RESULT " + json.dumps(results))
    dist.destroy_process_group()


def _met(ratio: float, target: float) -> str:
    return "met" if ratio <= target else "NOT met"


def verdicts(res: dict[str, Any]) -> list[str]:
    ms = res["methods"]
    lines = []
    if res["kind"] == "fsdp":
        a, memcpy, raw = ms["asyncckpt"], ms["memcpy"]["durable_s"], ms["raw write"]["durable_s"]
        # the verdict: the median of the per-repetition ratios (each against the limit measured
        # right before that save); the ratio of the medians next to it
        pb, pd = res["paired"]["blocking_vs_memcpy"], res["paired"]["durable_vs_raw"]
        rb, rd = statistics.median(pb), statistics.median(pd)
        lines.append(
            f"blocking {rb:.2f}x memcpy (paired per repetition, {min(pb):.2f}-{max(pb):.2f}; ratio of medians "
            f"{a['blocking_s'] / memcpy:.2f}x; target <= {TARGET_BLOCK}x: {_met(rb, TARGET_BLOCK)})"
        )
        lines.append(
            f"durable {rd:.2f}x raw write (paired, {min(pd):.2f}-{max(pd):.2f}; ratio of medians "
            f"{a['durable_s'] / raw:.2f}x; target <= {TARGET_DURABLE}x: {_met(rd, TARGET_DURABLE)})"
        )
        res["ratios"] = {"blocking_vs_memcpy": rb, "durable_vs_raw": rd}
    else:
        dd, rep = ms["asyncckpt, dedupe (default)"], ms["asyncckpt, replicated (dedupe=False)"]
        r = dd["durable_s"] / rep["durable_s"]
        lines.append(f"dedupe durable {r:.2f}x replicated (target <= {TARGET_DDP}x: {_met(r, TARGET_DDP)})")
        res["ratios"] = {"dedupe_vs_replicated": r}
    return lines


def table(res: dict[str, Any], args: argparse.Namespace) -> str:
    what = (
        f"FSDP2, {args.mb} MB of parameters + Adam moments" if res["kind"] == "fsdp"
        else f"DDP, {args.ddp_mb} MB replicated per rank + 5 kB RNG"
    )  # fmt: skip
    local = res["local_bytes"]
    head = (
        f"### {what}, {res['world']} gloo ranks (local bytes per rank {min(local) / 1e6:.1f}-{max(local) / 1e6:.1f} MB;"
        f" medians of {args.repeats})\n\n| method | blocking | durable | written |\n|---|---|---|---|"
    )
    rows = []
    for name, v in res["methods"].items():
        w = "" if v["written_bytes"] is None else f"{v['written_bytes'] / 1e6:.1f} MB"
        if name in ("memcpy", "raw write"):
            rows.append(f"| limit: {name} of the local bytes | | {v['durable_s']:.3f} s | |")
        else:
            rows.append(f"| {name} | {v['blocking_s']:.3f} s | {v['durable_s']:.3f} s | {w} |")
    return "\n".join([head, *rows, "", *(f"- {x}" for x in verdicts(res)), ""])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--mb", type=int, default=64, help="FSDP2 parameter MB in all (the state is ~3x with Adam)")
    p.add_argument("--ddp-mb", type=int, default=32, help="DDP replicated MB per rank (0: skip DDP)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-dcp", action="store_true", help="asyncckpt and the limits only (quicker)")
    p.add_argument("--root", default="/tmp/asyncckpt-bench-sharded")
    p.add_argument("--port", type=int, default=29531)
    p.add_argument("--out", default=None, help="directory for sharded_save.json and sharded_save.md")
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--world", type=int, default=None)
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args, args.rank, args.world)
        return
    results: list[Any] = []
    for world in (int(w) for w in args.worlds.split(",")):
        shutil.rmtree(args.root, ignore_errors=True)
        argv = [sys.executable, __file__, *sys.argv[1:], "--world", str(world)]
        procs = [subprocess.Popen([*argv, "--rank", str(r)], stdout=subprocess.PIPE, text=True) for r in range(world)]
        outs = [pr.communicate(timeout=3600)[0] for pr in procs]
        line = next(x for x in outs[0].splitlines() if x.startswith("RESULT "))
        results.extend(json.loads(line[7:]))
        args.port += 1
    shutil.rmtree(args.root, ignore_errors=True)
    import torch

    text = "\n".join(table(r, args) for r in results)
    print(text)
    doc = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "platform": platform.platform()},
        "args": {k: v for k, v in vars(args).items() if k not in ("rank", "world")},
        "results": results,
    }  # fmt: skip
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sharded_save.json"), "w") as f:
            json.dump(doc, f, indent=1)
        with open(os.path.join(args.out, "sharded_save.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
