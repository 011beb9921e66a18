"""The read-only commands are torch-free and quick: real processes, real checkpoints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
from _cli_util import REPO, imported_modules, run_cli

from asyncckpt import Checkpointer

#: Generous: the target is < 0.5 s; torch alone takes seconds to import. Not a speed test.
WALL_BOUND_S = 10.0


@pytest.fixture(scope="module")
def small_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fast") / "ck"
    with Checkpointer(root) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.randn(16, 16), "epoch": step}).result(timeout=60)
    return root


def _torch_modules(stderr: str) -> set[str]:
    return {m for m in imported_modules(stderr) if m == "torch" or m.startswith("torch.")}


@pytest.mark.parametrize(
    "argv",
    [["ls"], ["ls", "--json"], ["info"], ["info", "--json"], ["verify"], ["verify", "--all", "--json"],
     ["gc", "--dry-run"], ["gc", "--json"]],
    ids=lambda a: "-".join(x.strip("-") for x in a),
)
def test_read_commands_never_import_torch(small_root: Path, argv: list[str]) -> None:
    r = run_cli(argv[0], small_root, *argv[1:], importtime=True)
    assert r.code == 0, r.err
    modules = imported_modules(r.err)
    assert "asyncckpt.cli" in modules  # the listing is real
    assert _torch_modules(r.err) == set(), sorted(_torch_modules(r.err))[:5]
    assert "numpy" not in modules
    assert r.wall_s < WALL_BOUND_S


def test_console_script_entry_point_is_torch_free(small_root: Path) -> None:
    """The [project.scripts] target, called as the installed script would call it."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["asyncckpt"].split(":")
    assert module == "asyncckpt.cli"
    code = (
        "import sys, importlib\n"
        f"main = getattr(importlib.import_module({module!r}), {func!r})\n"
        f"rc = main(['ls', {str(small_root)!r}])\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        f"rc |= main(['verify', {str(small_root)!r}])\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "sys.exit(rc)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "step_00000002" in r.stdout and "step 2: ok" in r.stdout


def test_package_import_is_lazy_and_complete() -> None:
    code = (
        "import sys\n"
        "import asyncckpt\n"
        "from asyncckpt import CheckpointError, CheckpointNotFoundError\n"
        "import asyncckpt.reading\n"
        "assert 'torch' not in sys.modules, 'import asyncckpt imported torch'\n"
        "assert set(asyncckpt.__all__) <= set(dir(asyncckpt))\n"
        "from asyncckpt import Checkpointer, load, find_latest, SaveHandle, SaveState\n"
        "assert 'torch' in sys.modules\n"
        "ns = {}\n"
        "exec('from asyncckpt import *', ns)\n"
        "missing = [n for n in asyncckpt.__all__ if n not in ns]\n"
        "assert not missing, missing\n"
        "assert asyncckpt.Checkpointer.__module__ == 'asyncckpt.checkpointer._facade'\n"
        "try:\n"
        "    asyncckpt.nope\n"
        "except AttributeError as e:\n"
        "    assert 'nope' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, cwd=REPO)
    assert r.returncode == 0, r.stderr


def test_export_still_works_from_a_real_process(small_root: Path, tmp_path: Path) -> None:
    dest = tmp_path / "w.safetensors"
    r = run_cli("export", small_root, "--to", dest, timeout=100)
    assert r.code == 0, r.err
    assert "of step 2 rank 0" in r.out and dest.exists()
