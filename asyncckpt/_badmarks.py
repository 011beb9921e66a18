"""Verdicts of verification, remembered beside the checkpoints (torch-free).

When a reader (``load``, ``verify``) finds a committed checkpoint whose data fails its
checksums, it records that under ``ROOT/.asyncckpt/bad/`` so that ``asyncckpt ls`` can mark
the step without re-reading it. A mark names the attempt id of the manifest it judged, so a
mark never applies to a different checkpoint that later takes the same step. Recording is
best effort: a read-only reader simply leaves no mark.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid

from ._layout import META_DIR, step_dir_name

_BAD = "bad"
#: A mark file larger than this is ignored (it is ours and tiny; anything else is hostile).
_MAX_MARK_BYTES = 64 * 1024


def _bad_dir(root: str) -> str:
    return os.path.join(root, META_DIR, _BAD)


def record_bad(root: str | os.PathLike[str], step: int, attempt: str, path: str, reason: str) -> bool:
    """Remember that ``step`` (manifest ``attempt``) failed verification at ``path``.

    Returns whether the mark was written (False when the root is not writable).
    """
    d = _bad_dir(os.fspath(root))
    body = json.dumps({"step": step, "attempt": attempt, "path": path, "reason": reason, "time": time.time()})
    try:
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".{step_dir_name(step)}.{uuid.uuid4().hex[:8]}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(body)
        os.replace(tmp, os.path.join(d, step_dir_name(step) + ".json"))
    except OSError:
        return False
    return True


def bad_mark(root: str | os.PathLike[str], step: int, attempt: str) -> dict[str, object] | None:
    """The mark recorded for ``step`` if it judged this very ``attempt``, else ``None``."""
    p = os.path.join(_bad_dir(os.fspath(root)), step_dir_name(step) + ".json")
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        raw = os.read(fd, _MAX_MARK_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) > _MAX_MARK_BYTES:
        return None
    try:
        mark = json.loads(raw, parse_constant=lambda _c: math.nan)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(mark, dict) or mark.get("step") != step or mark.get("attempt") != attempt:
        return None
    return mark


def clear_bad(root: str | os.PathLike[str], step: int, attempt: str | None = None) -> bool:
    """Forget the mark of ``step`` (any, or with ``attempt`` only one that judged that very
    attempt: a later full verification of it passed). Returns whether a mark was removed."""
    if attempt is not None and bad_mark(root, step, attempt) is None:
        return False
    try:
        os.unlink(os.path.join(_bad_dir(os.fspath(root)), step_dir_name(step) + ".json"))
    except OSError:
        return False
    return True
