"""Verdicts of verification, remembered beside the checkpoints (torch-free; obstore only
for an object-store root, imported when one is used).

When a reader (``load``, ``verify``, ``export``) proves a content fault in a committed
checkpoint (a checksum mismatch, a malformed file) it records a *bad mark*, and from then
on that step is known bad (``_stepstates``): ``latest()`` passes over it, retention never
counts it, and saving the step again sets the bad attempt aside. A mark names the attempt
id of the manifest it judged, so it never applies to a different checkpoint that later
takes the same step, and it is dropped (:func:`clear`) when a later full verification of
that same attempt passes. Where marks live:

* a local root: ``ROOT/.asyncckpt/bad/step_N.<attempt>.json`` (one file per judged attempt;
  the single ``step_N.json`` of earlier versions is still read);
* an object-store root: ``P/.asyncckpt/bad/step_N.<attempt>.json`` on the store itself, so
  every node and every later job sees it.

``<attempt>`` is ``_layout.token_of`` the attempt id. A mark holds the file (an absolute
path or a URL, named once) and the reason. Recording is best effort: a read-only reader
(or one whose store credentials cannot write) leaves no mark on disk. A local mark that could
not be written (a full disk, EIO, a read-only root) is still remembered by the process that
proved the fault (:func:`record_bad`: in memory, per root, until a full verification of that
attempt passes), so the step stays known bad to it: ``latest()`` and ``save()``'s step checks
in that process never take it for resumable again.

Marks that cannot be read are never read as "no marks" (:func:`marks`): an I/O error on the
marks is a ``CheckpointReadError``, so no reader answers a step it cannot tell from a known-bad
one, and no retention retires by guess. Only an absent ``.asyncckpt/bad`` means none.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointReadError, ObjectIntegrityError, ObjectNotFoundError, ObjectStoreError
from ..format._layout import META_DIR, step_dir_name, token_of
from ..format._stepstates import Mark

if TYPE_CHECKING:
    from .objstore._client import ObjectStore
    from .objstore._reads import ObjectInfo

log = logging.getLogger("asyncckpt")

_BAD = "bad"
#: A mark file larger than this is ignored (it is ours and tiny; anything else is hostile).
_MAX_MARK_BYTES = 64 * 1024
#: Marks read from one root at most (a hostile directory must not make a listing unbounded).
_MAX_MARKS = 10_000
_NAME = re.compile(r"^step_(\d{8,19})\.([0-9a-f]{1,64})\.json$")
_LEGACY = re.compile(r"^step_(\d{8,19})\.json$")
#: Where the marks of an object-store root lie (relative to its prefix).
STORE_PREFIX = f"{META_DIR}/{_BAD}/"

#: Marks this process proved but could not write, per root (its real path): (step, token) ->
#: mark. Bounded like a listing; dropped by :func:`clear`.
_unwritten: dict[str, dict[tuple[int, str], Mark]] = {}
_unwritten_lock = threading.Lock()


def _bad_dir(root: str) -> str:
    return os.path.join(root, META_DIR, _BAD)


def mark_name(step: int, attempt: str) -> str:
    """The file (or key, under :data:`STORE_PREFIX`) of the mark of ``attempt`` of ``step``."""
    return f"{step_dir_name(step)}.{token_of(attempt)}.json"


def note(path: str, reason: str) -> tuple[str, str]:
    """``(path, reason)`` as a mark keeps them: a local path made absolute, and a reason that
    does not repeat it (``CheckpointCorruptError`` messages end in ``: PATH``)."""
    if path and "://" not in path:
        absolute = os.path.abspath(path)
        for p in (path, absolute):
            if reason.endswith(f": {p}"):
                reason = reason[: -len(p) - 2]
        path = absolute
    elif path and reason.endswith(f": {path}"):
        reason = reason[: -len(path) - 2]
    return path, reason


def _body(step: int, attempt: str, path: str, reason: str) -> bytes:
    path, reason = note(path, reason)
    doc = {"step": step, "attempt": attempt, "path": path, "reason": reason, "time": time.time()}
    return json.dumps(doc).encode()


def _parse(raw: bytes, step: int, attempt: str | None) -> dict[str, Any] | None:
    """A mark's JSON if it is one for ``step`` (and ``attempt``, unless ``None``)."""
    if len(raw) > _MAX_MARK_BYTES:
        return None
    try:
        mark = json.loads(raw, parse_constant=lambda _c: math.nan)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(mark, dict) or mark.get("step") != step or not isinstance(mark.get("attempt"), str):
        return None
    if attempt is not None and mark["attempt"] != attempt:
        return None
    return mark


def as_mark(mark: dict[str, Any]) -> Mark:
    """The :class:`~asyncckpt.format._stepstates.Mark` of a mark's JSON."""
    t = mark.get("time")
    return Mark(str(mark.get("path") or ""), str(mark.get("reason") or "failed verification"),
                float(t) if isinstance(t, (int, float)) and math.isfinite(t) else None)  # fmt: skip


# ------------------------------------------------------------------------------ a local root


def record_bad(root: str | os.PathLike[str], step: int, attempt: str, path: str, reason: str) -> bool:
    """Remember that ``step`` (manifest ``attempt``) failed verification at ``path``.

    Returns whether the mark was written. When it could not be (a full disk, EIO, a read-only
    root) it is remembered in this process instead (:func:`marks` includes it) and a WARNING
    says so: this process still passes over the step, a later one does not know.
    """
    d = _bad_dir(os.fspath(root))
    tmp = os.path.join(d, f".{step_dir_name(step)}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        os.makedirs(d, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(_body(step, attempt, path, reason))
        os.replace(tmp, os.path.join(d, mark_name(step, attempt)))
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        path, reason = note(path, reason)
        with _unwritten_lock:
            held = _unwritten.setdefault(os.path.realpath(root), {})
            if len(held) < _MAX_MARKS:
                held[(step, token_of(attempt))] = Mark(path, reason, time.time())
        log.warning(
            "asyncckpt: could not record that step %d under %s is bad (%s: %s); this process remembers it, "
            "a later one will find the step corrupt again", step, os.fspath(root), d, e.strerror or e,
        )  # fmt: skip
        return False
    return True


def _remembered(root: str) -> dict[tuple[int, str], Mark]:
    """The marks of ``root`` this process could not write (:func:`record_bad`)."""
    with _unwritten_lock:
        return dict(_unwritten.get(os.path.realpath(root), {}))


def _forget(root: str, step: int, attempt: str) -> bool:
    with _unwritten_lock:
        held = _unwritten.get(os.path.realpath(root))
        return held is not None and held.pop((step, token_of(attempt)), None) is not None


def _read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, _MAX_MARK_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


def _read_strictly(path: str) -> bytes | None:
    """A mark file's bytes; ``None`` when it is not there (dropped meanwhile) or not ours (a
    symlink, a directory); ``CheckpointReadError`` when the storage failed to serve it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP, errno.EISDIR, errno.ENOTDIR, errno.ENXIO):
            return None
        raise CheckpointReadError(e.errno, f"cannot read a bad mark ({e.strerror})", path) from None
    try:
        return os.read(fd, _MAX_MARK_BYTES + 1)
    except OSError as e:
        if e.errno in (errno.EISDIR, errno.EAGAIN):  # a directory, a FIFO planted under the name
            return None
        raise CheckpointReadError(e.errno, f"cannot read a bad mark ({e.strerror})", path) from None
    finally:
        os.close(fd)


def bad_mark(root: str | os.PathLike[str], step: int, attempt: str) -> dict[str, Any] | None:
    """The mark recorded for ``step`` if it judged this very ``attempt``, else ``None``."""
    held = _remembered(os.fspath(root)).get((step, token_of(attempt)))
    if held is not None:
        return {"step": step, "attempt": attempt, "path": held.path, "reason": held.reason, "time": held.time}
    d = _bad_dir(os.fspath(root))
    for name in (mark_name(step, attempt), step_dir_name(step) + ".json"):
        raw = _read(os.path.join(d, name))
        found = None if raw is None else _parse(raw, step, attempt)
        if found is not None:
            return found
    return None


def marks(root: str | os.PathLike[str]) -> dict[tuple[int, str], Mark]:
    """Every mark under ``root``: (step, ``token_of(attempt)``) -> mark, those this process
    could not write included. A malformed or foreign file is ignored; marks the storage cannot
    serve (EIO on the directory or on a mark) raise ``CheckpointReadError``: unreadable marks
    are never taken for "none" (module docstring). No ``.asyncckpt/bad``: no marks."""
    root_s = os.fspath(root)
    d = _bad_dir(root_s)
    try:
        names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        names = []
    except OSError as e:
        raise CheckpointReadError(
            e.errno, f"cannot read the bad marks ({e.strerror}): no step can be told resumable without them", d
        ) from None
    out: dict[tuple[int, str], Mark] = _remembered(root_s)
    for name in sorted(names)[:_MAX_MARKS]:
        m = _NAME.match(name) or _LEGACY.match(name)
        if m is None:
            continue
        step = int(m.group(1))
        raw = _read_strictly(os.path.join(d, name))
        mark = None if raw is None else _parse(raw, step, None)
        if mark is None:
            continue
        token = token_of(mark["attempt"])
        if m.re is _NAME and m.group(2) != token:
            continue  # renamed by hand: it names another attempt than its name says
        out.setdefault((step, token), as_mark(mark))
    return out


def clear(root: str | os.PathLike[str], step: int, attempt: str) -> bool:
    """Drop the mark of ``attempt`` of ``step`` (a full verification of it passed); returns
    whether one was dropped. Best effort, like recording."""
    d = _bad_dir(os.fspath(root))
    dropped = _forget(os.fspath(root), step, attempt)
    for name in (mark_name(step, attempt), step_dir_name(step) + ".json"):
        path = os.path.join(d, name)
        raw = _read(path)
        if raw is None or _parse(raw, step, attempt) is None:
            continue
        try:
            os.unlink(path)
            dropped = True
        except OSError:
            pass
    return dropped


# ------------------------------------------------------------------------ an object-store root


async def record_on_store(
    store: ObjectStore, step: int, attempt: str, url: str, reason: str, deadline: float
) -> bool:
    """Remember on the store that ``step`` (manifest ``attempt``) failed verification at
    ``url``. Returns whether the mark was written (False: the store refused or failed)."""
    try:
        await store.put_file(STORE_PREFIX + mark_name(step, attempt), memoryview(_body(step, attempt, url, reason)),
                             deadline)  # fmt: skip
    except ObjectStoreError:
        return False
    return True


async def store_marks(
    store: ObjectStore, deadline: float, *, listed: list[ObjectInfo] | None = None,
    cache: dict[str, tuple[str, Mark | None]] | None = None,
) -> dict[tuple[int, str], Mark]:
    """Every mark on the store: (step, ``token_of(attempt)``) -> mark (one LIST, and one GET
    per mark). ``listed``: the objects under :data:`STORE_PREFIX` as a listing already showed
    them (no LIST then); ``cache``: key -> (ETag, mark) of marks read before, so a mark whose
    listed ETag is unchanged costs no GET. A store failure propagates; a mark gone meanwhile
    or malformed is ignored."""
    out: dict[tuple[int, str], Mark] = {}
    if listed is None:
        listed = await store.list(STORE_PREFIX, deadline)
    infos = sorted((o for o in listed if o.key.startswith(STORE_PREFIX)), key=lambda o: o.key)
    for o in infos[:_MAX_MARKS]:
        key = o.key
        m = _NAME.match(key[len(STORE_PREFIX):])
        if m is None:
            continue
        step = int(m.group(1))
        hit = cache.get(key) if cache is not None and o.e_tag else None
        if hit is not None and hit[0] == o.e_tag:
            if hit[1] is not None:
                out[(step, m.group(2))] = hit[1]
            continue
        try:
            raw, info = await store.get_object(key, deadline, limit=_MAX_MARK_BYTES)
        except (ObjectNotFoundError, ObjectIntegrityError):
            continue
        mark = _parse(raw, step, None)
        found = as_mark(mark) if mark is not None and token_of(mark["attempt"]) == m.group(2) else None
        if cache is not None and info.e_tag:
            cache[key] = (info.e_tag, found)
        if found is not None:
            out[(step, m.group(2))] = found
    if cache is not None:  # forget marks no longer there
        for key in set(cache) - {o.key for o in infos}:
            del cache[key]
    return out


async def clear_on_store(store: ObjectStore, step: int, attempt: str, deadline: float) -> bool:
    """Drop the store's mark of ``attempt`` of ``step``; returns whether a delete was sent
    without error (deleting an absent key is not an error on S3)."""
    try:
        await store.delete([STORE_PREFIX + mark_name(step, attempt)], deadline)
    except ObjectStoreError:
        return False
    return True
