"""One rank of a NeMo Automodel recipe on CPU: NeMo's real ``BaseRecipe`` (its tracked state,
``save_checkpoint``/``load_checkpoint``, checkpoint directory code), ``CheckpointingConfig`` and
``Checkpointer``, ``StepScheduler``, ``StatefulRNG``, ``OptimizerParamScheduler`` and the
torchdata ``StatefulDataLoader`` + ``StatefulDistributedSampler`` its recipes use, driving a
tiny Llama (a ``transformers.LlamaConfig`` built here, nothing downloaded) under FSDP2 on gloo.

NeMo's full LLM recipe (``TrainFinetuneRecipeForNextTokenPrediction``) does not run on a
CPU-only torch: its ``setup()`` calls ``torch.cuda.reset_peak_memory_stats()`` and
``NeMoAutoModelForCausalLM.from_config`` builds the model on ``torch.device("cuda")``. So this
worker builds the same components the recipe's ``setup()`` builds and runs the same loop as
its ``run_train_validation_loop`` (epochs and batches from the step scheduler, a checkpoint
on ``is_ckpt_step``, ``_finalize_and_close_checkpointer`` at the end).

Run in the nemo-automodel virtualenv (``_nemo.python()``) as
``python _nemo_recipe_worker.py IMPL RANK WORLD PORT CKPT_DIR EVENTS [--max-steps N] ...``,
IMPL ``asyncckpt`` (the recipe with ``AsyncckptRecipeMixin``) or ``nemo`` (NeMo's own
save and load). Events (JSON lines) go to EVENTS as they happen: ``resumed`` (the step the
run starts at), ``step`` (loss as float hex, the sample ids of the batch), ``saved`` (after
``save_checkpoint`` returned: the time it blocked), ``done`` (SHA-256 of the full model and
optimizer tensors, this rank's RNG and dataloader state).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

if not torch.cuda.is_available():  # NeMo's recipes report CUDA memory; a CPU-only torch has none
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.max_memory_allocated = lambda *a, **k: 0  # type: ignore[assignment]

from nemo_automodel.components.checkpoint.config import CheckpointingConfig
from nemo_automodel.components.config.loader import ConfigNode
from nemo_automodel.components.optim.scheduler import OptimizerParamScheduler
from nemo_automodel.components.training.rng import StatefulRNG
from nemo_automodel.components.training.step_scheduler import StepScheduler
from nemo_automodel.recipes.base_recipe import BaseRecipe
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM

from asyncckpt.integrations.nemo_automodel import AsyncckptRecipeMixin

VOCAB, SEQ, SAMPLES = 64, 16, 48
MODEL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "attention_dropout": 0.1,
         "tie_word_embeddings": False, "use_cache": False}  # fmt: skip


class Tokens(torch.utils.data.Dataset[dict[str, Any]]):
    """Fixed random token sequences (seeded), each carrying its index so the test can check
    the dataloader position after a resume."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(2, VOCAB, (SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"idx": i, "input_ids": self.ids[i]}


def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
    return {"idx": [b["idx"] for b in batch], "input_ids": torch.stack([b["input_ids"] for b in batch])}


class TinyRecipe(BaseRecipe):
    """The components of NeMo's LLM fine-tuning recipe, built on CPU (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        self.args, self.rank_, self.world = args, rank, world

    def setup(self) -> None:
        a = self.args
        self.cfg = ConfigNode({
            "model": {"config": {"_target_": "transformers.LlamaConfig", **MODEL}},
            "step_scheduler": {"max_steps": a.max_steps, "ckpt_every_steps": a.ckpt_every},
        })  # fmt: skip
        self.checkpointer = CheckpointingConfig(
            enabled=True, checkpoint_dir=a.ckpt_dir, model_save_format="safetensors", save_consolidated=False,
            max_recent_checkpoints=a.keep, is_peft=False,
        ).build(dp_rank=self.rank_, tp_rank=0, pp_rank=0)  # fmt: skip
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**MODEL))
        mesh = init_device_mesh("cpu", (self.world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.peft_config = None  # as the recipe sets it without a peft: section
        # lists, as the recipe holds them (one optimizer and scheduler per model part)
        self.optimizer = [torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)]
        self.lr_scheduler = [OptimizerParamScheduler(
            self.optimizer[0], init_lr=1e-3, max_lr=1e-2, min_lr=1e-4, lr_warmup_steps=2, lr_decay_steps=a.max_steps,
            lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=a.max_steps, wd_incr_style="constant",
        )]  # fmt: skip
        self.rng = StatefulRNG(seed=1234, ranked=True)
        data = Tokens()
        sampler = StatefulDistributedSampler(data, num_replicas=self.world, rank=self.rank_, shuffle=True, seed=7)
        # its own generator: a DataLoader draws its base seed when an iterator starts, from the
        # global torch RNG unless it has one, and a resumed run starts its iterator at another
        # point of the RNG stream than the uninterrupted one (NeMo's own resume too)
        self.dataloader = StatefulDataLoader(data, batch_size=2, sampler=sampler, collate_fn=collate,
                                             generator=torch.Generator().manual_seed(11))  # fmt: skip
        self.step_scheduler = StepScheduler(
            global_batch_size=2 * self.world, local_batch_size=2, dp_size=self.world, dataloader=self.dataloader,
            ckpt_every_steps=a.ckpt_every, max_steps=a.max_steps, num_epochs=a.epochs, preemption_signal=None,
            validate_on_checkpoint=False,
        )  # fmt: skip
        self.load_checkpoint(a.restore_from)

    def run(self, event: Any) -> None:
        self.model.train()
        event("resumed", step=self.step_scheduler.step, epoch=self.step_scheduler.epoch)
        for epoch in self.step_scheduler.epochs:
            self.step_scheduler.set_epoch(epoch)
            for batches in self.step_scheduler:
                loss = self.train_step(batches)
                idx = [i for b in batches for i in b["idx"]]
                event("step", step=self.step_scheduler.step, loss=loss.hex(), idx=idx)
                if self.step_scheduler.is_ckpt_step:
                    t0 = time.perf_counter()
                    self.save_checkpoint(epoch, self.step_scheduler.step, loss)
                    event("saved", step=self.step_scheduler.step, epoch=epoch, blocking_s=time.perf_counter() - t0)
        t0 = time.perf_counter()
        self._finalize_and_close_checkpointer()
        event("finalized", s=time.perf_counter() - t0)

    def train_step(self, batches: list[dict[str, Any]]) -> float:
        self.optimizer[0].zero_grad()
        total = torch.zeros(())
        for b in batches:
            ids = b["input_ids"]
            out = self.model(input_ids=ids, labels=ids)
            # every RNG the recipe restores plays a part: torch (dropout, here), Python, NumPy
            jitter = 1 + 1e-3 * (torch.rand(()) + random.random() + float(np.random.rand()))
            (out.loss * jitter / len(batches)).backward()
            total += out.loss.detach() * jitter / len(batches)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer[0].step()
        self.lr_scheduler[0].step(1)
        dist.all_reduce(total)
        return float(total) / self.world


class AsyncTinyRecipe(AsyncckptRecipeMixin, TinyRecipe):
    asyncckpt_options = {"timeout": 60.0}  # noqa: RUF012


def digest(recipe: TinyRecipe) -> dict[str, str]:
    """SHA-256 of every full model and optimizer tensor (gathered: collective), and of this
    rank's RNG, dataloader and step-scheduler state."""
    out = {}

    def h(x: Any) -> str:
        if isinstance(x, DTensor):
            x = x.full_tensor()
        if isinstance(x, torch.Tensor):
            return hashlib.sha256(x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        return hashlib.sha256(repr(x).encode()).hexdigest()

    for k, v in sorted(recipe.model.state_dict().items()):
        out[f"model.{k}"] = h(v)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    osd = get_optimizer_state_dict(recipe.model, recipe.optimizer[0], options=flat)
    for k, v in sorted(osd.items()):
        out[f"optim.{k}"] = h(v)
    out["sched"] = h(sorted(recipe.lr_scheduler[0].state_dict().items()))
    rng = recipe.rng.state_dict()
    out["rng.torch"] = h(rng["torch_rng_state"])
    out["rng.python"] = h(rng["random_rng_state"])
    out["rng.numpy"] = h(rng["np_keys"]) + h((rng["np_position"], rng["np_has_gauss"]))
    out["dataloader"] = h(json.dumps(recipe.dataloader.state_dict(), sort_keys=True, default=repr))
    out["step_scheduler"] = h(recipe.step_scheduler.state_dict())
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("impl", "rank", "world", "port", "ckpt_dir", "events"):
        p.add_argument(name)
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--keep", type=int, default=None)
    p.add_argument("--restore-from", default=None)
    a = p.parse_args()
    rank, world = int(a.rank), int(a.world)
    log = open(a.events, "a", buffering=1)

    def event(kind: str, **kw: Any) -> None:
        log.write(json.dumps({"t": time.time(), "rank": rank, "event": kind, **kw}) + "\n")

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # fmt: skip
    recipe = (AsyncTinyRecipe if a.impl == "asyncckpt" else TinyRecipe)(a, rank, world)
    recipe.setup()
    recipe.run(event)
    event("done", digest=digest(recipe))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
