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
Checkpointer; a later save opens it again. Needs ``pip install "asyncckpt[lightning]"``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.plugins.io import CheckpointIO

from ._checkpointer import Checkpointer, load
from ._errors import CheckpointError
from ._handle import SaveHandle
from ._layout import step_dir_name
from ._storage import remove_tree

__all__ = ["ROOT_NAME", "AsyncckptCheckpointIO", "load_checkpoint"]

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
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        os.write(fd, body.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        **checkpointer_kwargs: passed on to each :class:`Checkpointer` (``direct_io``, ...).
    """

    def __init__(
        self, verify: bool = True, timeout: float = 600.0, max_pending: int = 1, **checkpointer_kwargs: Any
    ) -> None:
        super().__init__()
        for k in ("keep_last", "process_group", "on_commit", "root"):
            if k in checkpointer_kwargs:
                raise TypeError(f"AsyncckptCheckpointIO manages {k!r} itself")
        self.verify = verify
        self._kwargs = dict(checkpointer_kwargs, timeout=timeout, max_pending=max_pending, verify=verify)
        self._timeout = float(timeout)
        self._lock = threading.Lock()
        self._ckpts: dict[str, Checkpointer] = {}
        self._next_step: dict[str, int] = {}
        self._jobs: queue.Queue[tuple[str, str, SaveHandle | None] | None] = queue.Queue()
        self._publisher: threading.Thread | None = None
        self._errors: list[BaseException] = []

    # ------------------------------------------------------------------ saving
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` for ``path`` and return; the pointer appears once it committed."""
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options={storage_options!r})` is not supported by "
                f"{type(self).__name__}: pass options to its constructor"
            )
        self._raise_failure()
        target = os.path.abspath(os.fspath(path))
        if target.endswith(os.sep) or os.path.isdir(target):
            raise ValueError(f"checkpoint path {target} is a directory; Lightning names a file")
        root = os.path.join(os.path.dirname(target), ROOT_NAME)
        ck = self._checkpointer(root)
        tree, where = _encode(checkpoint)
        with self._lock:
            step = self._next_step[root]
            self._next_step[root] = step + 1
        handle = ck.save(step, {"checkpoint": tree, "attrdicts": where})
        self._enqueue(("save", target, handle))

    def remove_checkpoint(self, path: Any) -> None:
        """Remove ``path`` once every save asked for before this call has committed."""
        self._enqueue(("remove", os.path.abspath(os.fspath(path)), None))

    # ------------------------------------------------------------------ loading
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        """Lightning's checkpoint dict saved at ``path`` (pending saves finish first).

        Tensors come back on the CPU; Lightning moves them where the model lives.
        """
        self._drain()
        return load_checkpoint(os.fspath(path), verify=self.verify)

    # ------------------------------------------------------------------ lifecycle
    def teardown(self) -> None:
        """Wait for every save and removal, close the Checkpointers, raise the first failure."""
        try:
            self._drain()
        finally:
            with self._lock:
                ckpts, self._ckpts = list(self._ckpts.values()), {}
                self._next_step.clear()
                self._enqueue_stop()
            for ck in ckpts:
                try:
                    ck.close()
                except BaseException as e:  # noqa: BLE001 - recorded, raised below
                    self._record(e)
        self._raise_failure()

    # ------------------------------------------------------------------ internals
    def _checkpointer(self, root: str) -> Checkpointer:
        with self._lock:
            ck = self._ckpts.get(root)
            if ck is None:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                    raise NotImplementedError(
                        "AsyncckptCheckpointIO supports single-process training for now "
                        "(Lightning saves from global rank 0 only; asyncckpt would wait for every rank)"
                    )
                ck = Checkpointer(root, **self._kwargs)
                steps = ck.steps()
                self._next_step[root] = (steps[-1] + 1) if steps else 0
                self._ckpts[root] = ck
            return ck

    def _enqueue(self, job: tuple[str, str, SaveHandle | None]) -> None:
        with self._lock:
            if self._publisher is None or not self._publisher.is_alive():
                self._publisher = threading.Thread(target=self._publish, name="asyncckpt-lightning", daemon=True)
                self._publisher.start()
            self._jobs.put(job)

    def _enqueue_stop(self) -> None:
        if self._publisher is not None:
            self._jobs.put(None)
            self._publisher = None

    def _drain(self) -> None:
        self._jobs.join()

    def _publish(self) -> None:
        """The one thread that writes pointers and removes checkpoints, in call order."""
        blocked = False  # a save failed: later removals must not take an older good checkpoint
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                kind, path, handle = job
                if kind == "save":
                    assert handle is not None
                    try:
                        info = handle.result(timeout=self._timeout + 30.0)
                    except BaseException as e:  # noqa: BLE001 - raised at the next save/teardown
                        self._record(e)
                        blocked = True
                        continue
                    self._point(path, str(info.path.parent), info.step)
                elif blocked:
                    log.warning("asyncckpt: not removing %s: an earlier save failed", path)
                else:
                    self._remove(path)
            except BaseException as e:  # noqa: BLE001 - raised at the next save/teardown
                self._record(e)
            finally:
                self._jobs.task_done()

    def _point(self, path: str, root: str, step: int) -> None:
        previous = None if os.path.islink(path) else _pointed(path)
        _write_pointer(path, root, step)
        if previous is not None and previous != (root, step):
            _remove_step(*previous)

    def _remove(self, path: str) -> None:
        # a link (Lightning's save_last="link") points at another pointer: only the link goes
        previous = None if os.path.islink(path) else _pointed(path)
        if previous is None:
            if os.path.lexists(path):
                os.unlink(path)  # not ours (e.g. a torch.save file): remove as Lightning would
            return
        os.unlink(path)
        _fsync_dir(os.path.dirname(path))
        _remove_step(*previous)

    def _record(self, e: BaseException) -> None:
        with self._lock:
            self._errors.append(e)

    def _raise_failure(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            first, rest = errors[0], errors[1:]
            for e in rest:
                first.add_note(f"also failed: {e}")
            raise first


def _pointed(path: str) -> tuple[str, int] | None:
    try:
        return read_pointer(path)
    except (FileNotFoundError, CheckpointError):
        return None


def _remove_step(root: str, step: int) -> None:
    """Drop one step of a root this plugin writes (the pointer to it is already gone)."""
    d = Path(root) / step_dir_name(step)
    if d.is_dir():
        remove_tree(str(d))

