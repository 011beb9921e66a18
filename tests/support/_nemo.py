"""NeMo Automodel's own directory functions, as the tests run them, and the asyncckpt patch.

The functions come from the real package (nemo-automodel 0.7.0), never from a copy in this
repository: the full package when it imports (it needs about 2.9 GB of dependencies:
transformers, triton, cutlass ...), otherwise their source read from the installed files
(``pip install --no-deps --target DIR nemo-automodel==0.7.0``: a 3.8 MB wheel, which
``make`` installs into ``.venv/nemo-automodel``; or point ``ASYNCCKPT_NEMO_PATH`` at DIR)
and compiled alone: ``_create_dirs`` and ``_ensure_dirs`` from
``components/checkpoint/checkpointing.py`` and the ``is_cloud_path`` they call from
``components/checkpoint/utils.py``. Both ways run the same bytes of NeMo's code.

:func:`patch` is what a NeMo user adds to their launcher to get asyncckpt's behaviour; it
is shown in the README.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import pathlib
import sys
from types import SimpleNamespace
from typing import Any

VERSION = "0.7.0"
SKIP = "needs nemo-automodel/: pip install --no-deps --target DIR nemo-automodel==0.7.0; ASYNCCKPT_NEMO_PATH=DIR"
RECIPE_SKIP = (
    "needs nemo-automodel/ installed with its dependencies in its own virtualenv (`make nemo-venv`: "
    ".venv/nemo-venv), or ASYNCCKPT_NEMO_PYTHON=the python of one"
)


def python() -> str | None:
    """The Python of the virtualenv that holds nemo-automodel with the dependencies its
    checkpoint and recipe code imports (``make nemo-venv`` builds ``.venv/nemo-venv``; it
    cannot share the test virtualenv: nemo-automodel 0.7.0 pins transformers 5.18.0), or
    ``None``. ``ASYNCCKPT_NEMO_PYTHON`` overrides the place."""
    path = os.environ.get("ASYNCCKPT_NEMO_PYTHON") or os.path.join(sys.prefix, "nemo-venv", "bin", "python")
    return path if os.access(path, os.X_OK) else None


def _package_dir() -> pathlib.Path | None:
    # ASYNCCKPT_NEMO_PATH, else where `make` puts it: .venv/nemo-automodel
    for base in filter(None, [os.environ.get("ASYNCCKPT_NEMO_PATH"), os.path.join(sys.prefix, "nemo-automodel")]):
        p = pathlib.Path(base, "nemo_automodel")
        if p.is_dir():
            return p
    spec = importlib.util.find_spec("nemo_automodel")  # locates, imports nothing
    if spec is not None and spec.submodule_search_locations:
        return pathlib.Path(next(iter(spec.submodule_search_locations)))
    return None


def _version(pkg: pathlib.Path) -> str | None:
    for info in pkg.parent.glob("nemo_automodel-*.dist-info"):
        return info.name.removeprefix("nemo_automodel-").removesuffix(".dist-info")
    return None


def _functions(path: pathlib.Path, names: set[str]) -> str:
    tree = ast.parse(path.read_text(), str(path))
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = names - {n.name for n in found}
    if missing:
        raise LookupError(f"{path} defines no {sorted(missing)}")
    return "\n\n".join(ast.get_source_segment(path.read_text(), n) or "" for n in found)


def load() -> SimpleNamespace | None:
    """NeMo's ``_create_dirs``, ``_ensure_dirs`` and ``is_cloud_path`` in one namespace
    (module-like: patching ``ns._create_dirs`` is what ``_ensure_dirs`` then calls), or
    ``None`` when nemo-automodel is not available."""
    pkg = _package_dir()
    if pkg is None:
        return None
    version = _version(pkg)
    if version is not None and version != VERSION:
        raise RuntimeError(f"these tests pin nemo-automodel {VERSION}; found {version} at {pkg}")
    try:
        mod = importlib.import_module("nemo_automodel.components.checkpoint.checkpointing")
        return SimpleNamespace(module=mod, source="import", path=mod.__file__)
    except ImportError:
        pass
    import torch

    ckpt = pkg / "components" / "checkpoint" / "checkpointing.py"
    utils = pkg / "components" / "checkpoint" / "utils.py"
    src = _functions(utils, {"is_cloud_path"}) + "\n\n" + _functions(ckpt, {"_create_dirs", "_ensure_dirs"})
    glb: dict[str, Any] = {"__name__": "nemo_automodel_extract", "os": os, "torch": torch, "Path": pathlib.Path}
    exec(compile("from __future__ import annotations\n" + src, str(ckpt), "exec"), glb)
    mod = SimpleNamespace(**{k: glb[k] for k in ("_create_dirs", "_ensure_dirs", "is_cloud_path")})
    # the functions look each other up in glb, their module globals: patch there
    mod.__dict__["_globals"] = glb
    return SimpleNamespace(module=mod, source="source", path=str(ckpt))


def set_attr(nemo: SimpleNamespace, name: str, value: Any) -> None:
    """``nemo_ckpt.<name> = value``, as a user's monkeypatch does."""
    setattr(nemo.module, name, value)
    glb = getattr(nemo.module, "_globals", None)
    if glb is not None:
        glb[name] = value


def patch(nemo: SimpleNamespace, *, mkdir_timeout: float = 60.0, ranks_timeout: float = 120.0) -> None:
    """The asyncckpt patch of NeMo Automodel's directory creation (see the README)."""
    import asyncckpt

    is_cloud_path = nemo.module.is_cloud_path

    def _create_dirs(*dirs: str | None) -> None:
        for d in dirs:
            if d and not is_cloud_path(d):
                asyncckpt.ensure_dir(d, timeout=mkdir_timeout)

    def _ensure_dirs(*dirs: str | None, process_group: Any = None) -> None:
        asyncckpt.on_every_rank(lambda: _create_dirs(*dirs), group=process_group, timeout=ranks_timeout)

    set_attr(nemo, "_create_dirs", _create_dirs)
    set_attr(nemo, "_ensure_dirs", _ensure_dirs)
