"""How ``info`` and ``export`` present the values of a state that are not plain tensors.

* ``info`` shows a saved ``torch.Generator`` as a generator (its device and the size of its
  state), in text and in ``--json`` (``kind: "generator"``), not as a string.
* ``export`` skips every non-tensor value; its note groups them into the largest subtrees
  that hold no tensor (an RNG state of 625 ints is one entry with its count, not 625 names),
  and ``--json`` gives that summary under ``skipped`` and every value under ``skipped_values``.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _cli_util import cli

from asyncckpt import Checkpointer


@pytest.fixture
def root(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(7)
    state: dict[str, Any] = {
        "model": OrderedDict(w=torch.randn(4, 3, generator=g), b=torch.zeros(3)),
        "optim": {"state": {0: {"step": 3, "exp_avg": torch.ones(4, 3)}}, "lr": 0.1},
        "rng": {"torch": g, "python": random.Random(3).getstate(), "numpy": np.random.RandomState(3).get_state()},
        "epoch": 2,
    }
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state).result(timeout=60)
    return tmp_path / "ck"


def test_info_shows_a_generator_as_a_generator(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "info", root)
    assert code == 0, err
    (line,) = [ln for ln in out.splitlines() if ln.strip().startswith("torch ")]
    assert "torch.Generator (cpu; state uint8 [" in line and "KiB" in line, line
    assert "generator(" not in out  # no longer its stored form as a string
    code, out, err = cli(capsys, "info", root, "--json")
    assert code == 0, err
    (entry,) = [e for e in json.loads(out)["entries"] if e["path"] == ["rng", "torch"]]
    state = torch.Generator().manual_seed(7).get_state()
    assert entry == {"path": ["rng", "torch"], "kind": "generator", "device": "cpu",
                     "state": {"dtype": "uint8", "shape": [state.numel()], "nbytes": state.numel()}}


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_summarises_the_skipped_values(
    suffix: str, root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / f"all{suffix}"
    code, out, err = cli(capsys, "export", root, "--to", out_file)
    assert code == 0, err
    (note,) = [ln for ln in err.splitlines() if "skipped" in ln]
    # every value under "rng" is skipped (the python state alone is 627 of them): one entry
    # each for the subtrees that hold no tensor, the loose values by name
    python_state = 1 + 625 + 1
    total = 1 + python_state + 5 + 1 + 1 + 1  # torch, python, numpy, optim.state.0.step, lr, epoch
    assert f"skipped {total} non-tensor value(s) under 4 key(s)" in note, note
    assert note.endswith(f": optim.state.0.step, optim.lr, rng ({total - 3} values), epoch"), note
    assert len(note) < 200

    code, out, err = cli(capsys, "export", root, "--to", tmp_path / f"again{suffix}", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["skipped"] == ["optim.state.0.step", "optim.lr", "rng", "epoch"]
    values = doc["skipped_values"]
    assert len(values) == total and len(set(values)) == total
    assert values[:3] == ["optim.state.0.step", "optim.lr", "rng.torch"] and values[-1] == "epoch"
    assert "rng.python.1.624" in values

    code, out, err = cli(capsys, "export", root, "--key", "rng", "--to", tmp_path / f"rng{suffix}", "--json")
    assert code == 1  # no tensor under "rng": nothing to write


def test_export_note_names_at_most_a_few_subtrees(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {f"k{i:02d}": {"v": i, "t": torch.ones(1)} for i in range(20)}
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state).result(timeout=60)
    code, _, err = cli(capsys, "export", tmp_path / "ck", "--to", tmp_path / "o.safetensors")
    assert code == 0, err
    (note,) = [ln for ln in err.splitlines() if "skipped" in ln]
    assert "skipped 20 non-tensor value(s) under 20 key(s)" in note
    assert "k00.v, k01.v" in note and note.endswith(", ... 12 more"), note
