"""2-D (FSDP2 x TP) saves and a resharded load on transformers' Llama, side by side with DCP.

    python benchmarks/sharded_2d.py --repeats 7 --out benchmarks/results/<dir>

**The state** (issue 28): transformers' ``LlamaForCausalLM`` built from a config (random init,
nothing downloaded; default: hidden 512, 4 layers, vocab 8192, GQA 8/4 heads: 21 M parameters),
set up as ``tests/support/_llama_worker.py`` does: TP by the model's own plan over ``mesh["tp"]`` and
FSDP2 over ``mesh["dp"]`` of a 2 x 2 gloo mesh (4 real processes), one AdamW step, saved as
``get_state_dict(model, optim)``: every parameter and both moments are DTensors; the norms,
embeddings and output layer are sharded over dp only, so each lies on two dp sub-meshes.

**Saves** (the 4 ranks of the 2 x 2 mesh, the same processes for every method): ``asyncckpt``
(``Checkpointer(root).save``), ``dcp.async_save`` with a cached ``DefaultStager`` and with a fresh
default stager per save, and ``dcp.save`` (the methods of ``benchmarks/sharded_save.py``). In
each repetition every method saves once, in an order rotated from one repetition to the next,
each after 0.1 s of matrix products and a barrier on every rank (``sharded_save.busy``); the
repetition starts with the memcpy and raw write+fsync limits of each rank's local bytes.
*Blocking* = the longest ``save()`` over the ranks (for DCP: until the state may be mutated);
*durable* = until committed on every rank (DCP: its future, then an fsync of its directory).
One warm-up repetition is left out. *On disk*: the bytes of one checkpoint of each.

**Load, 2 x 2 -> 2**: 2 fresh gloo ranks build the same Llama with FSDP2 over both (no TP) and
load the last checkpoints into ``get_state_dict(model, optim)`` (``Checkpointer.load(into=)``,
verified and with ``verify=False``, and ``dcp.load``), round robin, cold (page cache dropped
with ``posix_fadvise(DONTNEED)`` on every file, or ``drop_caches`` as root) and warm; one sample
is barrier to barrier. Afterwards both loads' targets are compared with the saved state (gathered
to full tensors) bit for bit.

**Noise**: the machine is shared, so every ratio is given as the median of the per-repetition
ratios (the two methods measured seconds apart) with their min-max, next to the ratio of the
medians, and every method's run-to-run spread ((max - min) / median) and the load averages.

Prints the tables, writes ``results.json`` (every sample) and ``results.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(HERE), str(REPO / "tests" / "support"), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)

TARGET_BYTES = 1.0
SAVES = ("asyncckpt", "dcp.async_save (cached stager)", "dcp.async_save (default)", "dcp.save")
LOADS = ("asyncckpt load(into=)", "asyncckpt load(into=, verify=False)", "dcp.load")


# ---------------------------------------------------------------------- the ranks
def _llama(args: dict[str, Any]) -> Any:
    """``tests/support/_llama_worker`` with the benchmark's config (its functions read ``CONFIG``)."""
    import _llama_worker

    _llama_worker.CONFIG.update(
        vocab_size=args["vocab"], hidden_size=args["hidden"], intermediate_size=args["hidden"] * 3,
        num_hidden_layers=args["layers"], num_attention_heads=8, num_key_value_heads=4,
    )  # fmt: skip
    return _llama_worker


def _init(rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2 to 4 ranks share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=900)
    )


def _global_bytes(state: Any) -> int:
    """Bytes of the state's global tensors (what one copy of the checkpoint must hold)."""
    import torch
    from _llama_worker import leaves
    from torch.distributed.tensor import DTensor

    return sum(
        v.numel() * v.element_size() for v in leaves(state) if isinstance(v, (DTensor, torch.Tensor))
    )  # DTensor.numel() is the global count


def rank_save(rank: int, port: int, args: dict[str, Any], scratch: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from sharded_save import Limits, Methods, busy, local_tensors
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _init(rank, 4, port)
    lw = _llama(args)
    model, optim = lw.build("2d", seed=1)
    lw.train_step(model, optim)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    root = os.path.join(scratch, "save")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
    dist.barrier()
    lim = Limits(local_tensors(state), os.path.join(root, f"limits{rank}"))
    os.makedirs(lim.scratch, exist_ok=True)
    m = Methods(root, state, rank, ddp=False)
    assert tuple(m.names) == SAVES, m.names
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in (*SAVES, "memcpy", "raw write")}
    loadavg: list[float] = []
    last = args["repeats"]
    for step in range(last + 1):
        k = step % len(SAVES)
        order = ["memcpy", "raw write", *SAVES[k:], *SAVES[:k]]  # rotated: no method always follows another
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
            got: list[Any] = [None] * 4
            dist.all_gather_object(got, (blocking, durable))
            if rank == 0 and step > 0:
                samples[name].append((max(b for b, _ in got), max(d for _, d in got)))
            if rank == 0 and name in SAVES and step > 0:
                m.retire(name, step - 1)  # outside the timing; the last step stays for the load
        loadavg.append(os.getloadavg()[0])
    m.close()
    written = {n: m.written(n, last) for n in SAVES} if rank == 0 else {}
    local = [0] * 4
    dist.all_gather_object(local, lim.nbytes)
    ref = lw.full(state)  # a collective: every rank gathers
    if rank == 0:
        torch.save(ref, os.path.join(scratch, "ref.pt"))
        shutil.rmtree(os.path.join(root, "limits0"), ignore_errors=True)
    dist.barrier()
    return {
        "samples": samples,
        "written": written,
        "local_bytes": local,
        "global_bytes": _global_bytes(state),
        "n_tensors": len(lw.leaves(state)),
        "parameters": sum(p.numel() for p in model.parameters()),
        "loadavg": loadavg,
        "ack_root": m.cks["asyncckpt"].root,
        "dcp_dir": m.path("dcp.save", last),
        "step": last,
    }


def rank_load(rank: int, port: int, args: dict[str, Any], scratch: str, save: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from measure import drop_cache
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import asyncckpt

    _init(rank, 2, port)
    lw = _llama(args)
    model, optim = lw.build("fsdp", seed=2)
    msd, osd = get_state_dict(model, optim)  # materializes the optimizer state: a load target
    target = {"model": msd, "optim": osd}
    root, dcp_dir, step = save["ack_root"], save["dcp_dir"], save["step"]
    ck = asyncckpt.Checkpointer(root)
    fns = {
        "asyncckpt load(into=)": lambda: ck.load(step, into=target),
        "asyncckpt load(into=, verify=False)": lambda: ck.load(step, into=target, verify=False),
        "dcp.load": lambda: dcp.load(target, checkpoint_id=dcp_dir),
    }

    def drop() -> str:
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "drop_caches"
        except OSError:
            drop_cache([root, dcp_dir])
            return "posix_fadvise(DONTNEED)"

    for fn in fns.values():
        fn()  # warm-up: imports, allocator, thread pools
    times: dict[str, dict[str, list[float]]] = {n: {"cold": [], "warm": []} for n in LOADS}
    how = ""
    for i in range(args["repeats"]):
        k = i % len(LOADS)
        for name in (*LOADS[k:], *LOADS[:k]):
            for mode in ("cold", "warm"):
                dist.barrier()
                if mode == "cold" and rank == 0:
                    how = drop()
                dist.barrier()  # warm: the cold load of the same variant just read every file
                t0 = time.perf_counter()
                fns[name]()
                dist.barrier()
                times[name][mode].append(time.perf_counter() - t0)
    # correctness: each load's targets against the saved state, gathered to full tensors
    ref = torch.load(os.path.join(scratch, "ref.pt"), weights_only=False) if rank == 0 else None
    diffs: dict[str, list[str]] = {}
    for name in ("asyncckpt load(into=)", "dcp.load"):
        with torch.no_grad():
            for v in lw.leaves(target):
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    (v.to_local() if hasattr(v, "to_local") else v).fill_(float("nan"))
        fns[name]()
        got = lw.full(target)
        if rank == 0:
            diffs[name] = lw.diff(got, ref)
    ck.close()
    return {"times": times, "drop": how, "diffs": diffs}


def _rank_main(argv: list[str]) -> int:
    role, rank, port, scratch = argv[0], int(argv[1]), int(argv[2]), argv[3]
    with open(os.path.join(scratch, "args.json")) as f:
        args = json.load(f)
    try:
        if role == "save":
            res = rank_save(rank, port, args, scratch)
        else:
            with open(os.path.join(scratch, "save.0.json")) as f:
                res = rank_load(rank, port, args, scratch, json.load(f))
    except BaseException as e:  # noqa: BLE001 - reported to the driver
        import traceback

        res = {"crash": "".join(traceback.format_exception(e))}
    with open(os.path.join(scratch, f"{role}.{rank}.json"), "w") as f:
        json.dump(res, f)
    os._exit(0)


# ---------------------------------------------------------------------- the driver
def _spawn(role: str, world: int, scratch: str, deadline_s: float) -> dict[str, Any]:
    from _ranks import free_port, log_tail, run_ranks

    logs = Path(scratch, f"logs-{role}")
    logs.mkdir()
    port = str(free_port())
    hung = run_ranks(lambda r: [__file__, "--rank", role, str(r), port, scratch], world, logs, deadline_s)
    if hung:
        raise RuntimeError(f"{role}: ranks {hung} still running after {deadline_s:.0f} s:\n{log_tail(logs, hung[0])}")
    for r in range(world):
        path = Path(scratch, f"{role}.{r}.json")
        if not path.exists():
            raise RuntimeError(f"{role} rank {r} wrote no result:\n{log_tail(logs, r)}")
        got = json.loads(path.read_text())
        if "crash" in got:
            raise RuntimeError(f"{role} rank {r} failed:\n{got['crash']}")
    return json.loads(Path(scratch, f"{role}.0.json").read_text())  # type: ignore[no-any-return]


def _stats(xs: list[float]) -> dict[str, Any]:
    med = statistics.median(xs)
    return {"median": med, "min": min(xs), "max": max(xs), "spread": (max(xs) - min(xs)) / med, "samples": xs}


def _paired(a: list[float], b: list[float]) -> dict[str, Any]:
    """``a / b`` per repetition (measured seconds apart) and of the medians."""
    r = [x / y for x, y in zip(a, b, strict=True)]
    of_medians = statistics.median(a) / statistics.median(b)
    return {"median": statistics.median(r), "min": min(r), "max": max(r), "of_medians": of_medians}


def run(args: dict[str, Any], scratch: str) -> dict[str, Any]:
    import torch

    with open(os.path.join(scratch, "args.json"), "w") as f:
        json.dump(args, f)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    save = _spawn("save", 4, scratch, 3000)
    save_wall = time.perf_counter() - t0
    load = _spawn("load", 2, scratch, 3000)
    saves = {
        n: {"blocking": _stats([b for b, _ in xs]), "durable": _stats([d for _, d in xs])}
        for n, xs in save["samples"].items()
    }  # fmt: skip
    loads = {n: {mode: _stats(xs) for mode, xs in d.items()} for n, d in load["times"].items()}
    a = saves["asyncckpt"]
    ratios: dict[str, Any] = {}
    for n in SAVES[1:]:
        for fig in ("blocking", "durable"):
            ratios[f"{fig} vs {n}"] = _paired(a[fig]["samples"], saves[n][fig]["samples"])
    for mode in ("cold", "warm"):
        ratios[f"load {mode} vs dcp.load"] = _paired(
            loads["asyncckpt load(into=)"][mode]["samples"], loads["dcp.load"][mode]["samples"]
        )
    w = save["written"]
    machine = {
        "platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "python": platform.python_version(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg_start": load0, "loadavg_end": os.getloadavg(),
    }  # fmt: skip
    state = {
        "parameters": save["parameters"], "tensors_per_rank": save["n_tensors"],
        "global_bytes": save["global_bytes"], "local_bytes_per_rank": save["local_bytes"],
    }  # fmt: skip
    return {
        "machine": machine,
        "args": args,
        "state": state,
        "save_wall_s": save_wall,
        "loadavg_per_repetition": save["loadavg"],
        "saves": saves,
        "written_bytes": w,
        "bytes_vs_dcp": w["asyncckpt"] / w["dcp.save"],
        "loads": loads,
        "cache_drop": load["drop"],
        "load_diffs": load["diffs"],
        "ratios": ratios,
    }


def _s(d: dict[str, Any]) -> str:
    return f"{d['median']:.3f} [{d['min']:.3f}-{d['max']:.3f}]"


def _r(d: dict[str, Any]) -> str:
    # beyond the noise only where every repetition agrees on the side of 1.0
    if d["max"] < 1:
        call = "faster in every repetition"
    elif d["min"] > 1:
        call = "slower in every repetition"
    else:
        call = "within the noise"
    return f"{d['median']:.2f}x [{d['min']:.2f}-{d['max']:.2f}] | {d['of_medians']:.2f}x | {call}"


def report(r: dict[str, Any]) -> str:
    m, st, a = r["machine"], r["state"], r["args"]
    la = r["loadavg_per_repetition"]
    lines = [
        f"# 2-D saves (FSDP2 x TP, 2 x 2 gloo ranks) and a 2 x 2 -> 2 load, transformers Llama, medians of "
        f"{a['repeats']}",
        "",
        f"{m['platform']}, {m['cpus']} CPUs, torch {m['torch']}, {m['when']}; load average (1 min) "
        f"{m['loadavg_start'][0]:.1f} at the start, {min(la):.1f}-{max(la):.1f} over the save repetitions, "
        f"{m['loadavg_end'][0]:.1f} at the end.",
        "",
        f"State: Llama hidden {a['hidden']}, {a['layers']} layers, vocab {a['vocab']}, {st['parameters'] / 1e6:.1f} M "
        f"parameters; model + AdamW {st['global_bytes'] / 1e6:.1f} MB global, "
        f"{min(st['local_bytes_per_rank']) / 1e6:.1f}-{max(st['local_bytes_per_rank']) / 1e6:.1f} MB local per rank, "
        f"{st['tensors_per_rank']} tensors.",
        "",
        "Seconds, median [min-max]; spread = (max - min) / median, the run-to-run noise.",
        "",
        "| save on 2 x 2 | blocking s | spread | durable s | spread | on disk |",
        "|---|---|---|---|---|---|",
    ]
    for n, v in r["saves"].items():
        b, d = v["blocking"], v["durable"]
        if n in ("memcpy", "raw write"):
            lines.append(f"| limit: {n} of the local bytes | | | {_s(d)} | {d['spread']:.0%} | |")
        else:
            w = r["written_bytes"][n] / 1e6
            lines.append(f"| {n} | {_s(b)} | {b['spread']:.0%} | {_s(d)} | {d['spread']:.0%} | {w:.1f} MB |")
    lines += [
        "",
        "| load 2 x 2 -> 2 (FSDP2 over 2 ranks) | cold s | spread | warm s | spread |",
        "|---|---|---|---|---|",
    ]
    for n, v in r["loads"].items():
        c, w = v["cold"], v["warm"]
        lines.append(f"| {n} | {_s(c)} | {c['spread']:.0%} | {_s(w)} | {w['spread']:.0%} |")
    ok = {n: ("bit-equal" if not d else f"{len(d)} differ: {d[:3]}") for n, d in r["load_diffs"].items()}
    lines += [
        "",
        f"Cold = {r['cache_drop']}. Loaded targets against the saved state (gathered): "
        + ", ".join(f"{n} {v}" for n, v in ok.items())
        + ".",
        "",
        "asyncckpt / DCP: the median of the per-repetition ratios [their min-max], the ratio of the medians,",
        "and whether the difference is beyond the run-to-run noise (every repetition on the same side of 1.0).",
        "",
        "| ratio | paired median [min-max] | of medians | noise |",
        "|---|---|---|---|",
    ]
    for n, v in r["ratios"].items():
        lines.append(f"| {n} | {_r(v)} |")
    bv = r["bytes_vs_dcp"]
    verdict = "met" if bv <= TARGET_BYTES else "NOT met"
    lines += [f"| bytes on disk vs dcp.save (target <= {TARGET_BYTES}x: {verdict}) | {bv:.3f}x | | |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank"]:
        return _rank_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512, help="Llama hidden size (intermediate: 3x)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=7, help="repetitions after the warm-up (>= 5)")
    ap.add_argument("--out", default=str(REPO / "bench-results" / "sharded_2d"))
    ap.add_argument("--scratch", default=None, help="where the checkpoints go (default: a new dir under $TMPDIR)")
    ns = ap.parse_args(argv)
    if ns.repeats < 5:
        ap.error("--repeats must be >= 5")
    if ns.hidden % 16:
        ap.error("--hidden must be a multiple of 16 (8 heads, split over 2 TP ranks)")
    args = {"hidden": ns.hidden, "layers": ns.layers, "vocab": ns.vocab, "repeats": ns.repeats}
    scratch = tempfile.mkdtemp(prefix="asyncckpt-2d-", dir=ns.scratch)
    try:
        result = run(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    md = report(result)
    print(md)
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(ns.out, "results.md"), "w") as f:
        f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
