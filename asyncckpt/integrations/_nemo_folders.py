"""NeMo Automodel's checkpoint directory (``epoch_E_step_S/`` folders, ``LATEST`` and
``LOWEST_VAL`` pointers, ``max_recent_checkpoints``) as pointers to asyncckpt steps.

::

    CHECKPOINT_DIR/
      .asyncckpt-nemo/               the asyncckpt root: step_00000004/, ... (asyncckpt ls/verify work)
      epoch_0_step_4/                published once its step committed (never before)
        asyncckpt.json               {"format": "asyncckpt-nemo-automodel/1", "root": "../.asyncckpt-nemo",
                                      "step": 4, "epoch": 0, "global_step": 4, "metric_key": ..., "val_metric": ...}
        losses.json, config.yaml     what NeMo writes there (its LOWEST_VAL and config checks read them)
      LATEST -> epoch_0_step_4       a relative symlink, as NeMo writes it (LATEST.txt where links fail)
      LOWEST_VAL -> epoch_0_step_4

NeMo's global step S is saved as step S of the root, except when the root already holds
step S or a later one (a run resumed from an older checkpoint): then the next free step.
The pointer says which.

A save first writes its folder under a hidden name (``.epoch_E_step_S.tmp-<hex>``), before
the step's own save starts; once the step committed, the folder is renamed into place and
``LATEST`` moved to it. A process killed between the commit and the rename leaves the hidden
folder naming a committed step: :func:`recover` publishes it at the next start. So a step
that committed is published, and a published folder always names a committed step. Nothing
here imports NeMo.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import uuid
from dataclasses import dataclass

from .._errors import CheckpointError
from ..roots.posix._remove_tree import remove_tree
from ._publish import drop_step, fsync_dir, write_durably

log = logging.getLogger("asyncckpt")

#: The asyncckpt root inside NeMo's ``checkpoint_dir``.
ROOT_NAME = ".asyncckpt-nemo"
#: The pointer file inside an ``epoch_E_step_S`` folder.
POINTER_NAME = "asyncckpt.json"
FORMAT = "asyncckpt-nemo-automodel/1"
LATEST = "LATEST"
LOWEST_VAL = "LOWEST_VAL"
_FOLDER = re.compile(r"^epoch_(\d+)_step_(\d+)$")
_LEFTOVER = re.compile(r"^\.epoch_\d+_step_\d+\.(tmp|removing)-[0-9a-f]{16}$")
_MAX_POINTER = 64 * 1024


@dataclass(frozen=True)
class Pointer:
    """What an ``epoch_E_step_S`` folder of ours names: ``step`` of the asyncckpt ``root``."""

    folder: str
    root: str
    step: int
    epoch: int
    global_step: int
    metric_key: str
    val_metric: float | None


def folder_name(epoch: int, global_step: int) -> str:
    return f"epoch_{epoch}_step_{global_step}"


def read_pointer(folder: str) -> Pointer | None:
    """The pointer of ``folder``, or ``None`` when it has none (a folder NeMo wrote itself).

    Raises ``CheckpointError`` when ``asyncckpt.json`` is there but not a valid pointer.
    """
    path = os.path.join(folder, POINTER_NAME)
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_POINTER + 1)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        doc = json.loads(raw.decode("utf-8")) if len(raw) <= _MAX_POINTER else None
    except (UnicodeDecodeError, ValueError):
        doc = None
    metric = doc.get("val_metric") if isinstance(doc, dict) else None
    if not (
        isinstance(doc, dict)
        and doc.get("format") == FORMAT
        and isinstance(doc.get("root"), str)
        and isinstance(doc.get("metric_key"), str)
        and all(type(doc.get(k)) is int and doc[k] >= 0 for k in ("step", "epoch", "global_step"))
        and (metric is None or (type(metric) in (int, float) and math.isfinite(metric)))
    ):
        raise CheckpointError(f"{path} is not an asyncckpt pointer (format {FORMAT})")
    root = os.path.normpath(os.path.join(os.path.abspath(folder), doc["root"]))
    return Pointer(
        os.path.abspath(folder), root, doc["step"], doc["epoch"], doc["global_step"], doc["metric_key"],
        None if metric is None else float(metric),
    )  # fmt: skip


def checkpoint_folders(ckpt_dir: str) -> list[tuple[int, str]]:
    """``(S, path)`` of every ``epoch_E_step_S`` folder in ``ckpt_dir`` (not symlinks), by S:
    the folders NeMo lists (``list_automodel_checkpoints``), ours and its own."""
    ckpt_dir = os.path.abspath(ckpt_dir)
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = _FOLDER.match(name)
        path = os.path.join(ckpt_dir, name)
        if m is not None and os.path.isdir(path) and not os.path.islink(path):
            found.append((int(m.group(2)), path))
    return sorted(found)


def write_pending(ckpt_dir: str, root: str, step: int, epoch: int, global_step: int,
                  files: dict[str, bytes], metric_key: str, val_metric: float | None) -> str:  # fmt: skip
    """Write the folder of a save about to start under a hidden name; return its path.

    ``files`` (``losses.json``, ``config.yaml``) and the pointer are written but not
    fsynced: :func:`publish` makes them durable before the folder appears, and a folder left
    by a crash is validated by :func:`recover`.
    """
    tmp = os.path.join(ckpt_dir, f".{folder_name(epoch, global_step)}.tmp-{uuid.uuid4().hex[:16]}")
    os.mkdir(tmp)
    doc = {
        "format": FORMAT, "root": os.path.relpath(root, os.path.join(ckpt_dir, folder_name(epoch, global_step))),
        "step": step, "epoch": epoch, "global_step": global_step, "metric_key": metric_key, "val_metric": val_metric,
    }  # fmt: skip
    try:
        for name, data in {**files, POINTER_NAME: json.dumps(doc).encode()}.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
    except BaseException:
        remove_tree(tmp)
        raise
    return tmp


def publish(pending: str, root: str, keep: int | None) -> str:
    """Make the pending folder ``pending`` (its step committed) visible under its name, move
    ``LATEST`` to it, ``LOWEST_VAL`` if its metric is the lowest, and apply ``keep``
    (``max_recent_checkpoints``); return the folder.

    A folder already there under that name (an abandoned run's, or NeMo's own) is renamed
    aside first and removed after, with the step it pointed at.
    """
    p = read_pointer(pending)
    if p is None:
        raise CheckpointError(f"{pending} has no {POINTER_NAME}")
    ckpt_dir = os.path.dirname(os.path.abspath(pending))
    folder = os.path.join(ckpt_dir, folder_name(p.epoch, p.global_step))
    for name in os.listdir(pending):
        with open(os.path.join(pending, name), "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(pending)
    old = _move_aside(folder) if os.path.lexists(folder) else None
    os.rename(pending, folder)
    fsync_dir(ckpt_dir)
    if old is not None:
        _remove_moved(old, root, keep=p.step)
    set_link(ckpt_dir, LATEST, folder)
    if p.val_metric is not None:
        best = _linked_metric(ckpt_dir, p.metric_key)
        if best is None or p.val_metric < best:
            set_link(ckpt_dir, LOWEST_VAL, folder)
    prune(ckpt_dir, root, keep)
    return folder


def read_link(ckpt_dir: str, name: str) -> str | None:
    """The absolute path ``ckpt_dir/NAME`` (a symlink, else ``NAME.txt``) points at, as NeMo's
    ``read_checkpoint_pointer`` resolves it; ``None`` without one."""
    link = os.path.join(ckpt_dir, name)
    raw = None
    try:
        if os.path.islink(link):
            raw = os.readlink(link)
        elif os.path.isfile(f"{link}.txt"):
            with open(f"{link}.txt", encoding="utf-8") as f:
                raw = f.read(_MAX_POINTER).strip()
    except (OSError, UnicodeError):
        return None
    if not raw:
        return None
    return os.path.abspath(raw if os.path.isabs(raw) else os.path.join(os.path.abspath(ckpt_dir), raw))


def set_link(ckpt_dir: str, name: str, folder: str) -> None:
    """Point ``ckpt_dir/NAME`` at ``folder`` atomically and durably: a relative symlink made
    under a temporary name and renamed over the old one (``NAME.txt`` where symlinks fail),
    the directory fsynced. Readers see the old target or the new one, never neither."""
    link = os.path.join(ckpt_dir, name)
    target = os.path.relpath(os.path.abspath(folder), os.path.abspath(ckpt_dir))
    tmp = os.path.join(ckpt_dir, f".{name}.{uuid.uuid4().hex}.tmp")
    try:
        os.symlink(target, tmp)
    except OSError:  # a file system without symlinks: NeMo's text fallback
        write_durably(f"{link}.txt", target.encode("utf-8"))
        if os.path.lexists(link):
            os.remove(link)
    else:
        os.replace(tmp, link)
        if os.path.exists(f"{link}.txt"):
            os.remove(f"{link}.txt")
    fsync_dir(ckpt_dir)


def prune(ckpt_dir: str, root: str, keep: int | None) -> list[str]:
    """NeMo's ``max_recent_checkpoints``: keep the ``keep`` complete folders of the highest
    S and every folder a top-level pointer (``LATEST``, ``LOWEST_VAL``, any other symlink or
    upper-case ``.txt``) points into; remove the others, ours with their steps. Return them."""
    if keep is None:
        return []
    ckpt_dir = os.path.abspath(ckpt_dir)
    folders = checkpoint_folders(ckpt_dir)
    complete = [path for _, path in folders if not os.path.exists(os.path.join(path, ".incomplete"))]
    kept = set(complete[-keep:] if keep > 0 else []) | _pointed_at(ckpt_dir, [path for _, path in folders])
    removed = []
    for _, path in folders:
        if path not in kept:
            remove_folder(path, root)
            removed.append(path)
    return removed


def remove_folder(folder: str, root: str) -> None:
    """Remove an ``epoch_E_step_S`` folder; for one pointing into ``root``, its step too.

    The folder stops being a checkpoint at once (renamed to a hidden name, fsynced), then
    its step and its files go. Nothing outside ``root`` and the folder is ever removed.
    """
    if os.path.lexists(folder):
        _remove_moved(_move_aside(folder), root)


def recover(ckpt_dir: str, root: str, committed: set[int], keep: int | None) -> list[str]:
    """Finish what a crash interrupted in ``ckpt_dir``; return the folders published.

    A pending folder whose step committed is published (the process died between the commit
    and the rename), one whose step did not is removed; folders being removed are removed
    with their steps. If ``LATEST`` names a folder of ours older than our newest folder (the
    process died between the rename and the pointer), it is moved to the newest. Call only
    while nothing publishes into ``ckpt_dir`` (before the first save of a run).
    """
    ckpt_dir = os.path.abspath(ckpt_dir)
    try:
        names = sorted(os.listdir(ckpt_dir))
    except FileNotFoundError:
        return []
    pending = []
    for name in names:
        m = _LEFTOVER.match(name)
        if m is None:
            continue
        path = os.path.join(ckpt_dir, name)
        if m.group(1) == "removing":
            _remove_moved(path, root)
            continue
        try:
            p = read_pointer(path)
        except CheckpointError:
            p = None
        if p is not None and p.step in committed and os.path.realpath(p.root) == os.path.realpath(root):
            pending.append((p.step, path))
        else:
            remove_tree(path)
    published = []
    for _, path in sorted(pending):
        published.append(publish(path, root, keep))
        log.warning("asyncckpt: published %s: its step had committed before the process was stopped", published[-1])
    ours = []
    for _, path in checkpoint_folders(ckpt_dir):
        try:
            p = read_pointer(path)
        except CheckpointError:
            p = None
        if p is not None and p.step in committed:
            ours.append((p.step, path))
    latest = read_link(ckpt_dir, LATEST)
    if ours and latest != os.path.abspath(max(ours)[1]):
        try:
            current = read_pointer(latest) if latest is not None else None
        except CheckpointError:
            current = None
        if latest is None or (current is not None and current.step < max(ours)[0]):
            set_link(ckpt_dir, LATEST, max(ours)[1])
    return published


def _linked_metric(ckpt_dir: str, metric_key: str) -> float | None:
    """The metric of the folder ``LOWEST_VAL`` points at, read as NeMo's
    ``read_checkpoint_metric`` reads ``losses.json`` (``metric_key``, then ``val_loss``, ``default``)."""
    target = read_link(ckpt_dir, LOWEST_VAL)
    if target is None or not os.path.isdir(target):
        return None
    try:
        with open(os.path.join(target, "losses.json"), encoding="utf-8") as f:
            losses = json.loads(f.read(_MAX_POINTER))
    except (OSError, UnicodeError, ValueError):
        return None
    if not isinstance(losses, dict):
        return None
    for key in (metric_key, "val_loss", "default"):
        try:
            value = float(losses[key])
        except (KeyError, TypeError, ValueError, OverflowError):
            continue
        if math.isfinite(value):
            return value
    return None


def _pointed_at(ckpt_dir: str, folders: list[str]) -> set[str]:
    """The folders that a top-level symlink or upper-case ``NAME.txt`` of ``ckpt_dir`` points
    at or into (NeMo's ``find_pointer_protected_checkpoints``)."""
    protected = set()
    for entry in os.listdir(ckpt_dir):
        path = os.path.join(ckpt_dir, entry)
        if os.path.islink(path):
            name = entry
        elif entry.endswith(".txt") and entry[:-4].isupper() and os.path.isfile(path):
            name = entry[:-4]
        else:
            continue
        target = read_link(ckpt_dir, name)
        for folder in folders:
            if target is not None and (target == folder or target.startswith(folder + os.sep)):
                protected.add(folder)
    return protected


def _move_aside(folder: str) -> str:
    parent, name = os.path.split(folder)
    aside = os.path.join(parent, f".{name}.removing-{uuid.uuid4().hex[:16]}")
    os.rename(folder, aside)
    return aside


def _remove_moved(aside: str, root: str, keep: int | None = None) -> None:
    """Remove a folder already renamed aside, and the step of ``root`` it pointed at (unless
    that step is ``keep``, the one a new folder of that name names)."""
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
