"""Hugging Face Trainer integration: periodic checkpoints saved in the background.

    from asyncckpt.integrations.transformers import AsyncckptTrainer
    trainer = AsyncckptTrainer(model=model, args=TrainingArguments("out", save_steps=500, save_total_limit=3), ...)
    trainer.train(resume_from_checkpoint=True)      # or "out/checkpoint-1500"

Why a Trainer subclass and not a callback: a callback's ``on_save`` runs after the Trainer
already wrote the checkpoint, and callbacks cannot take over the Trainer's loading code
(``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_rng_state``), which
reads fixed file names. So :class:`AsyncckptTrainerMixin` overrides exactly the checkpoint
methods: ``_save_checkpoint`` stages the model, optimizer, scheduler, gradient scaler, RNG
states and ``TrainerState`` into one asyncckpt step and returns; a publisher thread makes the
step visible as ``OUTPUT_DIR/checkpoint-N`` once it committed and applies
``save_total_limit`` then (layout and mapping: :mod:`asyncckpt.integrations._hf_folders`).
Mix it into another Trainer subclass (TRL's ``SFTTrainer``, ...) with
``class MyTrainer(AsyncckptTrainerMixin, SFTTrainer)``.

What the Trainer's own synchronous save gets right and an asynchronous one can get wrong
(the concerns behind huggingface/transformers#23419 staying out of the Trainer), and what
this does about each:

- *Training mutates the weights while they are written*: ``Checkpointer.save()`` copies the
  state into staging buffers before it returns, so the step holds the weights of step N.
- *A half-written checkpoint taken for a complete one* (the Trainer writes into
  ``checkpoint-N`` directly; a kill leaves a folder ``resume_from_checkpoint=True`` picks):
  ``checkpoint-N`` appears only after the step committed, by an atomic rename.
- *Rotation deleting the last good checkpoint* while the new one is still being written:
  ``save_total_limit`` is applied when a save has committed, and never after a failed save.
- *Failures lost in a background thread*: a failed save is raised at the next save, and at
  the end of ``train()`` (which also waits for every pending save before returning).
- *Twice the memory*: one staging buffer the size of the state (in CPU memory, reused by
  every save; ``max_pending`` bounds how many), never a second copy on the GPU.

Tested single-process on CPU with transformers 5.25 (the ``asyncckpt[transformers]`` extra
pins it). DeepSpeed, FSDP, SageMaker MP, XLA and multi-process training raise
``NotImplementedError`` at construction; ``push_to_hub`` raises ``ValueError`` (it uploads
checkpoint folders, which here are pointers).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
from functools import partial
from typing import Any

import numpy as np
import torch
from transformers import Trainer
from transformers.trainer_utils import SaveStrategy

from .._errors import CheckpointError, CheckpointNotFoundError
from .._info import CheckpointInfo
from ..checkpointer._facade import Checkpointer
from ..checkpointer._loader import load
from ..roots._scheme import is_url
from . import _hf_folders as folders
from ._publish import Publisher, write_durably

__all__ = ["AsyncckptTrainer", "AsyncckptTrainerMixin"]

log = logging.getLogger("asyncckpt")

_FORMAT = "asyncckpt-transformers/1"
#: Checkpointer options this integration decides itself.
_MANAGED = ("root", "keep_last", "process_group", "on_commit", "allow_earlier_steps")


class AsyncckptTrainerMixin:
    """Makes a ``transformers.Trainer`` (subclass) save its checkpoints asynchronously.

    Keyword arguments (besides the Trainer's own):
        asyncckpt_root: the asyncckpt root (default ``OUTPUT_DIR/.asyncckpt-trainer``).
        asyncckpt_options: passed on to :class:`asyncckpt.Checkpointer` (``timeout``,
            ``max_pending``, ``direct_io``, ``huge_pages``, ...); ``keep_last`` is refused:
            use ``TrainingArguments(save_total_limit=)``.
        asyncckpt_deferred: deferred staging (docs/deferred.md): the model's and optimizer's
            tensors are copied while the next step's forward and backward run; its optimizer
            step waits for the copy.
    """

    _asyncckpt_publisher: Publisher

    def __init__(
        self, *args: Any, asyncckpt_root: str | os.PathLike[str] | None = None,
        asyncckpt_options: dict[str, Any] | None = None, asyncckpt_deferred: bool = False, **kwargs: Any,
    ) -> None:  # fmt: skip
        if not isinstance(asyncckpt_deferred, bool):
            raise TypeError(f"asyncckpt_deferred must be a bool, not {asyncckpt_deferred!r}")
        options = dict(asyncckpt_options or {})
        for k in _MANAGED:
            if k in options:
                hint = " (use TrainingArguments(save_total_limit=))" if k == "keep_last" else ""
                raise TypeError(f"asyncckpt_options: {k!r} is managed by {type(self).__name__}{hint}")
        if asyncckpt_root is not None and is_url(os.fspath(asyncckpt_root)):
            raise ValueError(
                "asyncckpt_root must be a local directory (checkpoint-N folders point into it); for an object "
                "store use asyncckpt_options={'mirror': 's3://...'}"
            )
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(targs, "push_to_hub", False):  # refused before the Trainer contacts the Hub
            raise ValueError(
                f"{type(self).__name__} does not support push_to_hub=True: it uploads checkpoint folders, "
                "which here point at an asyncckpt root"
            )
        super().__init__(*args, **kwargs)
        _check_supported(self)
        self._asyncckpt_root = None if asyncckpt_root is None else os.path.abspath(os.fspath(asyncckpt_root))
        self._asyncckpt_options = options
        self._asyncckpt_deferred = asyncckpt_deferred
        timeout = float(options.get("timeout", 600.0))
        self._asyncckpt_publisher = Publisher("asyncckpt-trainer", timeout + 30.0)
        self._asyncckpt_ck: Checkpointer | None = None
        self._asyncckpt_next = 0
        # the step a resume loaded: (pointer folder, its state); parts are dropped once applied
        self._asyncckpt_loaded: tuple[str, dict[str, Any]] | None = None

    # ------------------------------------------------------------------ training
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, resuming from asyncckpt checkpoints too; waits for every pending
        save before it returns and raises a save that failed.

        ``resume_from_checkpoint=True`` takes the newest ``checkpoint-N`` in the output
        directory that loads: one of ours whose step fails verification is logged and the next
        older one is tried. A path to a ``checkpoint-N`` folder the Trainer wrote itself is
        loaded by the Trainer as before, so a run can switch to asyncckpt mid-way.
        """
        t: Any = self
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._asyncckpt_newest_loadable(t.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({t.args.output_dir})")
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            resume_from_checkpoint = os.fspath(resume_from_checkpoint)
            if folders.read_pointer(resume_from_checkpoint) is not None:
                self._asyncckpt_state(resume_from_checkpoint)  # verify and load before training starts
        if self._asyncckpt_loaded is not None:
            _restore_trainer_state_file(*self._asyncckpt_loaded)
        failed = True
        try:
            out = super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
            failed = False
            return out
        finally:
            self._asyncckpt_loaded = None
            self._asyncckpt_finish(raise_failure=not failed)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Stage the checkpoint of this global step and return; it appears as ``checkpoint-N``
        once committed. Mirrors ``Trainer._save_checkpoint`` of transformers 5.25."""
        t: Any = self
        self._asyncckpt_publisher.raise_failure()  # an earlier save failed: stop here, as a failed write would
        n = t.state.global_step
        if t.hp_search_backend is None and trial is None:
            t.store_flos()
        run_dir = t._get_output_dir(trial=trial)
        if (
            t.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
            and t.state.best_global_step
        ):
            best = os.path.join(run_dir, folders.folder_name(t.state.best_global_step))
            # the Trainer checks that the best folder exists; the one being saved now counts
            if t.state.best_global_step == n or os.path.exists(best):
                t.state.best_model_checkpoint = best
        if t.args.should_save:
            _record_callback_states(t)
        trainer_state = json.dumps(dataclasses.asdict(t.state), indent=2, sort_keys=True) + "\n"
        state: dict[str, Any] = {"format": _FORMAT, "global_step": n, "model": t.model, "trainer_state": trainer_state}
        if not t.args.save_only_model:
            state["optimizer"] = t.optimizer
            state["scheduler"] = t.lr_scheduler
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
            state["rng"] = _rng_states()
        root = self._asyncckpt_root or os.path.join(run_dir, folders.ROOT_NAME)
        ck = self._asyncckpt_checkpointer(root, run_dir)
        step = max(n, self._asyncckpt_next)
        if self._asyncckpt_deferred and "optimizer" in state and t.optimizer is not None:
            handle = ck.save(step, state, until=t.optimizer)  # returns after the walk; the step waits
        else:
            handle = ck.save(step, state)  # returns once staged
        self._asyncckpt_next = step + 1
        publish = partial(
            _publish, run_dir=run_dir, global_step=n, trainer_state=trainer_state,
            limit=t.args.save_total_limit if t.args.should_save else None, best=t.state.best_model_checkpoint,
        )  # fmt: skip
        self._asyncckpt_publisher.after_commit(handle, publish)

    # ------------------------------------------------------------------ loading
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if folders.read_pointer(resume_from_checkpoint) is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
            return
        t: Any = self
        target = t.model if model is None else model
        target.load_state_dict(self._asyncckpt_take(resume_from_checkpoint, "model"), strict=True)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or folders.read_pointer(checkpoint) is None:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        t: Any = self
        state = self._asyncckpt_state(checkpoint)
        if "optimizer" in state:  # absent with save_only_model, as the Trainer's files are
            t.optimizer.load_state_dict(self._asyncckpt_take(checkpoint, "optimizer"))
            t.lr_scheduler.load_state_dict(self._asyncckpt_take(checkpoint, "scheduler"))

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or folders.read_pointer(checkpoint) is None:
            super()._load_scaler(checkpoint)  # type: ignore[misc]
            return
        t: Any = self
        if "scaler" in self._asyncckpt_state(checkpoint) and getattr(t.accelerator, "scaler", None) is not None:
            t.accelerator.scaler.load_state_dict(self._asyncckpt_take(checkpoint, "scaler"))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None or folders.read_pointer(checkpoint) is None:
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
            return
        if "rng" in self._asyncckpt_state(checkpoint):
            _set_rng_states(self._asyncckpt_take(checkpoint, "rng"))
        self._asyncckpt_loaded = None  # the last part a resume applies

    def _load_best_model(self) -> None:
        t: Any = self
        self._asyncckpt_publisher.drain()  # the best checkpoint may still be being published
        self._asyncckpt_publisher.raise_failure()
        best = t.state.best_model_checkpoint
        if best is None or folders.read_pointer(best) is None:
            super()._load_best_model()  # type: ignore[misc]
            return
        log.info("asyncckpt: loading the best model from %s (score: %s)", best, t.state.best_metric)
        t.model.load_state_dict(self._asyncckpt_read(best)["model"], strict=True)

    # ------------------------------------------------------------------ internals
    def _asyncckpt_checkpointer(self, root: str, run_dir: str) -> Checkpointer:
        ck = self._asyncckpt_ck
        if ck is not None and ck.root != os.path.realpath(root):
            self._asyncckpt_finish(raise_failure=True)  # another trial's output directory
            ck = None
        if ck is None:
            ck = Checkpointer(root, **self._asyncckpt_options)
            folders.remove_leftovers(run_dir, ck.root)
            steps = ck.steps()
            self._asyncckpt_next = steps[-1] + 1 if steps else 0
            self._asyncckpt_ck = ck
        return ck

    def _asyncckpt_finish(self, raise_failure: bool) -> None:
        """Wait for every pending save and its publication, close the Checkpointer, and raise
        the first failure (or, when training itself failed, only log it)."""
        try:
            if self._asyncckpt_ck is not None:
                self._asyncckpt_ck.wait_staged()  # the last deferred save's guard: no step follows it
            self._asyncckpt_publisher.drain()
        finally:
            self._asyncckpt_publisher.stop()
            ck, self._asyncckpt_ck = self._asyncckpt_ck, None
            if ck is not None:
                try:
                    ck.close()
                except BaseException as e:  # noqa: BLE001 - raised (or logged) below
                    self._asyncckpt_publisher.record(e)
        if raise_failure:
            self._asyncckpt_publisher.raise_failure()
        else:
            try:
                self._asyncckpt_publisher.raise_failure()
            except BaseException as e:  # noqa: BLE001 - training's own error is the one raised
                log.error("asyncckpt: a checkpoint save failed as well: %s: %s", type(e).__name__, e)

    def _asyncckpt_read(self, folder: str) -> dict[str, Any]:
        """The verified state ``folder`` points at (``CheckpointError`` if it does not load)."""
        p = folders.read_pointer(folder)
        if p is None:
            raise CheckpointError(f"{folder} is not an asyncckpt checkpoint folder")
        state = load(p.root, p.step)
        if not (isinstance(state, dict) and state.get("format") == _FORMAT and "model" in state):
            raise CheckpointError(f"step {p.step} of {p.root} is not a Trainer checkpoint")
        return state

    def _asyncckpt_state(self, folder: str) -> dict[str, Any]:
        key = os.path.realpath(folder)
        if self._asyncckpt_loaded is None or self._asyncckpt_loaded[0] != key:
            self._asyncckpt_loaded = (key, self._asyncckpt_read(folder))
        return self._asyncckpt_loaded[1]

    def _asyncckpt_take(self, folder: str, part: str) -> Any:
        """One part of the loaded state, dropped from memory once taken (read again if asked twice)."""
        state = self._asyncckpt_state(folder)
        if part not in state:
            state = self._asyncckpt_read(folder)
            self._asyncckpt_loaded = (os.path.realpath(folder), state)
        return state.pop(part)

    def _asyncckpt_newest_loadable(self, output_dir: str) -> str | None:
        for _, folder in reversed(folders.checkpoint_folders(output_dir)):
            try:
                if folders.read_pointer(folder) is None:
                    return folder  # the Trainer's own checkpoint: it loads it itself
                self._asyncckpt_state(folder)
                return folder
            except CheckpointError as e:
                level = logging.INFO if isinstance(e, CheckpointNotFoundError) else logging.WARNING
                log.log(level, "asyncckpt: not resuming from %s: %s", folder, e)
        return None


class AsyncckptTrainer(AsyncckptTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints are saved asynchronously by asyncckpt."""


def _check_supported(t: Any) -> None:
    unsupported = [
        name
        for name, on in (
            ("DeepSpeed", t.is_deepspeed_enabled),
            ("FSDP", t.is_fsdp_enabled),
            ("FSDP on XLA", getattr(t, "is_fsdp_xla_enabled", False)),
            ("multi-process training", t.args.world_size > 1),
        )
        if on
    ]
    from transformers.utils.import_utils import is_sagemaker_mp_enabled, is_torch_xla_available

    if is_sagemaker_mp_enabled():
        unsupported.append("SageMaker model parallelism")
    if is_torch_xla_available():
        unsupported.append("XLA")
    if unsupported:
        raise NotImplementedError(f"{type(t).__name__} does not support {', '.join(unsupported)} yet")


def _record_callback_states(t: Any) -> None:
    """Store the states of stateful callbacks and of ``TrainerControl`` in ``t.state``, as the
    Trainer does before it writes ``trainer_state.json`` (so that a resume restores them)."""
    from transformers.trainer_callback import ExportableState

    for cb in [*t.callback_handler.callbacks, t.control]:
        if isinstance(cb, ExportableState):
            name = type(cb).__name__
            if isinstance(t.state.stateful_callbacks[name], list):
                t.state.stateful_callbacks[name].append(cb.state())
            else:
                t.state.stateful_callbacks[name] = cb.state()


def _publish(
    info: CheckpointInfo, *, run_dir: str, global_step: int, trainer_state: str,
    limit: int | None, best: str | None,
) -> None:  # fmt: skip
    """On the publisher thread, once the step committed: the folder, then ``save_total_limit``."""
    root = str(info.path.parent)
    folder = folders.publish(run_dir, root, info.step, global_step, trainer_state)
    folders.rotate(run_dir, root, limit, folder, best)


def _restore_trainer_state_file(folder: str, state: dict[str, Any]) -> None:
    """The Trainer reads ``trainer_state.json`` from the folder itself: make it the step's."""
    path = os.path.join(folder, folders.TRAINER_STATE_NAME)
    text = state["trainer_state"]
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    except FileNotFoundError:
        pass
    write_durably(path, text.encode("utf-8"))


def _rng_states() -> dict[str, Any]:
    """The RNG states the Trainer saves: Python's, NumPy's, torch's CPU and CUDA generators."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.random.set_rng_state(states["cuda"])
