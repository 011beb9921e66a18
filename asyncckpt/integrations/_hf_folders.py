"""The Hugging Face Trainer's ``checkpoint-N`` folders as pointers to asyncckpt steps.

::

    OUTPUT_DIR/
      .asyncckpt-trainer/            the asyncckpt root: step_00000040/, ... (asyncckpt ls/verify work)
      checkpoint-40/                 published once step 40 committed (never before)
        asyncckpt.json               {"format": "asyncckpt-transformers/1",
                                      "root": "../.asyncckpt-trainer", "step": 40, "global_step": 40}
        trainer_state.json           the TrainerState, as the Trainer writes it (a copy: the step holds it too)

Global step N is saved as step N of the root, except when the root already holds step N or
a later one (a run resumed from an older checkpoint, or a new run in an old output
directory): then it takes the next free step. The pointer always says which.

A folder appears by one ``rename`` of a fully written, fsynced temporary folder, so every
``checkpoint-N`` the Trainer (or ``transformers.trainer_utils.get_last_checkpoint``) sees
is complete. Nothing here imports transformers.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from dataclasses import dataclass

from .._errors import CheckpointError
from ..roots.posix._remove_tree import remove_tree
from ._publish import drop_step, fsync_dir, write_durably

log = logging.getLogger("asyncckpt")

#: The asyncckpt root inside the Trainer's output directory.
ROOT_NAME = ".asyncckpt-trainer"
#: The pointer file inside a ``checkpoint-N`` folder.
POINTER_NAME = "asyncckpt.json"
#: The Trainer's own name for its state file (``transformers.trainer.TRAINER_STATE_NAME``).
TRAINER_STATE_NAME = "trainer_state.json"
FORMAT = "asyncckpt-transformers/1"
_FOLDER = re.compile(r"^checkpoint-(\d+)$")
_LEFTOVER = re.compile(r"^\.checkpoint-\d+\.(tmp|removing)-[0-9a-f]{16}$")
_MAX_POINTER = 64 * 1024


@dataclass(frozen=True)
class Pointer:
    """What a ``checkpoint-N`` folder of ours names: ``step`` of the asyncckpt ``root``."""

    folder: str
    root: str
    step: int
    global_step: int


def folder_name(global_step: int) -> str:
    return f"checkpoint-{global_step}"


def read_pointer(folder: str) -> Pointer | None:
    """The pointer of ``folder``, or ``None`` when it has none (a Trainer-written checkpoint).

    Raises ``CheckpointError`` when ``asyncckpt.json`` is there but not a valid pointer.
    """
    path = os.path.join(folder, POINTER_NAME)
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_POINTER + 1)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw.decode("utf-8")) if len(raw) <= _MAX_POINTER else None
    except (UnicodeDecodeError, ValueError):
        doc = None
    if not (
        isinstance(doc, dict)
        and doc.get("format") == FORMAT
        and isinstance(doc.get("root"), str)
        and all(type(doc.get(k)) is int and doc[k] >= 0 for k in ("step", "global_step"))
    ):
        raise CheckpointError(f"{path} is not an asyncckpt pointer (format {FORMAT})")
    root = os.path.normpath(os.path.join(os.path.abspath(folder), doc["root"]))
    return Pointer(os.path.abspath(folder), root, doc["step"], doc["global_step"])


def checkpoint_folders(run_dir: str) -> list[tuple[int, str]]:
    """``(global_step, path)`` of every ``checkpoint-N`` folder in ``run_dir``, by N."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = _FOLDER.match(name)
        path = os.path.join(run_dir, name)
        if m is not None and os.path.isdir(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def publish(run_dir: str, root: str, step: int, global_step: int, trainer_state: str) -> str:
    """Make ``checkpoint-<global_step>`` point at ``step`` of ``root``; return the folder.

    The folder is written under a temporary name (both files fsynced) and renamed into
    place. A folder already there under that name (an older timeline's, or the Trainer's
    own) is renamed aside first and removed after, with the step it pointed at.
    """
    folder = os.path.join(run_dir, folder_name(global_step))
    tmp = os.path.join(run_dir, f".{folder_name(global_step)}.tmp-{uuid.uuid4().hex[:16]}")
    os.mkdir(tmp)
    try:
        doc = {"format": FORMAT, "root": os.path.relpath(root, folder), "step": step, "global_step": global_step}
        write_durably(os.path.join(tmp, TRAINER_STATE_NAME), trainer_state.encode("utf-8"), replace=False)
        write_durably(os.path.join(tmp, POINTER_NAME), json.dumps(doc).encode(), replace=False)
        fsync_dir(tmp)
        old = _move_aside(folder) if os.path.lexists(folder) else None
        os.rename(tmp, folder)
    except BaseException:
        remove_tree(tmp)
        raise
    fsync_dir(run_dir)
    if old is not None:
        _remove_moved(old, root, keep=step)
    return folder


def remove_folder(folder: str, root: str) -> None:
    """Remove a ``checkpoint-N`` folder; for one pointing into ``root``, that step too.

    The folder stops being a checkpoint at once (renamed to a hidden name, fsynced), then
    its step and its files go. A pointer into any other directory (copied from elsewhere, or
    hostile) loses its folder only: nothing outside ``root`` is ever removed.
    """
    if os.path.lexists(folder):
        _remove_moved(_move_aside(folder), root)


def rotate(run_dir: str, root: str, limit: int | None, newest: str, best: str | None) -> list[str]:
    """Keep at most ``limit`` checkpoint folders, as the Trainer's ``save_total_limit`` does;
    return the folders removed.

    Oldest first goes: folders the Trainer wrote itself (by N) are older than ours, and ours
    are ordered by their step in the root, i.e. by when they were saved (the Trainer orders
    by mtime for the same reason: after a resume from an older checkpoint, the newer-numbered
    folders of the abandoned run are the old ones). ``newest`` (the folder just published)
    and ``best`` (``TrainerState.best_model_checkpoint``) are never removed.
    """
    if limit is None or limit <= 0:
        return []
    ranked = []
    for n, path in checkpoint_folders(run_dir):
        try:
            p = read_pointer(path)
        except CheckpointError as e:
            log.warning("asyncckpt: %s; ordering it as a Trainer-written checkpoint", e)
            p = None
        ranked.append(((0, n) if p is None else (1, p.step), path))
    ranked.sort()
    protected = {os.path.abspath(newest)} | ({os.path.abspath(best)} if best else set())
    keep = max(limit, len(protected & {os.path.abspath(p) for _, p in ranked}))
    removed = []
    remaining = len(ranked)
    for _, path in ranked:
        if remaining <= keep:
            break
        if os.path.abspath(path) not in protected:
            remove_folder(path, root)
            removed.append(path)
            remaining -= 1
    return removed


def _move_aside(folder: str) -> str:
    parent, name = os.path.split(folder)
    aside = os.path.join(parent, f".{name}.removing-{uuid.uuid4().hex[:16]}")
    os.rename(folder, aside)
    return aside


def remove_leftovers(run_dir: str, root: str) -> list[str]:
    """Finish what a crash interrupted in ``run_dir``: remove half-written folders and the
    folders (with their steps) that were being removed; return them.

    Call only while nothing publishes into ``run_dir`` (before the first save of a run).
    """
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    done = []
    for name in names:
        m = _LEFTOVER.match(name)
        if m is None:
            continue
        path = os.path.join(run_dir, name)
        if m.group(1) == "removing":
            _remove_moved(path, root)
        else:
            remove_tree(path)
        done.append(path)
    return done


def _remove_moved(aside: str, root: str, keep: int | None = None) -> None:
    """Remove a folder already renamed aside, and the step of ``root`` it pointed at (unless
    that step is ``keep``, the one a new pointer of that name names)."""
    fsync_dir(os.path.dirname(aside))
    try:
        p = read_pointer(aside)
    except CheckpointError:
        p = None
    if p is not None and p.step != keep:
        if os.path.realpath(p.root) == os.path.realpath(root):
            drop_step(root, p.step)
        else:
            log.warning("asyncckpt: %s pointed outside %s; its step %d is left alone", aside, root, p.step)
    remove_tree(aside)
