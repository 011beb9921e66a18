"""NeMo Automodel integration: a recipe's checkpoints saved in the background by asyncckpt.

    from asyncckpt.integrations.nemo_automodel import with_asyncckpt
    from nemo_automodel.recipes.llm.train_ft import TrainFinetuneRecipeForNextTokenPrediction

    Recipe = with_asyncckpt(TrainFinetuneRecipeForNextTokenPrediction, timeout=600)
    recipe = Recipe(cfg)                    # cfg as for the recipe itself
    recipe.setup()                          # resumes as before: checkpoint.restore_from, else LATEST
    recipe.run_train_validation_loop()      # saves every ckpt_every_steps; waits for the last save at the end

Why a recipe mixin and not a replacement ``Checkpointer`` (``checkpoint:`` config): NeMo's
``BaseRecipe.save_checkpoint`` drives the Checkpointer piece by piece (``lifecycle.reserve``,
``save_on_global_ranks``, ``save_on_dp_ranks``, ``save_model``, ``save_optimizer``, a
``torch.save`` per other object, ``save_config``, ``lifecycle.publish``), each writing its
own files into the step's directory with its own barriers; a drop-in Checkpointer would have
to take each of those calls as a separate write and could not make them one atomic step.
:class:`AsyncckptRecipeMixin` overrides exactly ``save_checkpoint``, ``load_checkpoint`` and
``_finalize_and_close_checkpointer``: it collects the same state the recipe's
``save_checkpoint`` collects, from the same tracked attributes and through NeMo's own state
wrappers (``ModelState``, ``OptimizerState``: the same keys, PEFT adapter filtering and tied
heads), and saves it as one asyncckpt step; it keeps NeMo's directory contract (layout and
mapping: :mod:`asyncckpt.integrations._nemo_folders`).

What is saved per step, on every rank:

- ``model``: ``ModelState(model, is_peft).state_dict()`` (DTensors under FSDP2; with PEFT only
  the adapter, gathered on rank 0 as NeMo gathers it for ``adapter_model.safetensors``);
- ``optim``: ``OptimizerState(model, optimizer, lr_scheduler).state_dict()`` (optimizer and
  scheduler, as NeMo's ``optim/`` holds them);
- ``rng``: every tracked ``StatefulRNG``, per rank (NeMo: ``rng/rng_global_rank_R.pt``);
- ``dataloader``: every tracked ``StatefulDataLoader``, per rank (NeMo: per DP rank);
- ``distributed``: objects NeMo saves through DCP (``use_distributed_checkpointing``);
- ``other``: every other tracked object with a ``state_dict`` (the step scheduler, ...;
  NeMo: ``<key>.pt`` written by rank 0, restored on every rank; here each rank restores its own).

Differences from NeMo's own save, by design: ``LATEST`` moves when the step committed, not at
the next save or ``finalize()`` (NeMo publishes an async checkpoint only then, so a job
killed in between resumes from the one before); no HF-safetensors ``model/`` folder and no
consolidated export (``asyncckpt export ROOT --step N --key model --to model.safetensors``
writes one from any step); ``checkpoint.is_async`` and ``wait_for_staging`` are not used
(every save is asynchronous); ``msc://`` checkpoint directories raise ``NotImplementedError``.
A folder NeMo wrote itself still loads (through NeMo's own code), so a running job can switch.
Resuming needs the world size that saved per-rank state (RNG, dataloader), as NeMo's does;
model and optimizer DTensors load on any mesh.

Tested with nemo-automodel 0.7.0 (the ``asyncckpt[nemo-automodel]`` extra pins it) on CPU with
gloo: NeMo's real ``BaseRecipe``, ``StepScheduler``, ``StatefulRNG``, state wrappers and
directory functions, a tiny Llama under FSDP2 on 2 ranks, SIGKILLed and resumed
(``tests/test_nemo_recipe.py``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, ClassVar

import torch
import yaml  # a dependency of nemo-automodel
from nemo_automodel.components.checkpoint.stateful_wrappers import ModelState, OptimizerState
from nemo_automodel.components.checkpoint.utils import (
    find_latest_checkpoint,
    is_checkpoint_incomplete,
    is_cloud_path,
    resolve_restore_from_to_checkpoint_dir,
)
from nemo_automodel.components.config.loader import ConfigNode
from nemo_automodel.components.training.rng import StatefulRNG
from nemo_automodel.recipes._typed_config import RecipeConfig
from nemo_automodel.recipes.base_recipe import (
    _is_checkpoint_model_config_compatible,
    is_dataloader,
    is_distributed_stateful,
    is_lr_scheduler,
    is_model,
    is_optimizer,
    is_tokenizer,
)
from torch.nn.parallel import DistributedDataParallel

from .._errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ..checkpointer._facade import Checkpointer
from ..ranks._every_rank import on_every_rank
from ..roots.posix._remove_tree import remove_tree
from . import _nemo_folders as folders
from ._publish import Publisher

__all__ = ["AsyncckptRecipeMixin", "with_asyncckpt"]

log = logging.getLogger("asyncckpt")

_FORMAT = "asyncckpt-nemo-automodel/1"
#: Checkpointer options this integration decides itself.
_MANAGED = ("keep_last", "process_group", "allow_earlier_steps")


class AsyncckptRecipeMixin:
    """Makes a NeMo Automodel recipe (a ``BaseRecipe`` subclass) save its checkpoints
    asynchronously with asyncckpt: ``class MyRecipe(AsyncckptRecipeMixin, SomeRecipe)``,
    or :func:`with_asyncckpt`.

    Class attributes:
        asyncckpt_options: passed on to :class:`asyncckpt.Checkpointer` (``timeout``,
            ``max_pending``, ``direct_io``, ``mirror``, ...), plus ``root`` (default
            ``CHECKPOINT_DIR/.asyncckpt-nemo``). ``keep_last`` is refused: NeMo's
            ``checkpoint.max_recent_checkpoints`` applies.
    """

    asyncckpt_options: ClassVar[dict[str, Any]] = {}

    # ------------------------------------------------------------------ saving
    def save_checkpoint(
        self, epoch: int, step: int, train_loss: Any, val_loss: dict[str, Any] | None = None,
        best_metric_key: str = "default",
    ) -> None:  # fmt: skip
        """Stage the recipe's state as one asyncckpt step and return; ``epoch_E_step_S``
        appears (and ``LATEST`` moves to it) once the step committed on every rank.

        Collective, like NeMo's: every rank calls it with the same arguments. A save or
        publication that failed earlier is raised here, on every rank.
        """
        r: Any = self
        config = r.checkpointer.config
        if not config.enabled:
            return
        ck = self._asyncckpt_open()
        pub = self._asyncckpt_state["publisher"]
        # a failed publication (rank 0's thread) reaches every rank, before any rank saves again
        on_every_rank(pub.raise_failure, group=r.checkpointer.process_group, timeout=self._asyncckpt_wait_s())
        state = self._asyncckpt_collect()
        state["meta"] = {"format": _FORMAT, "epoch": epoch, "step": step}
        ckpt_step = max(step, self._asyncckpt_state["next"])
        pending = None
        if ck.rank == 0:
            files = self._asyncckpt_files(train_loss, val_loss)
            pending = folders.write_pending(self._asyncckpt_state["dir"], ck.root, ckpt_step, epoch, step, files,
                                            *_best_metric(val_loss, best_metric_key))  # fmt: skip
        try:
            handle = ck.save(ckpt_step, state)  # returns once staged
        except BaseException:
            if pending is not None:
                remove_tree(pending)
            raise
        self._asyncckpt_state["next"] = ckpt_step + 1
        if pending is not None:
            keep = config.max_recent_checkpoints
            pub.after_commit(handle, lambda info, p=pending, root=ck.root: folders.publish(p, root, keep))

    def _finalize_and_close_checkpointer(self) -> None:
        """Wait for every pending save and its publication, close the asyncckpt Checkpointer
        (collective) and NeMo's own, and raise the first failure on every rank."""
        r: Any = self
        st = self.__dict__.get("_asyncckpt")
        try:
            if st is not None and st.get("ck") is not None:
                ck, st["ck"] = st["ck"], None
                try:
                    ck.close()
                finally:
                    try:
                        st["publisher"].drain()
                    except TimeoutError as e:  # a publication stuck: raised on every rank below
                        st["publisher"].record(e)
                    st["publisher"].stop()
                on_every_rank(
                    st["publisher"].raise_failure, group=r.checkpointer.process_group, timeout=self._asyncckpt_wait_s()
                )
        finally:
            super()._finalize_and_close_checkpointer()  # type: ignore[misc]

    # ------------------------------------------------------------------ loading
    def load_checkpoint(self, restore_from: str | None = None) -> None:
        """Resume as NeMo's ``load_checkpoint`` does (``restore_from``: ``None``/``"LATEST"``,
        a pointer name, a folder name or a path), from a folder of ours or NeMo's own.

        Collective: rank 0 resolves the folder (so ranks cannot disagree over a stale
        directory cache) and every rank loads its part. Without an explicit folder, a step
        that fails verification is logged and the next older complete folder is tried.
        """
        r: Any = self
        config = r.checkpointer.config
        if not config.enabled:
            super().load_checkpoint(restore_from)  # type: ignore[misc]
            return
        ck = self._asyncckpt_open()
        ckpt_dir = self._asyncckpt_state["dir"]
        explicit = bool(restore_from) and str(restore_from).upper() != "LATEST"
        plan = on_every_rank(
            lambda: _plan(ckpt_dir, restore_from, explicit, getattr(r, "cfg", None)) if ck.rank == 0 else None,
            group=r.checkpointer.process_group, timeout=self._asyncckpt_wait_s(),
        )[0]  # fmt: skip
        if plan["missing"] is not None:
            raise FileNotFoundError(f"Checkpoint directory does not exist: {plan['missing']}")
        for i, c in enumerate(plan["candidates"]):
            if not c["compatible"]:
                if not explicit:
                    if ck.rank == 0:
                        log.warning("asyncckpt: checkpoint %s is incompatible with the current model configuration: "
                                    "%s. Skipping restore.", c["path"], c["reason"])  # fmt: skip
                    return
                if ck.rank == 0:
                    log.warning("asyncckpt: checkpoint %s may be incompatible with the current model configuration: "
                                "%s. Proceeding with restore anyway.", c["path"], c["reason"])  # fmt: skip
            if c["step"] is None:  # a folder NeMo wrote itself: its own code loads it
                super().load_checkpoint(c["path"])  # type: ignore[misc]
                return
            if ck.rank == 0:
                log.info("asyncckpt: loading checkpoint %s (step %d of %s)", c["path"], c["step"], ck.root)
            try:
                self._asyncckpt_restore(ck, c["step"])
                return
            except (CheckpointCorruptError, CheckpointNotFoundError) as e:
                if explicit or i == len(plan["candidates"]) - 1:
                    raise
                if ck.rank == 0:
                    log.warning("asyncckpt: not resuming from %s: %s; trying the next older checkpoint", c["path"], e)

    # ------------------------------------------------------------------ internals
    def _asyncckpt_open(self) -> Checkpointer:
        """The run's asyncckpt Checkpointer, built on first use on every rank (collective);
        rank 0 finishes what a crash left in the checkpoint directory first."""
        st = self.__dict__.get("_asyncckpt")
        if st is not None and st.get("ck") is not None:
            ck: Checkpointer = st["ck"]
            return ck
        r: Any = self
        config = r.checkpointer.config
        ckpt_dir = os.path.abspath(os.fspath(config.checkpoint_dir))
        if is_cloud_path(os.fspath(config.checkpoint_dir)):
            raise NotImplementedError(f"{type(self).__name__} does not support msc:// checkpoint directories")
        options = dict(self.asyncckpt_options)
        for k in _MANAGED:
            if k in options:
                hint = " (use checkpoint.max_recent_checkpoints)" if k == "keep_last" else ""
                raise TypeError(f"asyncckpt_options: {k!r} is managed by {type(self).__name__}{hint}")
        root = os.fspath(options.pop("root", None) or os.path.join(ckpt_dir, folders.ROOT_NAME))
        group = r.checkpointer.process_group
        ck = Checkpointer(root, process_group=group, **options)
        wait_s = float(options.get("timeout", 600.0)) + 30.0
        publisher = st["publisher"] if st is not None else Publisher("asyncckpt-nemo", wait_s)
        self.__dict__["_asyncckpt"] = {"ck": ck, "dir": ckpt_dir, "publisher": publisher, "next": 0,
                                             "wait_s": wait_s}  # fmt: skip
        try:
            steps = ck.steps()  # collective: rank 0's listing
            keep = config.max_recent_checkpoints
            on_every_rank(
                lambda: folders.recover(ckpt_dir, ck.root, set(steps), keep) if ck.rank == 0 else [],
                group=group, timeout=wait_s,
            )  # fmt: skip
        except BaseException:
            self.__dict__["_asyncckpt"]["ck"] = None
            ck.close()
            raise
        self._asyncckpt_state["next"] = steps[-1] + 1 if steps else 0
        return ck

    @property
    def _asyncckpt_state(self) -> dict[str, Any]:
        st: dict[str, Any] = self.__dict__["_asyncckpt"]
        return st

    def _asyncckpt_wait_s(self) -> float:
        return float(self._asyncckpt_state["wait_s"])

    def _asyncckpt_parts(self) -> dict[str, Any]:
        """The recipe's tracked state, sorted as ``BaseRecipe.save_checkpoint`` sorts it."""
        parts: dict[str, Any] = {"model": None, "optimizer": None, "scheduler": None, "config": None,
                                 "rng": {}, "dataloader": {}, "distributed": {}, "other": {}}  # fmt: skip
        for key in sorted(self.__dict__["__state_tracked"]):
            obj = getattr(self, key)
            if is_model(obj):
                if key != "teacher_model":
                    parts["model"] = obj
            elif is_optimizer(obj):
                parts["optimizer"] = obj
            elif isinstance(obj, (ConfigNode, RecipeConfig)):
                parts["config"] = obj
            elif is_lr_scheduler(obj):
                parts["scheduler"] = obj
            elif is_tokenizer(obj):
                continue
            elif isinstance(obj, StatefulRNG):
                parts["rng"][key] = obj
            elif is_dataloader(obj):
                parts["dataloader"][key] = obj
            elif is_distributed_stateful(obj):
                parts["distributed"][key] = obj
            else:
                parts["other"][key] = obj
        return parts

    def _asyncckpt_wrappers(self, parts: dict[str, Any]) -> tuple[Any, Any]:
        """NeMo's ``ModelState`` and ``OptimizerState`` for the recipe, built as its
        ``save_model``/``save_optimizer``/``load_optimizer`` build them."""
        r: Any = self
        nemo_ck = r.checkpointer
        model = parts["model"]
        if model is None:
            raise CheckpointError(f"{type(self).__name__} tracks no model")
        unwrapped = model[0] if isinstance(model, list) and len(model) == 1 else model
        if isinstance(unwrapped, DistributedDataParallel):
            unwrapped = unwrapped.module
        model_state = ModelState(unwrapped, nemo_ck.config.is_peft, cpu_offload=nemo_ck.config.cpu_offload,
                                 pp_group=nemo_ck.pp_group)  # fmt: skip
        optim_state = None
        if parts["optimizer"] is not None:
            optim_state = OptimizerState(
                model, parts["optimizer"], parts["scheduler"], is_peft=nemo_ck.config.is_peft,
                cpu_offload=nemo_ck.config.cpu_offload, has_expert_parallelism=nemo_ck.moe_mesh is not None,
                optimizer_part_ids=r._get_optimizer_checkpoint_part_ids(),
            )  # fmt: skip
        return model_state, optim_state

    def _asyncckpt_collect(self) -> dict[str, Any]:
        """The state of one step (see the module docstring), as this rank holds it now."""
        parts = self._asyncckpt_parts()
        optimizers = parts["optimizer"] if isinstance(parts["optimizer"], list) else [parts["optimizer"]]
        for opt in optimizers:  # Dion keeps state that must be synced before it is read
            if hasattr(opt, "synchronize_for_checkpoint"):
                opt.synchronize_for_checkpoint()
        model_state, optim_state = self._asyncckpt_wrappers(parts)
        return {
            "model": model_state.state_dict(),
            "optim": optim_state.state_dict() if optim_state is not None else {},
            **{kind: {k: obj.state_dict() for k, obj in parts[kind].items()}
               for kind in ("rng", "dataloader", "distributed", "other")},
        }  # fmt: skip

    def _asyncckpt_restore(self, ck: Checkpointer, step: int) -> None:
        """Load ``step`` into the recipe's objects: model and optimizer tensors are read
        straight into their (sharded) memory; the rest is restored through ``load_state_dict``
        in the order of NeMo's ``load_checkpoint``."""
        parts = self._asyncckpt_parts()
        model_state, optim_state = self._asyncckpt_wrappers(parts)
        into = {"model": model_state.state_dict(), "optim": optim_state.state_dict() if optim_state is not None else {},
                "distributed": {k: obj.state_dict() for k, obj in parts["distributed"].items()}}  # fmt: skip
        state = ck.load(step, into=into)
        for kind in ("rng", "dataloader", "distributed", "other"):
            for key, obj in parts[kind].items():
                obj.load_state_dict(state[kind][key])
        model_state.load_state_dict(state["model"])
        if optim_state is not None:
            optim_state.load_state_dict(state["optim"])

    def _asyncckpt_files(self, train_loss: Any, val_loss: dict[str, Any] | None) -> dict[str, bytes]:
        """``losses.json`` and ``config.yaml`` as NeMo writes them into a checkpoint folder."""
        losses: dict[str, Any] = {"train_loss": train_loss}
        if val_loss:
            if len(val_loss) == 1:
                losses["val_loss"] = next(iter(val_loss.values()))
            else:
                losses.update(val_loss)
        files = {"losses.json": json.dumps({k: _item(v) for k, v in losses.items()}).encode()}
        config = self._asyncckpt_parts()["config"]
        if config is not None:
            text = yaml.dump(config.to_yaml_dict(use_orig_values=True), sort_keys=False, default_flow_style=False)
            files["config.yaml"] = text.encode("utf-8")
        return files


def with_asyncckpt(recipe_cls: type, **asyncckpt_options: Any) -> type:
    """``recipe_cls`` (a NeMo Automodel recipe class) with :class:`AsyncckptRecipeMixin`
    mixed in; ``asyncckpt_options`` go to :class:`asyncckpt.Checkpointer` (see the mixin)."""
    for k in _MANAGED:
        if k in asyncckpt_options:
            raise TypeError(f"{k!r} is managed by the NeMo Automodel integration")
    return type(f"Asyncckpt{recipe_cls.__name__}", (AsyncckptRecipeMixin, recipe_cls),
                {"asyncckpt_options": dict(asyncckpt_options), "__module__": __name__})  # fmt: skip


def _plan(ckpt_dir: str, restore_from: str | None, explicit: bool, cfg: Any) -> dict[str, Any]:
    """Rank 0's resolution of ``restore_from``: the folders to try, newest first, each with
    its step (``None`` for a folder NeMo wrote) and NeMo's model-config compatibility verdict."""
    if restore_from:
        first = resolve_restore_from_to_checkpoint_dir(ckpt_dir, restore_from)
        if first is not None and explicit and not os.path.exists(first):
            return {"missing": str(first), "candidates": []}
    else:
        first = find_latest_checkpoint(ckpt_dir)
    if first is None:
        return {"missing": None, "candidates": []}
    paths = [os.path.abspath(os.fspath(first))]
    if not explicit:  # fall back over the older complete folders, newest first
        paths += [p for _, p in reversed(folders.checkpoint_folders(ckpt_dir))
                  if p not in paths and not is_checkpoint_incomplete(p)]  # fmt: skip
    candidates = []
    for path in paths:
        try:
            p = folders.read_pointer(path)
        except CheckpointError as e:
            log.warning("asyncckpt: not resuming from %s: %s", path, e)
            continue
        ok, reason = (True, "") if cfg is None else _is_checkpoint_model_config_compatible(cfg, path)
        candidates.append({"path": path, "step": None if p is None else p.step, "compatible": ok, "reason": reason})
        if p is None:
            break  # NeMo's own folder: its own loader has no fallback
    return {"missing": None, "candidates": candidates}


def _best_metric(val_loss: dict[str, Any] | None, best_metric_key: str) -> tuple[str, float | None]:
    """The validation metric NeMo's ``LOWEST_VAL`` compares, and its key."""
    name = next(iter(val_loss)) if val_loss and len(val_loss) == 1 else best_metric_key
    value = _item(val_loss[name]) if val_loss and name in val_loss else None
    if isinstance(value, (int, float)) and math.isfinite(value):
        return name, float(value)
    return name, None


def _item(x: Any) -> Any:
    return x.item() if isinstance(x, torch.Tensor) else x
