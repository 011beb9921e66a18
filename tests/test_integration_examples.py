"""examples/hf_trainer.py and examples/lightning_ddp.py run as a user runs them, and the second
run of the same command resumes from the first one's checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(180)]


def run(tmp: Path, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, *args], env=env, cwd=tmp, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p.stdout + p.stderr


@pytest.mark.slow  # the example's smoke run; the Trainer integration itself runs in tests/test_transformers.py
def test_hf_trainer_example_resumes(tmp_path: Path) -> None:
    try:
        import accelerate  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:  # CI refuses this skip
        pytest.skip(f"needs transformers/: pip install 'asyncckpt[transformers]' ({e})")
    example = str(REPO / "examples" / "hf_trainer.py")
    first = run(tmp_path, example, "--out", "out", "--steps", "20", "--save-every", "10")
    assert "starting" in first and "checkpoints: ['checkpoint-10', 'checkpoint-20']" in first
    second = run(tmp_path, example, "--out", "out", "--steps", "30", "--save-every", "10")
    assert "resuming from out/checkpoint-20" in second and "['checkpoint-20', 'checkpoint-30']" in second


@pytest.mark.slow  # the plugin itself runs in tests/test_lightning*.py; this is the example's smoke run
def test_lightning_example_resumes(tmp_path: Path) -> None:
    try:
        import lightning  # noqa: F401
    except ImportError as e:  # CI refuses this skip
        pytest.skip(f"needs lightning/: pip install 'asyncckpt[lightning]' ({e})")
    example = str(REPO / "examples" / "lightning_ddp.py")
    run(tmp_path, example, "--dir", "ck", "--epochs", "2")
    assert (tmp_path / "ck" / "last.ckpt").exists()
    out = run(tmp_path, example, "--dir", "ck", "--epochs", "3")
    assert "Restoring states from the checkpoint path" in out
