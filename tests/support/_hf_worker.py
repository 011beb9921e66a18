"""A tiny Hugging Face Trainer run (GPT-2 built from a config, random tokens, CPU).

argv: out_dir mode max_steps [--resume] [--pace S] [--limit N]
mode: "async" (AsyncckptTrainer) or "trainer" (transformers.Trainer, its own saves).
Used in-process by tests/test_transformers.py too. Deterministic: the Trainer seeds
everything from ``seed``; dropout is on (0.1), so the RNG states a checkpoint restores matter;
GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight``. Each logged step appends
``step loss`` to ``out_dir/losses.txt``; the end writes ``final.pt`` (the weights) and ``done``.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from asyncckpt.integrations.transformers import AsyncckptTrainer

VOCAB, SEQ, SAMPLES, BATCH = 128, 16, 64, 4  # 16 steps per epoch


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.x = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Record(TrainerCallback):
    """Appends each logged loss to a file (flushed: a SIGKILL keeps what was written) and paces."""

    def __init__(self, path: str | None, pace_s: float, stop_at: int | None) -> None:
        self.path, self.pace_s, self.stop_at = path, pace_s, stop_at
        self.losses: dict[int, float] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]
            if self.path is not None:
                with open(self.path, "a") as f:
                    f.write(f"{state.global_step} {logs['loss']!r}\n")

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.pace_s:
            time.sleep(self.pace_s)
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4))


def trainer(
    out: str, mode: str, max_steps: int, *, limit: int | None = 2, pace_s: float = 0.0, save_steps: int = 5,
    stop_at: int | None = None, record: bool = True, evaluate: bool = False, **extra: Any,
) -> tuple[Trainer, Record]:  # fmt: skip
    args = TrainingArguments(
        out, max_steps=max_steps, per_device_train_batch_size=BATCH, save_steps=save_steps,
        save_total_limit=limit, logging_steps=1, report_to=[], use_cpu=True, seed=1, learning_rate=1e-3,
        disable_tqdm=True, dataloader_num_workers=0, **extra,
    )  # fmt: skip
    rec = Record(os.path.join(out, "losses.txt") if record else None, pace_s, stop_at)
    cls = AsyncckptTrainer if mode == "async" else Trainer
    data = Tokens()
    evals = torch.utils.data.Subset(data, range(8)) if evaluate else None
    return cls(model=model(), args=args, train_dataset=data, eval_dataset=evals, callbacks=[rec]), rec


def run(out: str, mode: str, max_steps: int, resume: Any = None, **kw: Any) -> tuple[Trainer, Record]:
    """Train (single CPU thread, so two processes compute bit-identical results)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t, rec = trainer(out, mode, max_steps, **kw)
        t.train(resume_from_checkpoint=resume)
        return t, rec
    finally:
        torch.set_num_threads(threads)


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def main() -> None:
    warnings.simplefilter("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("mode", choices=["async", "trainer"])
    p.add_argument("max_steps", type=int)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--pace", type=float, default=0.0)
    p.add_argument("--limit", type=int, default=2)
    a = p.parse_args()
    t, _ = run(a.out, a.mode, a.max_steps, resume=True if a.resume else None, pace_s=a.pace, limit=a.limit)
    torch.save(weights(t), os.path.join(a.out, "final.pt"))
    Path(a.out, "done").touch()


if __name__ == "__main__":
    main()
