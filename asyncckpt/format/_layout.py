"""Names on disk: which directory holds which step, and which names are leftovers.

::

    ROOT/
      step_00000297/                 a committed checkpoint (renamed into place last)
        manifest.json                the completion marker: files, sizes, CRC-32C
        rank00000.safetensors        rank 0's tensors, named by dotted key path
        rank00000.json               rank 0's structure and non-tensor values
      step_00000300.tmp-<attempt>/   a save in progress, or a crashed/failed one
      step_00000100.deleting-<id>/   a checkpoint being retired
      step_00000290.bad-<attempt>/   a bad attempt set aside when step 290 was saved again
                                     (kept for inspection; never a leftover: `gc --remove-bad`)
      .asyncckpt/                    the root's own metadata (owner lock, verification marks)

On an object store the same names are key prefixes (``roots.objstore._steps``)::

    P/step_00000300/manifest.json              the commit object
    P/step_00000300/a-<attempt>/rank00000.*    the attempt's data
    P/step_00000290/bad-<attempt>.json         a bad attempt set aside: its manifest's bytes
                                               (its data stays under a-<attempt>/)
    P/.asyncckpt/                              the root's metadata (lease, verification marks)
"""

from __future__ import annotations

import re

#: The root's metadata directory; never a checkpoint, never a leftover.
META_DIR = ".asyncckpt"

#: The largest step: the largest signed 64-bit integer (19 digits); larger steps are refused.
MAX_STEP = 2**63 - 1

_STEP = re.compile(r"^step_(\d{8,19})$")
_LEFTOVER = re.compile(r"^step_(\d{8,19})\.(tmp|deleting)-[0-9a-f]{1,64}$")
_ASIDE = re.compile(r"^step_(\d{8,19})\.bad-([0-9a-f]{1,64})$")
_HEX = re.compile(r"^[0-9a-f]{1,64}$")


def _step(m: re.Match[str] | None) -> int | None:
    if m is None:
        return None
    step = int(m.group(1))
    return step if step <= MAX_STEP else None


def check_step(step: object, what: str = "step") -> int:
    """``step`` if it is an int in ``0..MAX_STEP``; else ``TypeError``/``ValueError`` naming it."""
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"{what} must be a non-negative int, not {step!r}")
    if step < 0:
        raise ValueError(f"{what} must be a non-negative int, not {step!r}")
    if step > MAX_STEP:
        raise ValueError(f"{what} must be at most 2**63 - 1 = {MAX_STEP}, not {step!r}")
    return step


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def tmp_dir_name(step: int, attempt: str) -> str:
    return f"{step_dir_name(step)}.tmp-{attempt}"


def deleting_dir_name(step: int, token: str) -> str:
    return f"{step_dir_name(step)}.deleting-{token}"


def token_of(attempt: str) -> str:
    """A file-name-safe token for manifest ``attempt``: the id itself when it is a hex token
    (every attempt the library makes), else a hash of it (a hostile or foreign manifest)."""
    if _HEX.match(attempt):
        return attempt
    import hashlib

    return hashlib.sha256(attempt.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def aside_dir_name(step: int, attempt: str) -> str:
    """The name a bad attempt of ``step`` is set aside under (``token_of`` its attempt)."""
    return f"{step_dir_name(step)}.bad-{token_of(attempt)}"


def manifest_key(step: int) -> str:
    """The key of ``step``'s commit object on an object store (relative to the root)."""
    return f"{step_dir_name(step)}/manifest.json"


def data_prefix(step: int, attempt: str) -> str:
    """The key prefix of ``attempt``'s objects of ``step`` on an object store."""
    return f"{step_dir_name(step)}/a-{attempt}/"


def aside_key(step: int, attempt: str) -> str:
    """The key of the record of a bad attempt of ``step`` set aside on an object store."""
    return f"{step_dir_name(step)}/bad-{token_of(attempt)}.json"


def parse_step_dir(name: str) -> int | None:
    """The step a committed-looking directory name stands for, else ``None``."""
    return _step(_STEP.match(name))


def parse_leftover(name: str) -> int | None:
    """The step of an in-progress or retiring directory name, else ``None``."""
    return _step(_LEFTOVER.match(name))


def parse_aside(name: str) -> tuple[int, str] | None:
    """The step and attempt token of a set-aside directory name (``step_N.bad-T``), else ``None``."""
    m = _ASIDE.match(name)
    step = _step(m)
    return None if m is None or step is None else (step, m.group(2))
