"""An independent check of a committed step directory: read with plain ``json``/``os``, not the library."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from asyncckpt.format._layout import step_dir_name


def dir_problem(root: Path, step: int) -> str | None:
    """Why ``ROOT/step_N`` is not exactly the manifest's files with the recorded sizes (``None``: it is)."""
    d = root / step_dir_name(step)
    try:
        manifest = json.loads((d / "manifest.json").read_bytes())
        present = set(os.listdir(d))
    except (OSError, ValueError) as e:
        return f"unreadable: {e}"
    expected = {f["name"]: f["size"] for f in manifest["files"]}
    if present != set(expected) | {"manifest.json"}:
        return f"files {sorted(present)} != manifest {sorted(expected)}"
    for name, size in expected.items():
        st = os.lstat(d / name)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return f"{name}: {st.st_size} bytes (mode {st.st_mode:o}), manifest says {size}"
    if manifest["step"] != step:
        return f"manifest is for step {manifest['step']}"
    return None
