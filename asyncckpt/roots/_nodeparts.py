"""A node's parts of steps on a node-local root, and the agreement on which step every rank holds.

On a node-local root (``saving._nodelocal``) a node's ``step_N/`` holds the whole step's
manifest but only that node's ranks' files. Torch-free; store calls only (``ranks._agree``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from typing import Any

from .._errors import CheckpointCorruptError, CheckpointNotFoundError
from ..format import _manifest
from ..format._layout import step_dir_name
from ..ranks._agree import agree
from ..ranks._distributed import DistContext
from .posix._discovery import read_manifest

_STEP_DIR = re.compile(r"step_(\d{8,})$")


def part_state(root: str, step: int, ranks: Collection[int]) -> _manifest.Manifest | None:
    """The manifest of ``step`` on this node's ``root`` if its files of ``ranks`` are all there
    with the sizes it lists (the part is complete for them); ``None`` otherwise."""
    step_dir = os.path.join(root, step_dir_name(step))
    try:
        m = read_manifest(step_dir)
    except (CheckpointNotFoundError, CheckpointCorruptError, OSError):
        return None
    for r in ranks:
        for name in (_manifest.shard_name(r), _manifest.tree_name(r)):
            try:
                size = m.file(name).size
                st = os.stat(os.path.join(step_dir, name), follow_symlinks=False)
            except (CheckpointCorruptError, OSError):
                return None
            if not os.path.isfile(os.path.join(step_dir, name)) or st.st_size != size:
                return None
    return m


def parts(root: str, ranks: Collection[int]) -> dict[int, tuple[str, str | None]]:
    """Every step under this node's ``root`` complete for ``ranks``: step -> (attempt, run)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return {}
    out: dict[int, tuple[str, str | None]] = {}
    for name in names:
        hit = _STEP_DIR.match(name)
        if hit is None:
            continue
        m = part_state(root, int(hit.group(1)), ranks)
        if m is not None and m.step == int(hit.group(1)):
            out[m.step] = (m.attempt, m.run)
    return out


def agree_parts(dist: DistContext, key: str, root: str, timeout: float, step: int | None = None) -> list[list[Any]]:
    """Collective (store only, bounded by ``timeout``): the steps complete for every rank of the
    group on its node's ``root`` with one attempt, ascending, as ``[step, attempt, run]``
    (with ``step``: that step only, or none). Each rank looks at its own files only."""
    mine = {str(s): list(v) for s, v in parts(root, [dist.rank]).items() if step is None or s == step}

    def decide(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
        common = set(outcomes[0]["parts"])
        for o in outcomes[1:]:
            common &= {s for s, v in o["parts"].items() if v == outcomes[0]["parts"].get(s)}
        return {"steps": sorted([int(s), *outcomes[0]["parts"][s]] for s in common)}

    return list(agree(dist, key, {"parts": mine}, decide, timeout)["steps"])
