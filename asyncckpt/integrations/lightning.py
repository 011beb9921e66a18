"""Lightning integration: a ``CheckpointIO`` plugin that saves through a :class:`Checkpointer`.

    trainer = lightning.Trainer(plugins=[AsyncckptCheckpointIO()], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path="last")

How Lightning paths map onto asyncckpt: every checkpoint directory Lightning writes into
(``.../checkpoints/``) gets one asyncckpt root, ``<dir>/.asyncckpt-lightning/``, whose steps
are numbered by save (Lightning may save several files at one global step). The path Lightning
names, e.g. ``.../checkpoints/epoch=0-step=10.ckpt``, becomes a small JSON *pointer file*
naming the root and step. It is written (atomically, fsynced) only after that step committed,
so every ``*.ckpt`` Lightning sees, ``ckpt_path="last"`` included, is a complete checkpoint.

Ordering (the bug of Lightning issue #14035 avoided): one publisher thread handles, in call
order, "save committed: write the pointer, drop the step the path pointed to before" and
"remove this path". A removal therefore runs only after every save requested before it has
committed; if one of those saves failed, the removal is skipped (the older checkpoint stays)
and the failure is raised at the next save or at ``teardown()``.

``save_checkpoint`` returns once the state is staged; ``teardown()`` (called by Lightning at the
end of ``fit``/``test``/...) waits for everything, raises a failure, and closes the
Checkpointer; a later save opens it again. Under DDP Lightning saves from global rank 0 only:
its Checkpointer works on a group of that rank alone, and every rank loads from the shared
directory. Needs ``pip install "asyncckpt[lightning]"``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.plugins.io import CheckpointIO

from .._errors import CheckpointError
from .._info import CheckpointInfo
from ..checkpointer._facade import Checkpointer
from ..checkpointer._loader import load
from ..saving import _deferred
from ._publish import Publisher, drop_step, fsync_dir, write_durably

__all__ = ["ROOT_NAME", "AsyncckptCheckpointIO", "load_checkpoint", "read_pointer"]

log = logging.getLogger("asyncckpt")

#: The asyncckpt root next to Lightning's checkpoint files.
ROOT_NAME = ".asyncckpt-lightning"
_FORMAT = "asyncckpt-lightning/1"
_MAX_POINTER = 64 * 1024


def _encode(ckpt: Any) -> tuple[Any, list[list[Any]]]:
    """Lightning's dict with each ``AttributeDict`` (hyper_parameters) made a plain dict, and
    the key paths where they were, so loading gives back exactly what Lightning saved."""
    where: list[list[Any]] = []

    def walk(obj: Any, path: list[Any]) -> Any:
        if isinstance(obj, AttributeDict):
            where.append(path)
            return {k: walk(v, [*path, k]) for k, v in obj.items()}
        if type(obj) is dict:
            return {k: walk(v, [*path, k]) for k, v in obj.items()}
        return obj

    return walk(ckpt, []), where


def _decode(ckpt: Any, where: list[list[Any]]) -> Any:
    for path in sorted(where, key=len, reverse=True):
        if not path:
            ckpt = AttributeDict(ckpt)
            continue
        parent = ckpt
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = AttributeDict(parent[path[-1]])
    return ckpt


def _write_pointer(path: str, root: str, step: int) -> None:
    """Atomically and durably make ``path`` name ``step`` of ``root``."""
    body = json.dumps({"format": _FORMAT, "root": os.path.relpath(root, os.path.dirname(path)), "step": step})
    write_durably(path, body.encode())


def read_pointer(path: str) -> tuple[str, int]:
    """The asyncckpt root and step a pointer file names.

    Raises ``FileNotFoundError`` when there is none and ``CheckpointError`` when the file is
    not an asyncckpt pointer (e.g. a ``torch.save`` checkpoint).
    """
    with open(path, "rb") as f:
        raw = f.read(_MAX_POINTER + 1)
    try:
        doc = json.loads(raw.decode("utf-8")) if len(raw) <= _MAX_POINTER else None
    except (UnicodeDecodeError, ValueError):
        doc = None
    if not (
        isinstance(doc, dict)
        and doc.get("format") == _FORMAT
        and isinstance(doc.get("root"), str)
        and type(doc.get("step")) is int
        and doc["step"] >= 0
    ):
        raise CheckpointError(f"{path} is not an asyncckpt Lightning checkpoint (pointer file)")
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), doc["root"])), doc["step"]


def load_checkpoint(path: str | os.PathLike[str], verify: bool = True) -> dict[str, Any]:
    """Lightning's checkpoint dict from a pointer file (or the newest step of a root directory).

    Use it where Lightning would ``torch.load`` a file itself, e.g. before
    ``LightningModule.load_state_dict(ckpt["state_dict"])``.
    """
    p = os.fspath(path)
    if os.path.isdir(p):
        root, step = p, None
    elif os.path.exists(p):
        root, found = read_pointer(p)
        step = found
    else:
        raise FileNotFoundError(f"Checkpoint file not found: {p}")
    doc = load(root, step, verify=verify)
    if not (isinstance(doc, dict) and "checkpoint" in doc and isinstance(doc.get("attrdicts"), list)):
        raise CheckpointError(f"{p} does not hold a Lightning checkpoint")
    ckpt: dict[str, Any] = _decode(doc["checkpoint"], doc["attrdicts"])
    return ckpt


class AsyncckptCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that stages on the caller and writes in the background.

    Args:
        verify: check CRC-32C of every file when loading.
        timeout: seconds one save may take (``Checkpointer(timeout=)``).
        max_pending: saves in flight at once (each holds a staging buffer the size of the state).
        deferred: deferred staging (docs/deferred.md): the tensors of the optimizers that have
            stepped are copied in the background, and the next optimizer step waits for the
            copy. Under automatic optimization Lightning runs forward and backward inside
            ``optimizer.step(closure)``, so that wait comes before them: the copy overlaps only
            what runs between the save and the next step.
        **checkpointer_kwargs: passed on to each :class:`Checkpointer` (``direct_io``, ...).
    """

    def __init__(
        self, verify: bool = True, timeout: float = 600.0, max_pending: int = 1, deferred: bool = False,
        **checkpointer_kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__()
        if not isinstance(deferred, bool):
            raise TypeError(f"deferred must be a bool, not {deferred!r}")
        self.deferred = deferred
        if deferred:
            _deferred.watch_optimizers()  # before the first step: the optimizers are found as they step
        for k in ("keep_last", "process_group", "on_commit", "root"):
            if k in checkpointer_kwargs:
                raise TypeError(f"AsyncckptCheckpointIO manages {k!r} itself")
        self.verify = verify
        self._kwargs = dict(checkpointer_kwargs, timeout=timeout, max_pending=max_pending, verify=verify)
        self._lock = threading.Lock()
        self._ckpts: dict[str, Checkpointer] = {}
        self._next_step: dict[str, int] = {}
        self._publisher = Publisher("asyncckpt-lightning", float(timeout) + 30.0)
        self._solo: Any = None  # under DDP: a process group of global rank 0 alone

    # ------------------------------------------------------------------ saving
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` for ``path`` and return; the pointer appears once it committed."""
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options={storage_options!r})` is not supported by "
                f"{type(self).__name__}: pass options to its constructor"
            )
        self._publisher.raise_failure()
        target = os.path.abspath(os.fspath(path))
        if target.endswith(os.sep) or os.path.isdir(target):
            raise ValueError(f"checkpoint path {target} is a directory; Lightning names a file")
        root = os.path.join(os.path.dirname(target), ROOT_NAME)
        ck = self._checkpointer(root)
        tree, where = _encode(checkpoint)
        with self._lock:
            step = self._next_step[root]
            self._next_step[root] = step + 1
        opts = _deferred.stepped_optimizers() if self.deferred else ()
        state = {"checkpoint": tree, "attrdicts": where}
        handle = ck.save(step, state, until=opts) if opts else ck.save(step, state)
        self._publisher.after_commit(handle, lambda info: _point(target, info))

    def remove_checkpoint(self, path: Any) -> None:
        """Remove ``path`` once every save asked for before this call has committed."""
        target = os.path.abspath(os.fspath(path))
        self._publisher.then(lambda: _remove(target), f"removing {target}")

    # ------------------------------------------------------------------ loading
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        """Lightning's checkpoint dict saved at ``path`` (pending saves finish first).

        Tensors come back on the CPU; Lightning moves them where the model lives.
        """
        self._wait_staged()
        self._publisher.drain()
        return load_checkpoint(os.fspath(path), verify=self.verify)

    def _wait_staged(self) -> None:
        """Deferred staging: the guard of the saves in flight (on the training thread)."""
        with self._lock:
            ckpts = list(self._ckpts.values())
        for ck in ckpts:
            ck.wait_staged()

    # ------------------------------------------------------------------ lifecycle
    def teardown(self) -> None:
        """Wait for every save and removal, close the Checkpointers, raise the first failure."""
        try:
            self._wait_staged()  # the last deferred save's guard: no step follows it
            self._publisher.drain()
        finally:
            with self._lock:
                ckpts, self._ckpts = list(self._ckpts.values()), {}
                self._next_step.clear()
            self._publisher.stop()
            for ck in ckpts:
                try:
                    ck.close()
                except BaseException as e:  # noqa: BLE001 - recorded, raised below
                    self._publisher.record(e)
        self._publisher.raise_failure()

    # ------------------------------------------------------------------ internals
    def _checkpointer(self, root: str) -> Checkpointer:
        with self._lock:
            ck = self._ckpts.get(root)
            if ck is None:
                ck = Checkpointer(root, process_group=self._process_group(), **self._kwargs)
                steps = ck.steps()
                self._next_step[root] = (steps[-1] + 1) if steps else 0
                self._ckpts[root] = ck
            return ck

    def _process_group(self) -> Any:
        """``None`` for one process. Under DDP, Lightning saves from global rank 0 alone, so its
        Checkpointer gets a group of that rank only (made by rank 0 alone, without the others:
        ``use_local_synchronization``); a Checkpointer on the world would wait for every rank."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return None
        if dist.get_rank() != 0:
            raise NotImplementedError(
                "AsyncckptCheckpointIO saves from global rank 0 only (Lightning's DDP strategy); this strategy "
                f"saves on rank {dist.get_rank()} too (sharded checkpoints are not supported yet)"
            )
        if self._solo is None:
            self._solo = dist.new_group([0], use_local_synchronization=True)
        return self._solo


def _point(path: str, info: CheckpointInfo) -> None:
    """Publish ``path`` as the committed ``info``, then drop the step it named before."""
    previous = None if os.path.islink(path) else _pointed(path)
    root = str(info.path.parent)
    _write_pointer(path, root, info.step)
    if previous is not None and previous != (root, info.step):
        _drop(path, *previous)


def _remove(path: str) -> None:
    # a link (Lightning's save_last="link") points at another pointer: only the link goes
    previous = None if os.path.islink(path) else _pointed(path)
    if previous is None:
        if os.path.lexists(path):
            os.unlink(path)  # not ours (e.g. a torch.save file): remove as Lightning would
        return
    os.unlink(path)
    fsync_dir(os.path.dirname(path))
    _drop(path, *previous)


def _drop(path: str, root: str, step: int) -> None:
    """Drop the step a pointer at ``path`` named, if it lies in the root beside ``path`` (a
    pointer file copied from elsewhere, or a hostile one, never removes anything outside it)."""
    ours = os.path.join(os.path.dirname(path), ROOT_NAME)
    if os.path.realpath(root) == os.path.realpath(ours):
        drop_step(ours, step)
    else:
        log.warning("asyncckpt: %s pointed outside %s; its step %d is left alone", path, ours, step)


def _pointed(path: str) -> tuple[str, int] | None:
    try:
        return read_pointer(path)
    except (FileNotFoundError, CheckpointError):
        return None
