"""torchtitan with asyncckpt's checkpoint manager: a config registry module for torchtitan's launcher.

    pip install "asyncckpt[torchtitan]"
    PYTHONPATH=examples torchrun --nproc_per_node=8 -m torchtitan.train \\
        --module torchtitan_asyncckpt --config llama3_debugmodel_asyncckpt \\
        --checkpoint.interval 10 --checkpoint.keep_latest_k 3

Any torchtitan config becomes one whose checkpoints are saved in the background by passing it
through :func:`use_asyncckpt`: the checkpoint options it already has (folder, interval,
keep_latest_k, load_step, exclude_from_loading, last_save_model_only, export_dtype, ...) are
kept and ``--checkpoint.*`` still overrides them on the command line, plus ``--checkpoint.timeout``
and ``--checkpoint.max_pending``. Run the same command again after a kill and it resumes from
the newest complete step in ``outputs/checkpoint`` (also from a torchtitan DCP ``step-N`` there:
a running job can switch). To resume on another number of GPUs, add
``--checkpoint.exclude_from_loading dataloader`` (torchtitan cannot reshard its data position).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from asyncckpt.integrations.torchtitan import AsyncckptCheckpointManager


def use_asyncckpt(config: Any, **options: Any) -> Any:
    """``config`` (a torchtitan ``Trainer.Config``) with its checkpoint manager replaced by
    :class:`AsyncckptCheckpointManager`, its checkpoint options kept, ``options`` applied on top."""
    from torchtitan.components.checkpointer import BaseCheckpointManager

    kept = {f.name: getattr(config.checkpoint, f.name) for f in dataclasses.fields(BaseCheckpointManager.Config)}
    config.checkpoint = AsyncckptCheckpointManager.Config(**{**kept, "enable": True, **options})
    return config


def llama3_debugmodel_asyncckpt() -> Any:
    """torchtitan's Llama3 debug model, checkpointed every 10 steps by asyncckpt, the last step
    exported model-only in bfloat16."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return use_asyncckpt(llama3_debugmodel(), interval=10, keep_latest_k=3, export_dtype="bfloat16")
