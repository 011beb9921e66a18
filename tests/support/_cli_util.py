"""Helpers for the CLI tests: real checkpoints, the real command in a subprocess or in this
process (:func:`cli`, :func:`cli_doc`), its ``--storage-option`` arguments (:func:`so`),
resealing files."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncckpt.format._checksum import crc32c
from asyncckpt.format._manifest import MANIFEST, FileEntry, encode
from asyncckpt.roots.posix._discovery import read_manifest

if TYPE_CHECKING:
    import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Run:
    code: int
    out: str
    err: str
    wall_s: float


def run_cli(*argv: str | Path, importtime: bool = False, timeout: float = 60, **popen: Any) -> Run:
    """Run ``python -m asyncckpt ARGV`` as a real process with this checkout first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("ASYNCCKPT_DEBUG", None)
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "asyncckpt", *map(str, argv)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, errors="surrogateescape", **popen)
    return Run(r.returncode, r.stdout, r.stderr, time.monotonic() - t0)


def cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    """``asyncckpt ARGV`` run in this process (``asyncckpt.cli.main``): its exit code, and its
    stdout and stderr as ``capsys`` captured them."""
    from asyncckpt.cli import main

    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def cli_doc(*argv: str | Path) -> tuple[int, Any, str]:
    """``asyncckpt ARGV`` run in this process, its output captured here (no fixture): its exit
    code, its stdout (parsed, for ``--json`` with output) and its stderr."""
    from asyncckpt.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    text = out.getvalue()
    return code, json.loads(text) if "--json" in argv and text else text, err.getvalue()


def option_args(options: Mapping[str, str]) -> list[str]:
    """The CLI's ``--storage-option`` arguments for ``options``."""
    return [f"--storage-option={k}={v}" for k, v in options.items()]


def so(endpoint: str) -> list[str]:
    """The CLI's ``--storage-option`` arguments for the test S3 server at ``endpoint``."""
    from s3fixtures import opts

    return option_args(opts(endpoint))


def saved_steps(root: Path, states: Mapping[int, Any]) -> Path:
    """``root`` with a checkpoint of each ``states[step]`` saved by a real Checkpointer."""
    from asyncckpt import Checkpointer

    with Checkpointer(root) as ck:
        for step, state in states.items():
            ck.save(step, state).result(timeout=60)
    return root


def private_copy(pristine: Path, tmp_path: Path) -> Path:
    """A copy of the root ``pristine`` in ``tmp_path`` that a test may damage."""
    dst = tmp_path / "ck"
    shutil.copytree(pristine, dst)
    return dst


def imported_modules(importtime_stderr: str) -> set[str]:
    """Module names listed by ``-X importtime`` (one ``import time: self | cumulative | name`` per line)."""
    out = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            out.add(line.rsplit("|", 1)[1].strip())
    return out


def reseal(step_dir: Path, name: str, data: bytes | None = None, **fields: Any) -> None:
    """Rewrite ``name`` in a committed step (or only manifest ``fields``) and seal a matching manifest.

    The result passes every check discovery makes, so only deeper readers can see what is wrong.
    """
    m = read_manifest(str(step_dir))
    files = list(m.files)
    if data is not None:
        (step_dir / name).write_bytes(data)
        files = [FileEntry(f.name, len(data), crc32c(data), f.rank) if f.name == name else f for f in files]
    body = {
        "step": m.step,
        "attempt": m.attempt,
        "world_size": m.world_size,
        "nbytes": m.nbytes,
        "created": m.created,
        "files": files,
        "extra": m.extra,
    }
    body.update(fields)
    (step_dir / MANIFEST).write_bytes(encode(**body))


def strict_json(text: str) -> Any:
    """Parse JSON as a strict reader would (NaN/Infinity are not JSON)."""

    def refuse(c: str) -> None:
        raise ValueError(f"not JSON: {c}")

    return json.loads(text, parse_constant=refuse)
