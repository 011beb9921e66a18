"""Training time lost per save: today's staging, deferred staging and ``dcp.async_save``, one run.

    python benchmarks/deferred_staging.py                          # Llama of ~1 GiB state (params + AdamW)
    python benchmarks/deferred_staging.py --hidden 512 --layers 4  # smaller, for a loaded machine
    python benchmarks/deferred_staging.py --device cuda            # on a GPU (benchmarks/deferred_gpu.sh)

A real training loop (a transformers ``LlamaForCausalLM`` built from a config, random tokens,
AdamW) checkpoints its model and optimizer every step and every 10 steps. Each mode runs the
same loop, round-robin with the others so load drifts hit all of them alike:

* ``none``: no checkpoint (the baseline step time);
* ``copy``: ``Checkpointer.save(step, state)``: returns once everything is copied;
* ``deferred``: ``save(step, state, until=optimizer)``: returns after the walk, the copy
  overlaps the next forward and backward, the optimizer step waits for it;
* ``dcp``: ``torch.distributed.checkpoint.async_save`` (``no_dist=True``, its default CPU
  stager; the previous save's future is waited for before the next, as DCP asks).

Time lost per save = (the run's wall time - iterations x the median iteration of the
``none`` run of the same round) / saves: everything a save costs the loop, the call, the
optimizer step's wait, and the writer's CPU competing with training. Medians over rounds.
Checkpoints go to ``--scratch`` (default a directory on /dev/shm: the copy, not the disk,
is measured). Prints a markdown table, writes ``--json`` and ``--md``.
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import asyncckpt

MODES = ("none", "copy", "deferred", "dcp")


def build(a: argparse.Namespace) -> tuple[Any, Any]:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.6875), num_hidden_layers=a.layers,
        num_attention_heads=max(1, a.hidden // 64), num_key_value_heads=max(1, a.hidden // 64),
        max_position_embeddings=a.seq,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).to(a.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, opt


def state_bytes(model: Any, opt: Any) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    n += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return n


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_loop(mode: str, every: int, iters: int, model: Any, opt: Any, a: argparse.Namespace, root: str, first: int) -> dict[str, Any]:  # noqa: E501
    """``iters`` training iterations, a save before every ``every``-th; wall time and per-iteration times."""
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(1)).to(a.device)
    ck = asyncckpt.Checkpointer(root, keep_last=2) if mode in ("copy", "deferred") else None
    pending: Any = None
    blocked: list[float] = []
    times: list[float] = []
    try:
        if ck is not None:
            ck.reserve({"model": model, "optim": opt})  # the staging buffer exists before the clock starts
        sync(a.device)
        t_run = time.perf_counter()
        for i in range(iters):
            t0 = time.perf_counter()
            if mode != "none" and i % every == 0:
                step = first + i
                if mode == "copy":
                    ck.save(step, {"model": model, "optim": opt})  # type: ignore[union-attr]
                elif mode == "deferred":
                    ck.save(step, {"model": model, "optim": opt}, until=opt)  # type: ignore[union-attr]
                else:
                    import torch.distributed.checkpoint as dcp

                    if pending is not None:
                        pending.result()
                    path = os.path.join(root, f"step_{step:08d}")
                    pending = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()},
                                             checkpoint_id=path, no_dist=True)  # fmt: skip
                blocked.append(time.perf_counter() - t0)
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            sync(a.device)
            times.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t_run
        if ck is not None:
            ck.flush()
        if pending is not None:
            pending.result()
    finally:
        if ck is not None:
            ck.close()
        shutil.rmtree(root, ignore_errors=True)
    return {"wall_s": wall, "iter_s": times, "save_call_s": blocked}


def interleaved(model: Any, opt: Any, a: argparse.Namespace, root: str, iters: int) -> dict[str, Any]:
    """One loop, one Checkpointer, saves alternating between today's mode and deferred every
    5 iterations: both see the same load. Excess of a save = its iteration + the next one -
    2 x the median of the iterations two or more after a save."""
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(1)).to(a.device)
    times, kinds, blocked = [], [], []
    with asyncckpt.Checkpointer(root, keep_last=2) as ck:
        ck.reserve({"model": model, "optim": opt})
        for i in range(iters):
            t0 = time.perf_counter()
            kind = None
            if i % 5 == 0:
                kind = "copy" if (i // 5) % 2 == 0 else "deferred"
                ck.save(i + 1, {"model": model, "optim": opt}, **({"until": opt} if kind == "deferred" else {}))
            t_saved = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(input_ids=tokens, labels=tokens).loss.backward()
            t_guard = time.perf_counter()
            ck.wait_staged()  # what the step's pre-hook does, timed (the hook then finds nothing to wait for)
            t_stepped = time.perf_counter()
            opt.step()
            if kind is not None:  # the training thread's stall: the save() call + the guard's wait
                blocked.append((kind, t_saved - t0 + t_stepped - t_guard))
            sync(a.device)
            times.append(time.perf_counter() - t0)
            kinds.append(kind)
    shutil.rmtree(root, ignore_errors=True)
    quiet = statistics.median(t for i, t in enumerate(times) if i % 5 >= 2)
    out: dict[str, Any] = {"quiet_iteration_s": quiet, "iter_s": times}
    for kind in ("copy", "deferred"):
        ex = [times[i] + times[i + 1] - 2 * quiet for i, k in enumerate(kinds) if k == kind and i + 1 < len(times)]
        stall = [b for k, b in blocked if k == kind]
        out[kind] = {"excess_s": ex, "median_excess_s": statistics.median(ex), "stall_s": stall,
                     "median_stall_s": statistics.median(stall)}  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--iters", type=int, default=20, help="iterations per run (a multiple of 10)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--scratch", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--json", default="deferred-staging.json")
    p.add_argument("--md", default="deferred-staging.md")
    p.add_argument("--interleaved", action="store_true", help="one loop, saves alternating today's/deferred")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    modes = [m for m in a.modes.split(",") if m]
    if "none" not in modes:
        modes.insert(0, "none")
    model, opt = build(a)
    scratch = tempfile.mkdtemp(prefix="deferred-bench-", dir=a.scratch)
    if a.interleaved:
        run_loop("none", 1, 2, model, opt, a, os.path.join(scratch, "warm"), 0)
        res = interleaved(model, opt, a, os.path.join(scratch, "ab"), a.iters)
        res["state_bytes"] = state_bytes(model, opt)
        res["load_avg"] = os.getloadavg()
        c, d = res["copy"]["median_excess_s"], res["deferred"]["median_excess_s"]
        cs, ds = res["copy"]["median_stall_s"], res["deferred"]["median_stall_s"]
        print(f"state {res['state_bytes'] / 2**30:.2f} GiB, quiet iteration {res['quiet_iteration_s']:.3f} s: "
              f"lost per save (median) today {c * 1e3:.0f} ms, deferred {d * 1e3:.0f} ms; training thread "
              f"stalled per save (save() + the step's wait) today {cs * 1e3:.0f} ms, deferred {ds * 1e3:.0f} ms "
              f"({ds / cs:.2f}x)", flush=True)  # fmt: skip
        Path(a.json).write_text(json.dumps(res, indent=1))
        shutil.rmtree(scratch, ignore_errors=True)
        return
    # AdamW's state exists (and a warm-up): the saved state is the steady one
    run_loop("none", 1, 2, model, opt, a, os.path.join(scratch, "warm"), 0)
    nbytes = state_bytes(model, opt)
    print(f"state {nbytes / 2**30:.3f} GiB, torch threads {torch.get_num_threads()}, device {a.device}", flush=True)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {m: {1: [], 10: []} for m in modes}
    step = 1
    try:
        for r in range(a.rounds):
            for every in (1, 10):
                for m in modes:
                    if m == "none" and every == 10:
                        continue  # one baseline per round serves both intervals
                    res = run_loop(m, every, a.iters, model, opt, a, os.path.join(scratch, f"{m}-{r}-{every}"), step)
                    step += a.iters
                    runs[m][every].append(res)
                    med = statistics.median(res["iter_s"])
                    print(f"round {r} every {every:2d} {m:9s} wall {res['wall_s']:7.2f}s median iteration "
                          f"{med:.3f}s", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    rows = []
    for every in (1, 10):
        for m in modes:
            if m == "none":
                continue
            lost, calls, excess = [], [], []
            for r, res in enumerate(runs[m][every]):
                base = statistics.median(runs["none"][1][r]["iter_s"])
                saves = len(res["save_call_s"])
                lost.append((res["wall_s"] - len(res["iter_s"]) * base) / saves)
                calls.append(statistics.median(res["save_call_s"]))
                if every > 1:  # against the iterations without a save of the same run (same load)
                    its = res["iter_s"]
                    quiet = statistics.median(t for i, t in enumerate(its) if i % every not in (0, 1))
                    excess += [its[i] + its[i + 1] - 2 * quiet for i in range(0, len(its) - 1, every)]
            rows.append({"mode": m, "every": every, "lost_per_save_s": statistics.median(lost),
                         "lost_per_save_all_s": lost, "save_call_s": statistics.median(calls),
                         "excess_s": statistics.median(excess) if excess else None})  # fmt: skip
    base_iter = statistics.median(statistics.median(x["iter_s"]) for x in runs["none"][1])
    copy_lost = {r["every"]: r["lost_per_save_s"] for r in rows if r["mode"] == "copy"}
    for row in rows:
        ref = copy_lost.get(row["every"])
        row["vs_copy"] = row["lost_per_save_s"] / ref if ref and ref > 0 and row["lost_per_save_s"] > 0 else None
    out = {
        "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "platform": platform.platform(),
                    "torch": torch.__version__, "threads": torch.get_num_threads(), "device": a.device},
        "model": {"hidden": a.hidden, "layers": a.layers, "vocab": a.vocab, "seq": a.seq, "batch": a.batch,
                  "state_bytes": nbytes},
        "iters": a.iters, "rounds": a.rounds, "baseline_iteration_s": base_iter, "rows": rows,
    }  # fmt: skip
    lines = [
        f"Llama state {nbytes / 2**30:.2f} GiB (params + AdamW), baseline iteration {base_iter:.3f} s, "
        f"{a.rounds} rounds x {a.iters} iterations, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
        "",
        "| every | mode | save() call (median) | lost per save (wall vs none run) | vs today's | "
        "save + next iteration vs quiet ones (same run) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        vs = f"{row['vs_copy']:.2f}x" if row["vs_copy"] is not None else "-"
        ex = f"{row['excess_s'] * 1e3:.0f} ms" if row["excess_s"] is not None else "-"
        lines.append(f"| {row['every']} | {row['mode']} | {row['save_call_s'] * 1e3:.0f} ms | "
                     f"{row['lost_per_save_s'] * 1e3:.0f} ms | {vs} | {ex} |")  # fmt: skip
    text = "\n".join(lines)
    print(text)
    Path(a.json).write_text(json.dumps(out, indent=1))
    Path(a.md).write_text(text + "\n")


if __name__ == "__main__":
    main()
