"""torchtitan 0.3.0 as the tests run it: the real package, made importable on a CPU machine.

Where it comes from: ``ASYNCCKPT_TORCHTITAN_PATH``, else ``.venv/torchtitan`` (where ``make``
installs it with ``pip install --no-deps --target``, with the four packages its trainer
components import: tyro, docstring_parser, spmd_types, torchdata), else the environment (the
``asyncckpt[torchtitan]`` extra). A separate directory because torchtitan's full dependency set
(datasets, wandb, tensorboard, ...) pins ``huggingface_hub`` and ``fsspec`` older than the
transformers extra needs.

**Triton.** torchtitan imports ``triton`` at module level in one place the Llama model reaches:
``torchtitan/distributed/minimal_async_ep/kernels.py`` (GPU kernels of its asynchronous
expert-parallel MoE dispatch, which a dense model never runs). A CPU-only torch has no triton,
and the triton wheel is large and, once importable, changes what torch itself does (its dynamo
and inductor modules import it). So :func:`prepare` loads that one module with a stand-in
``triton`` that only supports the decorations the module performs, and whose kernels raise
``RuntimeError`` if anything ever launches one; the stand-in is removed from ``sys.modules``
right after, so torch and every other module still see no triton. Where a real triton is
installed nothing is replaced.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

VERSION = "0.3.0"
SKIP = (
    "needs torchtitan/: pip install 'asyncckpt[torchtitan]' (or make, which installs it into "
    ".venv/torchtitan; or ASYNCCKPT_TORCHTITAN_PATH=DIR)"
)
_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def path() -> str | None:
    """The directory to put on ``sys.path`` for torchtitan, ``""`` when it is importable as
    installed, ``None`` when it is not there (tests skip then; CI refuses that skip)."""
    for base in filter(None, [os.environ.get("ASYNCCKPT_TORCHTITAN_PATH"), os.path.join(sys.prefix, "torchtitan")]):
        if Path(base, "torchtitan").is_dir():
            return str(base)
    return "" if importlib.util.find_spec("torchtitan") is not None else None


def version(base: str) -> str | None:
    """The installed torchtitan version (from its dist-info)."""
    if base:
        for info in Path(base).glob("torchtitan-*.dist-info"):
            return info.name.removeprefix("torchtitan-").removesuffix(".dist-info")
        return None
    from importlib.metadata import version as v

    return v("torchtitan")


def prepare() -> None:
    """Make ``import torchtitan...`` work here (see the module docstring)."""
    base = path()
    if base is None:
        raise ImportError(SKIP)
    if base and base not in sys.path:
        sys.path.insert(0, base)
    if _KERNELS in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    spec = importlib.util.find_spec("torchtitan")
    assert spec is not None and spec.submodule_search_locations
    file = Path(next(iter(spec.submodule_search_locations)), "distributed", "minimal_async_ep", "kernels.py")
    triton, language = _stand_in()
    sys.modules["triton"], sys.modules["triton.language"] = triton, language
    try:
        kspec = importlib.util.spec_from_file_location(_KERNELS, file)
        assert kspec is not None and kspec.loader is not None
        module = importlib.util.module_from_spec(kspec)
        sys.modules[_KERNELS] = module
        kspec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(_KERNELS, None)
        raise
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]


class _Any:
    """``tl.int64``, ``tl.pointer_type(tl.int64)``, ``tl.constexpr``: annotations only."""

    def __call__(self, *args: Any, **kwargs: Any) -> _Any:
        return self

    def __getattr__(self, name: str) -> _Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self


class _Kernel:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __getitem__(self, grid: Any) -> Any:
        raise RuntimeError(
            f"triton kernel {self.fn.__name__} launched on a machine without triton (tests/support/_torchtitan.py)"
        )


def _stand_in() -> tuple[types.ModuleType, types.ModuleType]:
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")

    def module_getattr(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()

    language.__getattr__ = module_getattr  # type: ignore[method-assign]

    def jit(fn: Any = None, **kwargs: Any) -> Any:
        return _Kernel(fn) if fn is not None else _Kernel

    triton.jit = jit  # type: ignore[attr-defined]
    triton.language = language  # type: ignore[attr-defined]
    return triton, language
