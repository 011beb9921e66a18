"""``asyncckpt import`` / ``asyncckpt.import_dcp``: a checkpoint torch's own ``FileSystemWriter``
wrote becomes an asyncckpt step (the 4-rank FSDP2 import loaded on 2 ranks is in
``test_dcp_storage``). Reading DCP's pickled ``.metadata`` needs the explicit opt-in."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _cli_util import run_cli

import asyncckpt
from asyncckpt.integrations.dcp import StorageReader

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {f"layer{i}.weight": torch.randn(16, 8, generator=g) for i in range(4)}
        | {"emb": torch.randn(10, 4, generator=g).to(torch.bfloat16), "step": torch.tensor(7)},
        "sched": {"last_epoch": 4, "lrs": [0.1, 0.01]},
    }


def _blank() -> dict[str, Any]:
    return {
        "model": {f"layer{i}.weight": torch.zeros(16, 8) for i in range(4)}
        | {"emb": torch.zeros(10, 4, dtype=torch.bfloat16), "step": torch.tensor(0)},
        "sched": {"last_epoch": 0, "lrs": [0.0, 0.0]},
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.fixture
def dcp_dir(tmp_path: Path) -> Path:
    d = tmp_path / "dcp"
    # two writer threads: two .distcp files, each becoming one rank file of the step
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(d, thread_count=2))
    assert len(list(d.glob("*.distcp"))) == 2
    return d


def test_cli_import_then_load_with_asyncckpt_and_with_dcp(dcp_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "ck"
    r = run_cli("import", str(dcp_dir), str(root), "--step", "1000", "--allow-pickle")
    assert r.code == 0, r
    assert "step 1000: imported" in r.out
    assert _same(asyncckpt.load(root), _state())  # the nested structure DCP flattened, back
    out = _blank()
    dcp.load(out, storage_reader=StorageReader(root, step=1000))
    assert _same(out, _state())
    r = run_cli("verify", str(root))
    assert r.code == 0 and "step 1000: ok" in r.out, r
    r = run_cli("ls", str(root), "--json")
    assert r.code == 0, r
    (row,) = json.loads(r.out)
    assert row["status"] == "complete" and row["ranks"] == 2, row  # one rank file per .distcp file


def test_import_needs_the_pickle_opt_in_and_runs_no_code_without_it(tmp_path: Path) -> None:
    src, root, marker = tmp_path / "evil", tmp_path / "ck", tmp_path / "ran"
    src.mkdir()
    # a .metadata whose unpickling would create a file
    (src / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    r = run_cli("import", str(src), str(root), "--step", "1")
    assert r.code == 2 and "--allow-pickle" in r.err and "runs whatever code" in r.err, r
    with pytest.raises(ValueError, match="allow_pickle=True"):
        asyncckpt.import_dcp(src, root, 1)
    assert not marker.exists() and not root.exists()
    r = run_cli("import", "--help")
    assert "--allow-pickle" in r.out and "runs code" in r.out.replace("\n", " ").replace("  ", " "), r.out


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def test_an_existing_step_is_refused_and_kept(dcp_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with asyncckpt.Checkpointer(root) as ck:
        ck.save(5, {"w": torch.ones(3)}).result(60)
    r = run_cli("import", str(dcp_dir), str(root), "--step", "5", "--allow-pickle")
    assert r.code == 1 and "never overwrites" in r.err, r
    assert _same(asyncckpt.load(root, step=5), {"w": torch.ones(3)})
    assert sorted(os.listdir(root)) == [".asyncckpt", "step_00000005"]  # no attempt left behind


def test_a_damaged_dcp_checkpoint_commits_nothing(dcp_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "ck"
    victim = sorted(dcp_dir.glob("*.distcp"))[1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # cut short
    r = run_cli("import", str(dcp_dir), str(root), "--step", "1", "--allow-pickle")
    assert r.code != 0, r
    assert asyncckpt.find_latest(root) is None
    assert [n for n in os.listdir(root) if n != ".asyncckpt"] == []  # the attempt was removed (the lock stays)


def test_not_a_dcp_directory(tmp_path: Path) -> None:
    r = run_cli("import", str(tmp_path), str(tmp_path / "ck"), "--step", "1", "--allow-pickle")
    assert r.code == 1 and ".metadata" in r.err, r
    r = run_cli("import", str(tmp_path / "missing"), str(tmp_path / "ck"), "--step", "1", "--allow-pickle")
    assert r.code == 1 and "missing" in r.err, r


def test_dcp_module_exports_are_pinned() -> None:
    import asyncckpt.integrations.dcp as m

    assert sorted(m.__all__) == ["StorageReader", "StorageWriter", "import_dcp"]
    assert asyncckpt.import_dcp is m.import_dcp
    assert issubclass(m.StorageWriter, dcp.StorageWriter) and issubclass(m.StorageReader, dcp.StorageReader)


@pytest.mark.slow  # > 15 s in make test's parallel phase: make test-slow (and CI) runs it
def test_the_example_saves_and_resumes_in_one_process(tmp_path: Path) -> None:
    import subprocess
    import sys

    example = Path(__file__).parent.parent / "examples" / "dcp_storage.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for steps in (4, 6):
        r = subprocess.run([sys.executable, str(example), "--root", str(tmp_path / "run"), "--steps", str(steps)],
                           capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from step 4" in r.stdout and "step 6:" in r.stdout, r.stdout
    from asyncckpt import reading

    assert [i.step for i in reading.complete_checkpoints(tmp_path / "run")] == [2, 4, 6]
