"""torchtitan integration: the trainer's checkpoints saved in the background by asyncckpt.

    from asyncckpt.integrations.torchtitan import AsyncckptCheckpointManager
    config = llama3_debugmodel()                    # any torchtitan Trainer.Config
    config.checkpoint = AsyncckptCheckpointManager.Config(enable=True, interval=500, keep_latest_k=3)

**The extension point.** torchtitan 0.3.0's ``Trainer.Config.checkpoint`` is typed
``BaseCheckpointManager.Config`` and the trainer builds its manager with
``config.checkpoint.build(dataloader=, model_parts=, optimizers=, lr_schedulers=, states=,
sd_adapter=, base_folder=)``, then calls only ``load``, ``save``, ``maybe_wait_for_staging``
and ``close``. ``BaseCheckpointManager`` is torchtitan's documented contract for that (its own
``TorchCheckpointingManager`` plugs in the same way), so this is a drop-in manager selected by
config: a subclass of ``BaseCheckpointManager`` with its own ``Config``, not a subclass of the
DCP ``CheckpointManager``, whose DCP calls, async process group and purge thread are exactly
what it replaces.

**What is kept.** The states torchtitan saves (``model`` through its ``ModelWrapper``, the
flat ``optimizer`` state, ``lr_scheduler``, ``dataloader``, ``train_state`` and any other
``states``), its save policy (``interval``, ``last_step``, ``enable_first_step_checkpoint``,
``load_only``), ``load_step``, ``exclude_from_loading`` (same checks), the model-only last
save in ``export_dtype`` (``last_save_model_only``) and the model-only seed checkpoint at
step 0, ``keep_latest_k``, and ``initial_load_path`` / ``initial_load_model_only``.

**Mapping.** The checkpoint folder (``dump_folder/folder``) is an asyncckpt root: torchtitan's
``step-N`` is asyncckpt's ``step_NNNNNNNN/`` (step N, 8 digits), which appears only once
committed (atomically; a kill mid-save leaves nothing that loads). torchtitan DCP ``step-N``
folders already in that folder stay there and still load: a resume takes the newest step of
either kind, so a running job switches without starting over. ``initial_load_path`` may name
a DCP checkpoint folder, an asyncckpt root or one of its ``step_NNNNNNNN`` directories.

**What differs, and why.** ``save()`` returns once the state is copied into staging buffers
(training goes on while it is written, fsynced and committed), so ``maybe_wait_for_staging``
has nothing to wait for and there is no ``async_mode``. ``keep_latest_k`` retires old steps
only after a newer one committed, never while it is being written. A failed save is raised at
the next ``save()`` and at ``close()`` (torchtitan's trainer calls it at the end). The
dataloader state cannot be resharded (torchtitan asserts the same, pytorch/torchtitan#811):
resuming on another number of ranks, or on as many with another data-parallel degree (the
``world_size`` its saved dataloader state records: 2 x 2 saved, FSDP over 4 resuming), raises
``ValueError`` up front unless ``exclude_from_loading`` names ``"dataloader"``; values that
are not DTensors are then taken from saved rank 0 (DCP's key dedupe takes one rank's value
too). Not supported: Hugging Face safetensors export and import (``last_save_in_hf``,
``initial_load_in_hf``) and remote folders (``NotImplementedError`` when the config is made).

Tested with torchtitan 0.3.0 (the ``asyncckpt[torchtitan]`` extra pins it): its ``debugmodel``
through its own ``parallelize_llama`` (FSDP2) on 4 gloo ranks, SIGKILLed, resumed on 4 and 2.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP

from .. import reading
from ..checkpointer._facade import Checkpointer

__all__ = ["AsyncckptCheckpointManager"]

log = logging.getLogger("asyncckpt")

#: The key of the small record each step carries (format, model-only, export dtype).
META = "asyncckpt_torchtitan"
_FORMAT = "asyncckpt-torchtitan/1"
#: torchtitan's own DCP checkpoint folders (``CheckpointManager._create_checkpoint_id``).
_DCP_STEP = re.compile(r"step-(\d+)")
_STEP_DIR = re.compile(r"step_(\d{8})")


class AsyncckptCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]  # torchtitan is untyped
    """torchtitan checkpoint manager whose saves run in the background through asyncckpt.

    Built by torchtitan's trainer from :class:`AsyncckptCheckpointManager.Config` (set it as
    ``Trainer.Config.checkpoint``); the keyword arguments are the ones it passes to every
    checkpoint manager.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        timeout: float = 600.0
        """Seconds one save (and one load) may take end to end, waits for other ranks included."""

        max_pending: int = 1
        """Saves in flight at once; each holds a CPU staging buffer the size of a rank's state."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if not isinstance(self.timeout, (int, float)) or isinstance(self.timeout, bool) or not self.timeout > 0:
                raise ValueError(f"timeout must be a positive number of seconds, not {self.timeout!r}")
            if isinstance(self.max_pending, bool) or not isinstance(self.max_pending, int) or self.max_pending < 1:
                raise ValueError(f"max_pending must be an int >= 1, not {self.max_pending!r}")
            unsupported = [
                name for name in ("last_save_in_hf", "initial_load_in_hf", "initial_load_in_hf_quantized")
                if getattr(self, name)
            ]  # fmt: skip
            if unsupported:
                raise NotImplementedError(
                    f"AsyncckptCheckpointManager does not support {', '.join(unsupported)}: Hugging Face "
                    "safetensors export/import stays with torchtitan's CheckpointManager"
                )
            if _is_remote(self.folder):
                raise NotImplementedError(f"AsyncckptCheckpointManager saves to local folders, not {self.folder!r}")

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future: Any = None
        if not self.enable:
            return
        self.folder = os.path.join(base_folder, config.folder)
        if _is_remote(self.folder):
            raise NotImplementedError(f"AsyncckptCheckpointManager saves to local folders, not {self.folder!r}")
        self.interval = config.interval
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.sd_adapter = sd_adapter
        # every rank builds it (a collective construction); rank 0 owns the root until close()
        self.checkpointer = Checkpointer(
            self.folder,
            keep_last=config.keep_latest_k or None,
            timeout=config.timeout,
            max_pending=config.max_pending,
        )

    # ------------------------------------------------------------------ saving
    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Stage the checkpoint of ``curr_step`` and return (True) when torchtitan's policy says
        to save; the last step's save is durable before this returns, as torchtitan's is."""
        if not self._should_save(curr_step, last_step):
            return False
        begin = time.monotonic()
        model_only = last_step and self.last_save_model_only
        state = self._model_only_state() if model_only else {**self.states}
        state[META] = {
            "format": _FORMAT,
            "model_only": model_only,
            "export_dtype": str(self.export_dtype).removeprefix("torch.") if model_only else None,
        }
        self.save_future = self.checkpointer.save(curr_step, state)  # returns once staged
        if last_step:
            self._wait_for_saving()
        log.info(
            "asyncckpt: %s checkpoint of step %d %s in %.2f s",
            "model-only" if model_only else "full", curr_step, "saved" if last_step else "staged",
            time.monotonic() - begin,
        )  # fmt: skip
        return True

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        """torchtitan's rule (``CheckpointManager._should_save``)."""
        if self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def _model_only_state(self) -> dict[str, Any]:
        """The model's state in ``export_dtype`` (floating-point tensors only), as torchtitan's
        last save writes it."""
        sd = self.states[MODEL].state_dict()
        dtype = self.export_dtype
        return {
            MODEL: {
                k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype else v
                for k, v in sd.items()
            }
        }

    def _maybe_wait_for_staging(self) -> None:
        # save() returned after copying the state: the optimizer step may change it freely
        return

    def _wait_for_saving(self) -> None:
        """Wait until every staged save committed; raise the first failure."""
        self.checkpointer.flush()
        self.save_future = None

    def _close(self) -> None:
        """Wait for pending saves, then release the root (raises a save that failed)."""
        self.save_future = None
        self.checkpointer.close()

    # ------------------------------------------------------------------ loading
    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Restore ``step`` (-1: the newest step, asyncckpt's or a torchtitan DCP ``step-N``;
        with none, ``initial_load_path``). Returns whether anything was loaded."""
        begin = time.monotonic()
        ours = self.checkpointer.steps()  # rank 0 looks; every rank gets the same list
        theirs = _dcp_steps(self.folder)
        if step != -1:
            if step in ours:
                self._load_step(self.folder, step, explicit=True)
            elif step in theirs:
                self._load_dcp(theirs[step], model_only=step == 0)
            else:
                raise FileNotFoundError(f"--checkpoint.load_step={step} not found in {self.folder}")
        elif ours or theirs:
            newest_ours = ours[-1] if ours else -1
            newest_theirs = max(theirs, default=-1)
            if newest_theirs > newest_ours:  # a job switching from torchtitan's own checkpoints
                self._load_dcp(theirs[newest_theirs], model_only=newest_theirs == 0)
            else:
                self._load_step(self.folder, newest_ours, explicit=False)
        elif self.initial_load_path:
            self._load_initial(self.initial_load_path)
        else:
            log.info("asyncckpt: no checkpoint in %s, a fresh start", self.folder)
            return False
        log.info("asyncckpt: loaded the checkpoint in %.2f s", time.monotonic() - begin)
        return True

    def _targets(self, model_only: bool) -> dict[str, Any]:
        """What a load restores: the model alone, or every state but the excluded ones
        (torchtitan's ``_states_to_load``: an excluded key that is not a state is an error)."""
        if model_only:
            return {MODEL: self.states[MODEL]}
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"{key} not found in state_dict.")
        return {k: v for k, v in self.states.items() if k not in self.exclude_from_loading and v is not None}

    def _load_step(self, root: str, step: int, *, explicit: bool) -> None:
        """Load asyncckpt step ``step`` of ``root`` (``explicit=False``: the newest that
        verifies, falling back to an older one when it does not)."""
        step_dir, manifest = reading.resolve_step(root, step)
        meta = _step_meta(step_dir, manifest)
        model_only = bool(meta.get("model_only")) or step == 0
        if model_only and step != 0 and not explicit:
            raise ValueError(
                f"the newest checkpoint in {root} (step {step}) is the model-only export of a finished run "
                "(last_save_model_only=True): training cannot resume from it; set checkpoint.load_step to a "
                "full checkpoint's step, or use another checkpoint folder"
            )
        into = self._targets(model_only)
        resharding = _check_reshardable(into, step_dir, manifest, f"step {step} in {root}")
        log.info("asyncckpt: loading step %d from %s%s", step, root, " (model only)" if model_only else "")
        # per_rank="rank0" across a change of world size: the dataloader (per rank) is excluded
        # by then, and the other plain values are the same on every saved rank
        self.checkpointer.load(step if explicit else None, into=into, per_rank="rank0" if resharding else "error")

    def _load_dcp(self, path: str, *, model_only: bool) -> None:
        """Load a torchtitan DCP checkpoint folder the way torchtitan does (model keys flat)."""
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        log.info("asyncckpt: loading torchtitan's DCP checkpoint %s%s", path, " (model only)" if model_only else "")
        targets = self._targets(model_only)
        flat = {k: v for k, v in targets.items() if k != MODEL}
        flat.update(self.states[MODEL].state_dict())
        dcp_load(flat, checkpoint_id=path)
        self.states[MODEL].load_state_dict(flat)

    def _load_initial(self, path: str) -> None:
        """``initial_load_path``: a DCP folder, an asyncckpt root, or one of its step directories
        (read, never owned: it is another run's)."""
        from ..checkpointer._loader import load

        if not os.path.isdir(path):
            raise ValueError(f"Checkpoint.initial_load_path is invalid: {path}")
        if os.path.isfile(os.path.join(path, ".metadata")):
            self._load_dcp(path, model_only=self.initial_load_model_only)
            return
        m = _STEP_DIR.fullmatch(os.path.basename(os.path.normpath(path)))
        root, step = (os.path.dirname(os.path.normpath(path)), int(m.group(1))) if m else (path, None)
        step_dir, manifest = reading.resolve_step(root, step)  # None: the newest that is complete
        model_only = self.initial_load_model_only or bool(_step_meta(step_dir, manifest).get("model_only"))
        into = self._targets(model_only)
        same = not _check_reshardable(into, step_dir, manifest, step_dir)
        log.info("asyncckpt: initial load of %s%s", step_dir, " (model only)" if model_only else "")
        load(root, manifest.step, into=into, rank=_rank() if same else None, per_rank="rank0")


def _check_reshardable(into: dict[str, Any], step_dir: str, manifest: Any, what: str) -> bool:
    """Whether loading ``what`` (``step_dir``, saved by ``manifest.world_size`` ranks) into
    ``into`` changes the world size. ``ValueError`` when ``into`` holds the dataloader and its
    saved state cannot follow: another world size, or the same one with another data-parallel
    degree (the ``world_size`` field of torchtitan's saved dataloader state, e.g. 2 x 2 saved,
    FSDP over 4 loading), which torchtitan's ``load_state_dict`` asserts deep inside the load."""
    saved_world = int(manifest.world_size)
    world = dist.get_world_size() if dist.is_initialized() else 1
    loader = into.get(DATALOADER)
    if loader is None:
        return saved_world != world
    fix = "add 'dataloader' to checkpoint.exclude_from_loading to start its data afresh"
    if saved_world != world:
        raise ValueError(
            f"{what} was saved by {saved_world} ranks and this job has {world}: the dataloader state cannot "
            f"be resharded (torchtitan asserts the same, pytorch/torchtitan#811); {fix}"
        )
    saved_dp = _rank0_values(step_dir, manifest, DATALOADER).get("world_size")
    dp = getattr(loader, "dp_world_size", None)
    # the same on every rank (rank 0's record, the job's dp degree): all raise or none does
    if isinstance(saved_dp, int) and isinstance(dp, int) and saved_dp != dp:
        raise ValueError(
            f"{what} was saved with data-parallel degree {saved_dp} and this job's is {dp} (both on {world} ranks): "
            f"the dataloader state cannot be resharded (torchtitan asserts the same); {fix}"
        )
    return False


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _is_remote(path: str) -> bool:
    return "://" in path


def _dcp_steps(folder: str) -> dict[int, str]:
    """torchtitan's own DCP checkpoints in ``folder``: step -> ``step-N`` folder (those holding
    DCP's ``.metadata``, as torchtitan's ``_find_load_step`` requires)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return {}
    out: dict[int, str] = {}
    for name in names:
        m = _DCP_STEP.fullmatch(name)
        path = os.path.join(folder, name)
        if m and os.path.isfile(os.path.join(path, ".metadata")):
            out[int(m.group(1))] = path
    return out


def _step_meta(step_dir: str, manifest: Any) -> dict[str, Any]:
    """The step's ``asyncckpt_torchtitan`` record (``{}`` for a step saved otherwise)."""
    return _rank0_values(step_dir, manifest, META)


def _rank0_values(step_dir: str, manifest: Any, top: str) -> dict[str, Any]:
    """The plain values right under ``top`` in saved rank 0's state (``{}`` if none), read
    from its key tree alone (no tensor data)."""
    entries, _ = reading.read_rank_outline(step_dir, manifest, 0)
    return {str(e.path[1]): e.value for e in entries if len(e.path) == 2 and e.path[0] == top and e.kind == "value"}
