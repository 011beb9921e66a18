"""The one listing of a local root: every step-like directory (committed, leftover, retiring,
set aside) with its state under the library's one rule (``_stepstates``), size and age.

``asyncckpt ls`` and ``gc`` read a local root through :func:`scan` (by way of
:class:`~asyncckpt.roots.posix._root.PosixRoot`); never raises for one bad directory, so one
damaged step never hides the others."""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass
from typing import Any, Literal

from ..._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    without_path,
)
from ...format._layout import META_DIR, parse_aside, parse_leftover, parse_step_dir, step_dir_name
from ...format._manifest import Manifest
from ...format._stepstates import Mark, Seen, State, state_of
from .._badmarks import marks
from ._discovery import KnownBad, Vanished, observe_committed, read_manifest

#: A ``created`` time outside this range (seconds since the epoch) is shown as unknown.
_TIME_RANGE = (0.0, 2.0**33)

Status = Literal["complete", "incomplete", "bad", "aside"]
#: Problems that prove a content fault of the checkpoint (its step is then known bad).
_PROVEN = frozenset({"corrupt-manifest", "step-mismatch", "missing-file", "not-regular-file", "size-mismatch"})


def timestamp(value: float | None) -> float | None:
    """``value`` if it is a plausible wall-clock time, else ``None`` (NaN, inf, 1e300, negative)."""
    if value is None or not math.isfinite(value) or not _TIME_RANGE[0] <= value < _TIME_RANGE[1]:
        return None
    return value


# ---------------------------------------------------------------------------- step directories


@dataclass(frozen=True)
class StepDir:
    """One step-like directory under a root.

    ``state`` is the library's one rule (``_stepstates``): ``complete`` (resumable: what
    ``latest()`` and ``load()`` take), ``bad`` (known bad), ``incomplete``, ``leftover``,
    ``retiring`` or ``aside`` (a bad attempt set aside when its step was saved again).
    ``complete`` is true when the directory is a complete checkpoint (``load(step=N)`` reads
    it); ``bad`` then holds the verification mark (``path``, ``reason``, ``time``) if someone
    found its checksums wrong. ``problem`` is a stable code (``no-marker``,
    ``corrupt-manifest``, ``step-mismatch``, ``missing-file``,
    ``not-regular-file``, ``size-mismatch``, ``not-a-directory``, ``non-canonical-name``,
    ``save-leftover``, ``retire-leftover``, ``set-aside``, ``unreadable``) and ``reason`` its
    explanation; both ``None`` for complete steps. ``files`` counts the files in the
    directory (the manifest included) and ``size`` their bytes; ``ranks`` comes from the
    manifest, else from the rank file names. ``created`` is ``None`` when unknown or
    implausible; ``modified`` is the newest mtime. ``note`` names what decides nothing but is
    worth knowing: files the manifest does not list (ignored by every read).
    """

    step: int
    name: str
    path: str
    complete: bool
    problem: str | None
    reason: str | None
    size: int
    files: int
    ranks: int | None
    created: float | None
    modified: float
    attempt: str | None = None
    bad: dict[str, object] | None = None
    state: State = "incomplete"
    #: the run the step belongs to (its manifest's; ``None``: none recorded, or no manifest)
    run: str | None = None
    note: str | None = None

    @property
    def status(self) -> Status:
        """``complete`` (resumable), ``bad`` (known bad: a verification failed, or the files
        prove it damaged), ``aside`` (a bad attempt set aside), or ``incomplete``."""
        if self.state in ("complete", "bad", "aside"):
            return self.state
        return "incomplete"

    @property
    def resumable(self) -> bool:
        """Whether ``latest()`` / ``load(step=None)`` may take this step."""
        return self.state == "complete"

    def as_json(self, now: float) -> dict[str, Any]:
        """The row as a JSON-ready dict (``age_s`` measured from ``now``)."""
        since = self.created if self.created is not None else self.modified
        return {
            "step": self.step,
            "name": self.name,
            "path": os.path.abspath(self.path),
            "status": self.status,
            "state": self.state,
            "resumable": self.resumable,
            "complete": self.complete,
            "problem": self.problem,
            "reason": self.reason,
            "note": self.note,
            "bad": self.bad,
            "size": self.size,
            "files": self.files,
            "ranks": self.ranks,
            "attempt": self.attempt,
            "run": self.run,
            "created": self.created,
            "modified": self.modified,
            "age_s": round(now - since, 3),
        }


@dataclass(frozen=True)
class Usage:
    size: int
    files: int
    ranks: int | None
    modified: float


def _rank_of(name: str) -> int | None:
    for suffix in (".safetensors", ".json"):
        if name.startswith("rank") and name.endswith(suffix):
            digits = name[4 : -len(suffix)]
            if len(digits) == 5 and digits.isdigit() and digits.isascii():
                return int(digits)
    return None


def usage(path: str) -> Usage:
    """Bytes, file count, ranks (from rank file names) and newest mtime of ``path``; never follows links."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        return Usage(st.st_size if stat.S_ISREG(st.st_mode) else 0, 1, None, st.st_mtime)
    size, files, newest = 0, 0, st.st_mtime
    ranks: set[int] = set()
    try:
        with os.scandir(path) as it:
            for entry in it:
                files += 1
                rank = _rank_of(entry.name)
                if rank is not None:
                    ranks.add(rank)
                try:
                    est = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                newest = max(newest, est.st_mtime)
                if stat.S_ISREG(est.st_mode):
                    size += est.st_size
    except OSError:
        pass
    return Usage(size, files, len(ranks) or None, newest)


def _diagnose_files(step_dir: str, manifest: Manifest) -> tuple[str, str]:
    """Why the files of ``step_dir`` do not match ``manifest`` (the library's order of checks)."""
    for f in manifest.files:
        try:
            st = os.lstat(os.path.join(step_dir, f.name))
        except OSError:
            return "missing-file", f"{f.name} is missing"
        if not stat.S_ISREG(st.st_mode):
            return "not-regular-file", f"{f.name} is not a regular file"
        if st.st_size != f.size:
            return "size-mismatch", f"size mismatch: {f.name} is {st.st_size} bytes, the manifest says {f.size}"
    return "unreadable", "the files do not match the manifest"


def _mark_json(mark: Mark | None, step: int, attempt: str | None) -> dict[str, object] | None:
    if mark is None:
        return None
    return {"step": step, "attempt": attempt, "path": mark.path, "reason": mark.reason, "time": mark.time}


def _examine_committed(root: str, name: str, step: int, known: dict[tuple[int, str], Mark]) -> StepDir:
    """Classify a directory with a committed-looking name: the state is the library's rule
    (``_discovery.observe_committed``); the problem code says what is wrong in detail."""
    path = os.path.join(root, name)
    use = usage(path)
    manifest: Manifest | None = None
    problem: str | None = None
    reason: str | None = None
    mark: Mark | None = None
    ranks: int | None = None
    run: str | None = None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        problem, reason = "not-a-directory", "a symbolic link (the library never follows one)"
    elif not stat.S_ISDIR(st.st_mode):
        problem, reason = "not-a-directory", "not a directory"
    elif name != step_dir_name(step):
        problem, reason = "non-canonical-name", f"not the canonical name {step_dir_name(step)}; the library ignores it"
    else:
        try:
            seen, info, err = observe_committed(root, step, known)
        except Vanished:
            raise FileNotFoundError(path) from None
        mark = seen.mark
        ranks = info.world_size if info is not None else None
        run = info.run if info is not None else None
        if isinstance(err, CheckpointNotFoundError):
            problem, reason = "no-marker", "no completion marker (manifest.json is missing)"
        elif isinstance(err, CheckpointReadError):
            problem, reason = "unreadable", without_path(err)
        elif isinstance(err, CheckpointCorruptError) and not isinstance(err, KnownBad):
            try:
                manifest = read_manifest(path)
            except CheckpointError as me:
                problem, reason = "corrupt-manifest", f"corrupt manifest: {without_path(me)}"
            else:
                if manifest.step != step:
                    problem, reason = "step-mismatch", f"the manifest is for step {manifest.step}"
                else:
                    problem, reason = _diagnose_files(path, manifest)
                    if problem == "unreadable":
                        reason = without_path(err)
    state: State = state_of(Seen(step, name, "committed", mark=mark)) if problem is None else (
        "bad" if problem in _PROVEN else "incomplete")
    created: float | None
    if problem is None:
        created, attempt = seen.created, seen.attempt
    else:
        created = manifest.created if manifest is not None else None
        attempt = manifest.attempt if manifest is not None else None
        ranks = manifest.world_size if manifest is not None else use.ranks
    return StepDir(
        step=step,
        name=name,
        path=path,
        complete=problem is None,
        problem=problem,
        reason=reason,
        size=use.size,
        files=use.files,
        ranks=ranks,
        created=timestamp(created),
        modified=use.modified,
        attempt=attempt,
        bad=_mark_json(mark, step, attempt) if problem is None else None,
        state=state,
        run=run if run is not None or manifest is None else manifest.run,
        note=seen.note if problem is None else None,
    )


def _examine_leftover(root: str, name: str, step: int) -> StepDir:
    """Describe an in-progress (``.tmp-``) or retiring (``.deleting-``) directory."""
    path = os.path.join(root, name)
    use = usage(path)
    if ".tmp-" in name:
        problem, reason, state = "save-leftover", "leftover of a crashed save attempt (or a save still in progress)", \
            "leftover"
    else:
        problem, reason, state = "retire-leftover", "leftover of an interrupted retirement (being deleted)", "retiring"
    return StepDir(step, name, path, False, problem, reason, use.size, use.files, use.ranks, None, use.modified,
                   state=state)  # type: ignore[arg-type]


def _examine_aside(root: str, name: str, step: int, token: str, known: dict[tuple[int, str], Mark]) -> StepDir:
    """Describe a bad attempt set aside (``step_N.bad-<attempt>``) when its step was saved again."""
    path = os.path.join(root, name)
    use = usage(path)
    mark = known.get((step, token))
    reason = f"bad attempt set aside when step {step} was saved again; kept for inspection (gc --remove-bad)"
    if mark is not None:
        reason += f"; verification failed: {mark}"
    return StepDir(step, name, path, False, "set-aside", reason, use.size, use.files, use.ranks, None, use.modified,
                   token, _mark_json(mark, step, token), "aside")


def _examine(root: str, name: str, known: dict[tuple[int, str], Mark]) -> StepDir | None:
    step = parse_step_dir(name)
    if step is not None:
        return _examine_committed(root, name, step, known)
    step = parse_leftover(name)
    if step is not None:
        return _examine_leftover(root, name, step)
    aside = parse_aside(name)
    if aside is not None:
        return _examine_aside(root, name, aside[0], aside[1], known)
    return None


def scan(root: str) -> list[StepDir]:
    """Every step directory under ``root`` (complete, incomplete, leftovers), oldest step first.

    Names that are not step-like (and the root's ``.asyncckpt`` metadata) are ignored. A
    directory that cannot be read is reported as ``unreadable``, never raised, so one bad
    step never hides the others. Raises ``CheckpointNotFoundError`` if ``root`` is not a
    directory.
    """
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointNotFoundError(f"{root} is not a directory") from None
    except OSError as e:
        raise CheckpointError(f"cannot list {root} ({e.strerror})") from None
    out: list[StepDir] = []
    known = marks(root)
    for name in names:
        if name == META_DIR:
            continue
        try:
            d = _examine(root, name, known)
        except FileNotFoundError:
            continue  # removed while we looked
        except (OSError, CheckpointError, ValueError, OverflowError, RecursionError, MemoryError) as e:
            step = parse_step_dir(name)
            step = parse_leftover(name) if step is None else step
            aside = parse_aside(name)
            step = aside[0] if step is None and aside is not None else step
            if step is None:
                continue
            d = StepDir(step, name, os.path.join(root, name), False, "unreadable", f"cannot examine ({e})", 0, 0, None,
                        None, 0.0)  # fmt: skip
        if d is not None:
            out.append(d)
    out.sort(key=lambda d: (d.step, d.complete, d.modified, d.name))
    return out
