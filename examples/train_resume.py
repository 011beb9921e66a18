"""Train a small transformer with asynchronous checkpoints, and resume exactly after a crash.

    python examples/train_resume.py --root runs/tiny --steps 200 --save-every 10   (after `make venv`)

Stop it at any moment (Ctrl-C, ``kill -9``, even in the middle of a save) and run the same
command again: it resumes from the newest complete checkpoint under ``--root``, and the loss
at every later step is bit-for-bit the loss an uninterrupted run would have printed.

Exact continuation needs *everything* that influences the next step in the checkpoint:

* the model's weights, and the optimizer's moments and step counts (Adam),
* the LR scheduler's position,
* every random number generator in play: torch's global RNG (dropout), Python's ``random``
  (which tokens get noise below), a numpy ``Generator`` (how much noise), and the data
  pipeline's own ``torch.Generator``,
* the data position (here: the generator state and batches served; with a DataLoader, the
  sampler's position or a stateful loader) and the step counter.

All of these are plain checkpoint values: ``random.getstate()`` (a tuple), the numpy
``bit_generator.state`` (a dict with 128-bit ints) and ``torch.get_rng_state()`` come back
exactly as saved.

``Checkpointer.save()`` copies all of that into staging buffers and returns; the slow part
(writing, fsync, the atomic commit) happens on a background thread while training goes on.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncckpt import Checkpointer

VOCAB = 256  # byte-sized tokens
SEQ_LEN = 32
BATCH = 4
N_LAYERS = 4
N_HEADS = 8


# --------------------------------------------------------------------------- data
class SyntheticText:
    """An endless stream of token batches drawn from a fixed random bigram "language".

    The language (which token tends to follow which) is a function of ``seed`` alone; the
    batches come from a private ``torch.Generator``. Its state and the number of batches
    served are the iterator's position, exposed through ``state_dict()`` so the
    checkpointer saves and restores them like any other stateful object.
    """

    def __init__(self, seed: int) -> None:
        language = torch.Generator().manual_seed(seed)
        self.next_token_probs = torch.softmax(3.0 * torch.randn(VOCAB, VOCAB, generator=language), dim=-1)
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.batches_served = 0

    def next_batch(self) -> torch.Tensor:
        tokens = torch.empty(BATCH, SEQ_LEN + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(VOCAB, (BATCH,), generator=self.generator)
        for t in range(1, SEQ_LEN + 1):
            probs = self.next_token_probs[tokens[:, t - 1]]
            tokens[:, t] = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        self.batches_served += 1
        return tokens

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "batches_served": self.batches_served}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.batches_served = state["batches_served"]


def add_input_noise(tokens: torch.Tensor, p: float = 0.05) -> torch.Tensor:
    """Replace a few input tokens at random (uses Python's ``random``, so it is checkpointed too)."""
    noisy = tokens.clone()
    flat = noisy.view(-1)
    for i in range(flat.numel()):
        if random.random() < p:
            flat[i] = random.randrange(VOCAB)
    return noisy


# --------------------------------------------------------------------------- model
class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, d: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)  # draws from torch's global RNG

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).transpose(1, 3).unbind(2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(attn))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyLM(nn.Module):
    def __init__(self, d: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ_LEN, d))
        self.blocks = nn.Sequential(*[Block(d, N_HEADS, dropout) for _ in range(N_LAYERS)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.ln(self.blocks(x)))


def width_for(model_mb: float) -> int:
    """The model width whose fp32 weights take about ``model_mb`` MB (a multiple of 32)."""
    params = model_mb * 2**20 / 4
    # 12 d^2 per block (attention 4 d^2, MLP 8 d^2); embeddings and head are ~2 * VOCAB * d
    a, b = 12 * N_LAYERS, 2 * VOCAB + SEQ_LEN
    d = (-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)
    return max(64, round(d / 32) * 32)


def lr_factor(step: int, warmup: int = 10) -> float:
    """Linear warm-up, then inverse square-root decay (a plain function: LambdaLR state stays small)."""
    return min((step + 1) / warmup, math.sqrt(warmup / (step + 1)))


# --------------------------------------------------------------------------- training
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True, help="checkpoint directory (resumes from it if it has checkpoints)")
    ap.add_argument("--steps", type=int, default=100, help="train until this step")
    ap.add_argument("--save-every", type=int, default=10, help="save a checkpoint every N steps")
    ap.add_argument("--model-mb", type=float, default=32, help="size of the fp32 weights (Adam adds 2x that)")
    ap.add_argument("--log-losses", metavar="FILE", help="append 'step loss' lines to FILE")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (keep equal across runs to compare)")
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    # bit-exact continuation needs the same kernels, in the same thread layout, on every run
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    model = TinyLM(width_for(args.model_mb))
    optim = torch.optim.Adam(model.parameters(), lr=3e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_factor)
    data = SyntheticText(args.seed)
    noise_rng = np.random.default_rng(args.seed)  # the noise level per batch
    # everything with state_dict()/load_state_dict(); saved and restored as one tree
    stateful = {"model": model, "optim": optim, "sched": sched, "data": data}
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.1f}M parameters ({n_params * 4 / 2**20:.0f} MB fp32)", flush=True)

    with Checkpointer(args.root, keep_last=3) as ck:
        step = 0
        latest = ck.latest()
        if latest is None:
            print(f"no checkpoint under {args.root}: starting from scratch", flush=True)
        else:
            loaded = ck.load(latest.step, into=stateful)  # model/optim/sched/data restored in place
            extra = loaded["extra"]
            step = extra["step"]
            torch.set_rng_state(extra["rng"])
            random.setstate(extra["py_rng"])
            noise_rng.bit_generator.state = extra["np_rng"]
            print(f"resumed from step {step} ({latest.path})", flush=True)

        while step < args.steps:
            step += 1
            t0 = time.perf_counter()
            tokens = data.next_batch()
            p = float(noise_rng.uniform(0.02, 0.08))
            inputs, targets = add_input_noise(tokens[:, :-1], p), tokens[:, 1:]
            loss = F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            step_ms = (time.perf_counter() - t0) * 1e3
            line = f"step {step:5d}  loss {loss.item():.6f}  {step_ms:6.1f} ms"

            if step % args.save_every == 0 or step == args.steps:
                extra = {
                    "step": step,
                    "rng": torch.get_rng_state(),
                    "py_rng": random.getstate(),
                    "np_rng": noise_rng.bit_generator.state,
                }
                t1 = time.perf_counter()
                ck.save(step, {**stateful, "extra": extra})  # returns once the state is staged
                line += f"  save stall {(time.perf_counter() - t1) * 1e3:6.1f} ms"

            print(line, flush=True)
            if args.log_losses:
                with open(args.log_losses, "a") as f:
                    f.write(f"{step} {loss.item()!r}\n")  # repr: the exact float, for comparisons
        # leaving the `with` block waits for the last save and raises if any save failed
    print(f"done at step {step}; checkpoints kept: {ck.steps()}", flush=True)


if __name__ == "__main__":
    main()
