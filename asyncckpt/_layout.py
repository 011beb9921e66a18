"""Names on disk: which directory holds which step, and which names are leftovers.

::

    ROOT/
      step_00000297/                 a committed checkpoint (renamed into place last)
        manifest.json                the completion marker: files, sizes, CRC-32C
        rank00000.safetensors        rank 0's tensors, named by dotted key path
        rank00000.json               rank 0's structure and non-tensor values
      step_00000300.tmp-<attempt>/   a save in progress, or a crashed/failed one
      step_00000100.deleting-<id>/   a checkpoint being retired
      .asyncckpt/                    the root's own metadata (owner lock, verification marks)
"""

from __future__ import annotations

import re

#: The root's metadata directory; never a checkpoint, never a leftover.
META_DIR = ".asyncckpt"

#: The largest step: the largest signed 64-bit integer (19 digits); larger steps are refused.
MAX_STEP = 2**63 - 1

_STEP = re.compile(r"^step_(\d{8,19})$")
_LEFTOVER = re.compile(r"^step_(\d{8,19})\.(tmp|deleting)-[0-9a-f]{1,64}$")


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


def parse_step_dir(name: str) -> int | None:
    """The step a committed-looking directory name stands for, else ``None``."""
    return _step(_STEP.match(name))


def parse_leftover(name: str) -> int | None:
    """The step of an in-progress or retiring directory name, else ``None``."""
    return _step(_LEFTOVER.match(name))
