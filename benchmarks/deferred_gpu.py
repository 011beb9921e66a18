"""Deferred staging on a GPU: correctness, then the numbers (prepared; not yet run on a GPU).

    python benchmarks/deferred_gpu.py --out OUT_DIR            # ~3 minutes on one H100

1. Correctness with CUDA tensors (AdamW on a CUDA Llama): a deferred save followed by a full
   training step holds exactly the state at ``save()``; a write by hand before the step fails
   the save with ``StateChangedError`` naming the key; the compute stream did not wait for the
   device-to-host copy inside ``save()`` (``save()`` returns before the copy's event is done,
   for a state large enough that the copy takes milliseconds).
2. The D2H copy time of the state into pinned memory (the plain ``copy_`` a blocking save does).
3. ``benchmarks/deferred_staging.py --device cuda``: training time lost per save, today's mode
   vs deferred vs ``dcp.async_save`` (target: deferred <= 0.1x the D2H copy time).

Writes ``OUT/gpu-check.json`` (and the staging benchmark's ``.json``/``.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import asyncckpt


def build() -> tuple[Any, Any, torch.Tensor]:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2752, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256)  # fmt: skip
    model = LlamaForCausalLM(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, 32000, (8, 256), device="cuda")
    return model, opt, tokens


def train_step(model: Any, opt: Any, tokens: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()


def cpu_copy(state: Any) -> Any:
    return {k: cpu_copy(v) for k, v in state.items()} if isinstance(state, dict) else (
        state.detach().cpu().clone() if isinstance(state, torch.Tensor) else state)  # fmt: skip


def same(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(b, torch.Tensor):
        return [] if isinstance(a, torch.Tensor) and torch.equal(a.cpu(), b) else [path]
    if isinstance(b, dict):
        return [d for k in b for d in same(a[k], b[k], f"{path}.{k}")]
    if isinstance(b, (list, tuple)):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in same(x, y, f"{path}.{i}")]
    return [] if a == b else [path]


def check(out: dict[str, Any], root: str) -> None:
    model, opt, tokens = build()
    train_step(model, opt, tokens)
    torch.cuda.synchronize()
    with asyncckpt.Checkpointer(root) as ck:
        ck.reserve({"model": model, "optim": opt})
        want = cpu_copy({"model": model.state_dict(), "optim": opt.state_dict()})
        t0 = time.perf_counter()
        h = ck.save(1, {"model": model, "optim": opt}, until=opt)
        out["save_call_s"] = time.perf_counter() - t0
        copies = list(ck._deferred_copies)
        # the compute stream does not wait: its work after save() is not ordered after the copy
        out["copy_pending_after_save"] = any(not ev.query() for c in copies for _, ev in c._events)
        train_step(model, opt, tokens)  # the step's pre-hook makes the stream wait for the copy
        torch.cuda.synchronize()
        h.result(120)
        got = asyncckpt.load(root, step=1)
        out["exact_diffs"] = same(got, want)[:10]
        emb = model.model.embed_tokens.weight.cpu()
        out["stepped"] = not torch.equal(emb, want["model"]["model.embed_tokens.weight"])
        h = ck.save(2, {"model": model, "optim": opt}, until=opt)
        with torch.no_grad():
            model.lm_head.weight.mul_(2)
        train_step(model, opt, tokens)
        try:
            h.result(120)
            out["changed"] = None
        except asyncckpt.StateChangedError as e:
            out["changed"] = list(e.keys)
        try:
            ck.flush()
        except asyncckpt.SaveError:
            pass
        out["steps"] = ck.steps()
    # the D2H copy a blocking save does, into pinned memory
    every = list(model.parameters()) + [v for s in opt.state.values() for v in s.values()]
    tensors = [t for t in every if isinstance(t, torch.Tensor) and t.is_cuda]
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch._foreach_copy_(pinned, tensors, non_blocking=True)
        torch.cuda.synchronize()
        out["d2h_copy_s"] = time.perf_counter() - t0
    out["state_bytes"] = sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    p.add_argument("--skip-bench", action="store_true")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    with tempfile.TemporaryDirectory() as d:
        check(out, os.path.join(d, "root"))
    ok = not out["exact_diffs"] and out["stepped"] and out["changed"] == ["lm_head.weight"] and out["steps"] == [1]
    out["correct"] = bool(ok)
    print(json.dumps(out, indent=1), flush=True)
    Path(a.out, "gpu-check.json").write_text(json.dumps(out, indent=1))
    if not a.skip_bench:
        bench = str(Path(__file__).with_name("deferred_staging.py"))
        files = ["--json", os.path.join(a.out, "staging.json"), "--md", os.path.join(a.out, "staging.md")]
        sizes = ["--hidden", "1024", "--layers", "8", "--batch", "8", "--seq", "256", "--iters", "30", "--rounds", "2"]
        cmd = [sys.executable, bench, "--device", "cuda", *sizes, "--scratch", tempfile.gettempdir(), *files]
        subprocess.run(cmd, check=True)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
