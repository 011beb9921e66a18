"""The Hugging Face Trainer with asynchronous checkpoints: kill it, run it again, it resumes.

    .venv/bin/python examples/hf_trainer.py --out runs/hf --steps 200     (after `make venv`)

A small GPT-2 (built from a config, nothing downloaded) learns random tokens on the CPU.
``AsyncckptTrainer`` is ``transformers.Trainer`` with its checkpoint methods replaced: every
``--save-every`` steps the model, optimizer, scheduler, RNG states and ``TrainerState`` are
staged and training goes on while a background thread writes, fsyncs and commits them; once
committed they appear as ``runs/hf/checkpoint-N`` (a pointer into ``runs/hf/.asyncckpt-trainer``),
and ``save_total_limit`` old ones go. Stop it at any moment (Ctrl-C, ``kill -9``, even during
a save) and run the same command again: ``resume_from_checkpoint=True`` continues from the
newest complete checkpoint, and every later loss is the one an uninterrupted run would log.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's asyncckpt

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from asyncckpt.integrations.transformers import AsyncckptTrainer


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 256, seq: int = 32, vocab: int = 512) -> None:
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/hf")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--keep", type=int, default=2, help="save_total_limit")
    a = p.parse_args()
    torch.set_num_threads(1)  # bit-identical losses from one run to the next on the CPU
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=2, n_head=4))
    args = TrainingArguments(
        a.out, max_steps=a.steps, save_steps=a.save_every, save_total_limit=a.keep, logging_steps=10,
        per_device_train_batch_size=8, learning_rate=1e-3, use_cpu=True, report_to=[], seed=1,
    )  # fmt: skip
    trainer = AsyncckptTrainer(model=model, args=args, train_dataset=RandomTokens())
    resume = os.path.isdir(a.out) and get_last_checkpoint(a.out) is not None
    print(f"{'resuming from ' + str(get_last_checkpoint(a.out)) if resume else 'starting'}", flush=True)
    trainer.train(resume_from_checkpoint=True if resume else None)  # returns once every save committed
    print("checkpoints:", sorted(n for n in os.listdir(a.out) if n.startswith("checkpoint-")))


if __name__ == "__main__":
    main()
