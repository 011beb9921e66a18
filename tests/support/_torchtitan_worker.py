"""One rank of a torchtitan training run on CPU: its Llama3 ``debugmodel``, its own
``parallelize_llama`` (FSDP2 over every rank, gloo), its optimizer and LR scheduler containers,
its ``ParallelAwareDataloader``, and a checkpoint manager built from its config, driven the way
torchtitan's ``Trainer.train`` drives it (``load``, then per step ``maybe_wait_for_staging``
before the optimizer step and ``save(step, last_step=...)``, ``close`` at the end).

Run as ``python _torchtitan_worker.py RANK WORLD PORT JOB.json``; JOB keys:

* ``manager``: ``"asyncckpt"`` (:class:`AsyncckptCheckpointManager`) or ``"dcp"`` (torchtitan's
  own ``CheckpointManager``, ``async_mode="async"``);
* ``dump``: the trainer's dump folder (checkpoints in ``dump/checkpoint``); ``steps``,
  ``interval``, ``keep``, ``exclude``, ``last_model_only``, ``export_dtype``;
* ``kill_after``: after this step's ``save()`` returns, rank 0 creates ``dump/saved-N`` and
  goes on (the test SIGKILLs every rank then); ``out/progress.json`` holds the losses so far;
* ``out``: rank 0 writes ``out/result.json`` (losses, resumed step, timings) and, gathered from
  every rank, ``out/loaded.pt`` (the state right after ``load``) and ``out/state-N.pt`` (the
  state after each step in ``dump_at``);
* ``expect_error``: a first manager (without ``exclude``) must refuse to load with a
  ``ValueError`` (recorded), then the job goes on with one that excludes;
* ``tp``: the tensor-parallel degree (default 1): torchtitan's own TP plan over its ``tp`` mesh
  dimension, FSDP2 over ``fsdp`` (``world / tp``); ``seed``: the initial weights' seed (default 0);
* ``dcp_save_at`` and ``dcp_dir``: after that step's ``save()``, the same states (all but the
  dataloader, which cannot reshard) are also saved with ``dcp.save`` into ``dcp_dir``, the oracle;
* ``dcp_load``: after the manager's ``load``, a second fresh model, optimizer, scheduler and train
  state (``seed + 1``) are filled by ``dcp.load`` from that directory; rank 0 writes them,
  gathered, to ``out/dcp_loaded.pt``.

Caveats of torchtitan on CPU handled here: its mesh defaults to CUDA (``device_type``), its
FlexAttention has no CPU backward (the layers use its ``ScaledDotProductAttention``; one
document per sequence makes that the same causal mask), gloo refuses FSDP2's PREMUL_SUM
(a plain sum is forced; the loss is divided by the global token count, as torchtitan does),
and triton (``_torchtitan.prepare``). With ``tp > 1`` also what torchtitan's ``Trainer`` does
before it parallelizes (``update_from_config`` imports the whole trainer, tensorboard included,
so its two steps are done here): the SPMD backend is set and the model config gets its TP
sharding (``set_llama3_sharding_config``, sequence parallel on, torchtitan's default); the loss
is torchtitan's ``cross_entropy_loss`` on the vocab-sharded logits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import _torchtitan

_torchtitan.prepare()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402

SEQ = 32
BATCH = 2
VOCAB = 2048


class Tokens(IterableDataset[tuple[dict[str, torch.Tensor], torch.Tensor]]):
    """Deterministic token sequences per data-parallel rank; Stateful (its position), so the
    dataloader's state says where the data resumes."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.index = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            g = torch.Generator().manual_seed(1_000_003 * self.dp_rank + self.index)
            self.index += 1
            tok = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            yield {"input": tok[:-1]}, tok[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.index = sd["index"]


class TrainState:
    """What torchtitan's ``Trainer`` saves as ``train_state`` (it is Stateful itself)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def build(world: int, rank: int, tp: int = 1, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """torchtitan's debugmodel, parallelized by torchtitan (FSDP2 over ``world / tp`` ranks x TP
    over ``tp``), with its optimizer, scheduler and dataloader."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry, parallelize_llama

    parallel_dims_module.device_type = "cpu"  # its mesh defaults to CUDA
    config = model_registry("debugmodel").model
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        # what Trainer's update_from_config does: RoPE tables for the training length
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ)
    training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, mixed_precision_param="float32")
    parallelism = ParallelismConfig(
        spmd_backend="partial_dtensor", data_parallel_shard_degree=-1, tensor_parallel_degree=tp
    )
    if tp > 1:
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        dist_utils.set_spmd_backend(parallelism.spmd_backend)
        set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    with torch.device("meta"):
        model = config.build()
    model = parallelize_llama(
        model, parallel_dims=dims, training=training, parallelism=parallelism,
        compile_config=CompileConfig(), ac_config=None, dump_folder="",
    )  # fmt: skip
    torch.manual_seed(seed)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    disable_fsdp_gradient_division(model)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    opt = default_adamw(lr=8e-4)
    opt.implementation = "for-loop"
    optimizers = opt.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(
        warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
    ).build(optimizers=optimizers, training_steps=100)
    dp_rank = dims.get_mesh("fsdp").get_local_rank()  # the tp ranks of one dp rank see the same data
    loader = ParallelAwareDataloader(Tokens(dp_rank), dp_rank=dp_rank, dp_world_size=world // tp, batch_size=BATCH)
    return model, optimizers, schedulers, loader


def manager(job: dict[str, Any], model: Any, optimizers: Any, schedulers: Any, loader: Any, ts: TrainState,
            exclude: list[str]) -> Any:  # fmt: skip
    common = dict(
        enable=True, folder="checkpoint", interval=job["interval"], keep_latest_k=job.get("keep", 0),
        last_save_model_only=job.get("last_model_only", True), export_dtype=job.get("export_dtype", "float32"),
        exclude_from_loading=exclude,
    )  # fmt: skip
    if job["manager"] == "dcp":
        from torchtitan.components.checkpoint import CheckpointManager

        config: Any = CheckpointManager.Config(async_mode="async", **common)  # type: ignore[arg-type]
    else:
        from asyncckpt.integrations.torchtitan import AsyncckptCheckpointManager

        config = AsyncckptCheckpointManager.Config(**common)  # type: ignore[arg-type]
    return config.build(
        dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": ts}, sd_adapter=None, base_folder=job["dump"],
    )  # fmt: skip


def gathered(model: Any, optimizers: Any, schedulers: Any, ts: TrainState) -> dict[str, Any]:
    """Every saved value as a whole tensor or plain value (a collective: all-gathers DTensors)."""
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpoint import ModelWrapper

    def whole(v: Any) -> Any:
        return v.full_tensor() if isinstance(v, DTensor) else v.clone() if isinstance(v, torch.Tensor) else v

    out = {f"model.{k}": whole(v) for k, v in ModelWrapper([model]).state_dict().items()}
    out.update({f"optimizer.{k}": whole(v) for k, v in optimizers.state_dict().items()})
    out["lr_scheduler.last_epoch"] = schedulers.state_dict()["last_epoch"]
    out["train_state"] = ts.state_dict()
    return out


def oracle_states(model: Any, optimizers: Any, schedulers: Any, ts: TrainState) -> dict[str, Any]:
    """The Stateful objects torchtitan's own ``CheckpointManager`` hands DCP, but the dataloader."""
    from torchtitan.components.checkpoint import ModelWrapper

    return {"model": ModelWrapper([model]), "optimizer": optimizers, "lr_scheduler": schedulers, "train_state": ts}


def main() -> None:
    rank, world, port, job_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    with open(job_path) as f:
        job = json.load(f)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = job["out"]
    result: dict[str, Any] = {"losses": {}, "blocking_s": []}
    tp, seed = job.get("tp", 1), job.get("seed", 0)
    model, optimizers, schedulers, loader = build(world, rank, tp, seed)
    ts = TrainState()
    if job.get("expect_error"):
        first = manager(job, model, optimizers, schedulers, loader, ts, exclude=[])
        try:
            first.load(step=-1)
            result["refused"] = None
        except ValueError as e:
            result["refused"] = str(e)
        first.close()
    ck = manager(job, model, optimizers, schedulers, loader, ts, exclude=job.get("exclude", []))
    ck.load(step=job.get("load_step", -1))
    result["resumed_at"] = ts.step
    result["lr_last_epoch_after_load"] = schedulers.state_dict()["last_epoch"]
    if job.get("dump_loaded"):
        loaded = gathered(model, optimizers, schedulers, ts)
        if rank == 0:
            torch.save(loaded, os.path.join(out, "loaded.pt"))
    if job.get("dcp_load"):  # the oracle: DCP's own load of the same step into fresh objects
        import torch.distributed.checkpoint as dcp

        theirs = (*build(world, rank, tp, seed + 1)[:3], TrainState())
        dcp.load(oracle_states(*theirs), checkpoint_id=job["dcp_load"])
        loaded = gathered(*theirs)
        if rank == 0:
            torch.save(loaded, os.path.join(out, "dcp_loaded.pt"))
        del theirs, loaded
    data = iter(loader)
    while ts.step < job["steps"]:
        ts.step += 1
        inputs, labels = next(data)
        ts.ntokens_seen += labels.numel()
        logits = model(inputs["input"])
        if tp == 1:
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        else:  # vocab-sharded logits (a DTensor): torchtitan's loss-parallel cross entropy
            from torchtitan.components.loss import cross_entropy_loss

            loss = cross_entropy_loss(logits, labels, global_vocab_size=VOCAB)
        loss = loss / (labels.numel() * (world // tp))  # torchtitan scales by the global token count
        loss.backward()
        ck.maybe_wait_for_staging()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        result["losses"][ts.step] = total.item() / tp  # each tp rank holds its dp rank's loss
        t = time.perf_counter()
        if ck.save(ts.step, last_step=ts.step == job["steps"]):
            result["blocking_s"].append(time.perf_counter() - t)
        if ts.step == job.get("dcp_save_at"):
            import torch.distributed.checkpoint as dcp

            dcp.save(oracle_states(model, optimizers, schedulers, ts), checkpoint_id=job["dcp_dir"])
        if ts.step in job.get("dump_at", []):
            state = gathered(model, optimizers, schedulers, ts)
            if rank == 0:
                torch.save(state, os.path.join(out, f"state-{ts.step}.pt"))
        if rank == 0:  # the losses so far survive a kill
            _write_json(os.path.join(out, "progress.json"), result)
            if ts.step == job.get("kill_after"):
                _write_json(os.path.join(job["dump"], f"saved-{ts.step}"), {})
    ck.close()
    if rank == 0:
        if job["manager"] == "asyncckpt":  # rank 0's saves: staged -> committed (durable), on average
            st = ck.checkpointer.statistics()
            result["durable_s_mean"] = st.total_s / max(1, st.saves_committed)
        _write_json(os.path.join(out, "result.json"), result)
    dist.destroy_process_group()


def _write_json(path: str, value: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
