"""The Hugging Face Trainer's own checkpoint save against AsyncckptTrainer, same run side by side.

    python benchmarks/hf_trainer.py                      # GPT-2 of ~30M parameters, 6 saves each
    python benchmarks/hf_trainer.py --hidden 256 --layers 4 --saves 4 --json out.json

Both trainers run the same training (a GPT-2 built from a config on the CPU, random tokens,
AdamW) and save every ``--save-steps`` steps with ``save_total_limit=2``. For every save it
records the time the training thread spent in ``Trainer._save_checkpoint`` (the Trainer: model,
optimizer, scheduler, RNG, trainer state written, no fsync; asyncckpt: the state staged, the
write left to the background), and for asyncckpt also the time until the step was durable
(committed, fsynced) and ``train()``'s wait for pending saves at its end. The first save of
each is reported apart (asyncckpt allocates its staging buffer then) and left out of the
medians. Prints a table, writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from asyncckpt.integrations.transformers import AsyncckptTrainer


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def timed(base: type[Trainer]) -> type[Trainer]:
    """``base`` with the wall time of each ``_save_checkpoint`` call recorded."""

    class Timed(base):  # type: ignore[valid-type,misc]
        save_s: list[float]

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            t0 = time.perf_counter()
            super()._save_checkpoint(model, trial)
            self.save_s.append(time.perf_counter() - t0)

    return Timed


def run(kind: str, out: str, a: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=a.vocab, n_positions=a.seq, n_embd=a.hidden, n_layer=a.layers, n_head=8)
    model = GPT2LMHeadModel(cfg)
    params = sum(p.numel() for p in model.parameters())
    args = TrainingArguments(
        out, max_steps=a.saves * a.save_steps, per_device_train_batch_size=a.batch, save_steps=a.save_steps,
        save_total_limit=2, logging_strategy="no", report_to=[], use_cpu=True, seed=1, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    cls = timed(AsyncckptTrainer if kind == "asyncckpt" else Trainer)
    t = cls(model=model, args=args, train_dataset=Tokens(64, a.seq, a.vocab))
    t.save_s = []
    durable: list[float] = []
    drain = [0.0]
    if kind == "asyncckpt":
        # the time until each step was durable (its statistics), and train()'s wait at the end
        pub, finish = t._asyncckpt_publisher, t._asyncckpt_finish
        after_commit = pub.after_commit

        def watch(handle: Any, fn: Any) -> None:
            def publish(info: Any) -> None:
                durable.append(info.statistics.total_s)
                fn(info)

            after_commit(handle, publish)

        def timed_finish(raise_failure: bool) -> None:
            d0 = time.perf_counter()
            finish(raise_failure)
            drain[0] = time.perf_counter() - d0

        pub.after_commit, t._asyncckpt_finish = watch, timed_finish
    t0 = time.perf_counter()
    t.train()
    wall = time.perf_counter() - t0
    nbytes = sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file())
    return {"save_s": t.save_s, "durable_s": durable, "drain_s": drain[0], "train_wall_s": wall,
            "params": params, "bytes_on_disk_at_end": nbytes}  # fmt: skip


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def main() -> None:
    warnings.simplefilter("ignore")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the training loop")
    p.add_argument("--scratch", help="where checkpoints go (default: a new directory under $TMPDIR, removed)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    scratch = a.scratch or tempfile.mkdtemp(prefix="hf-trainer-bench-")
    results: dict[str, Any] = {"args": vars(a), "torch": torch.__version__}
    try:
        for kind in ("trainer", "asyncckpt"):
            out = os.path.join(scratch, kind)
            r = run(kind, out, a)
            rest = r["save_s"][1:]
            r["first_save_s"] = r["save_s"][0] if r["save_s"] else None
            r["median_save_s"] = med(rest)
            r["median_durable_s"] = med(r["durable_s"][1:])
            results[kind] = r
            shutil.rmtree(out, ignore_errors=True)
    finally:
        if not a.scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    import transformers

    results["transformers"] = transformers.__version__
    tr, ak = results["trainer"], results["asyncckpt"]
    state_mb = tr["params"] * 4 * 3 / 1e6  # weights + AdamW's two moments, float32
    print(f"GPT-2 {tr['params'] / 1e6:.1f}M parameters, ~{state_mb:.0f} MB of model + optimizer state per save, "
          f"{a.saves} saves, torch threads {a.threads}")  # fmt: skip
    print(f"{'':34} {'Trainer':>10} {'asyncckpt':>10}")
    rows = [
        ("blocking per save, median (s)", tr["median_save_s"], ak["median_save_s"]),
        ("blocking, first save (s)", tr["first_save_s"], ak["first_save_s"]),
        ("durable after save(), median (s)", None, ak["median_durable_s"]),
        ("wait for pending saves at end (s)", 0.0, ak["drain_s"]),
        ("train() wall time (s)", tr["train_wall_s"], ak["train_wall_s"]),
    ]
    for name, x, y in rows:
        fx = "-" if x is None else f"{x:.3f}"
        fy = "-" if y is None else f"{y:.3f}"
        print(f"{name:34} {fx:>10} {fy:>10}")
    if tr["median_save_s"] and ak["median_save_s"]:
        results["blocking_ratio"] = ak["median_save_s"] / tr["median_save_s"]
        print(f"asyncckpt blocks {results['blocking_ratio']:.2f}x the Trainer's save (the Trainer does not fsync)")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
