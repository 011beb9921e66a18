"""The DCP storage layer: ``dcp.save``/``dcp.async_save``/``dcp.load`` through asyncckpt.

Single process: round trips (a step ``asyncckpt verify``/``ls``/``load`` read too), a flipped
byte makes ``dcp.load`` raise, an existing step is never overwritten, SIGKILL at random
points of a save never leaves a step a reader takes. Four gloo ranks with FSDP2: saved on 4
(``dcp.save``, ``dcp.async_save``, and torch's own writer for the importer), loaded on 2
bit for bit; the imported DCP checkpoint loads through ``Checkpointer.load(into=...)``.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _cli_util import run_cli
from _ranks import free_port, log_tail, run_ranks
from torch.distributed.checkpoint.api import CheckpointException

import asyncckpt
from asyncckpt import CheckpointCorruptError, CheckpointNotFoundError
from asyncckpt.integrations.dcp import StorageReader, StorageWriter, import_dcp

WORKER = str(Path(__file__).parent / "support" / "_dcp_worker.py")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(5, 7, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)},
        "optim": {"step": torch.tensor(3.0), "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
        "ints": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "meta": {"epoch": 2, "name": "run", "ratio": 0.5},
    }


def _blank() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(5, 7), "b": torch.zeros(7, dtype=torch.bfloat16)},
        "optim": {"step": torch.tensor(0.0), "groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]},
        "ints": torch.zeros(2, 3, dtype=torch.int64),
        "meta": {"epoch": 0, "name": "", "ratio": 0.0},  # DCP loads the keys the target has
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _only_failure(e: CheckpointException) -> BaseException:
    """The one rank's exception DCP collected (2.13: an ``(exception, traceback)`` pair)."""
    (f,) = e.failures.values()
    return f[0] if isinstance(f, tuple) else f


def test_round_trip_in_one_process_is_a_normal_step(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    src = _state()
    dcp.save(src, storage_writer=StorageWriter(root, step=3))
    dcp.async_save(src, storage_writer=StorageWriter(root / "step_00000004")).result(60)
    dcp.save(src, checkpoint_id=str(root / "step_00000005"), storage_writer=StorageWriter(root, step=99))
    for step in (3, 4, 5):
        out = _blank()
        dcp.load(out, storage_reader=StorageReader(root, step=step))
        assert _same(out, src), (step, out)
    # a step like any other: listed, verified, loaded without DCP (the structure as saved)
    assert asyncckpt.find_latest(root).step == 5  # type: ignore[union-attr]
    assert _same(asyncckpt.load(root, step=3), src)
    r = run_cli("verify", str(root), "--all")
    assert r.code == 0, r
    assert "3 of 3 checkpoints ok" in r.out
    assert sorted(os.listdir(root / "step_00000003")) == [
        "dcp.json", "index.json", "manifest.json", "rank00000.json", "rank00000.safetensors",
    ]  # fmt: skip
    assert not (root / "step_00000003" / ".metadata").exists()  # no pickle anywhere


def test_a_flipped_byte_makes_dcp_load_raise(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    dcp.save(_state(), storage_writer=StorageWriter(root, step=1))
    shard = root / "step_00000001" / "rank00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x10  # inside the last tensor's bytes
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as ei:
        dcp.load(_blank(), storage_reader=StorageReader(root, step=1))
    err = _only_failure(ei.value)
    assert isinstance(err, CheckpointCorruptError) and "checksum mismatch" in str(err), err
    assert err.path == str(shard)
    r = run_cli("verify", str(root), "--step", "1")
    assert r.code == 1 and "checksum mismatch" in r.err, r

    # the metadata too: a flipped byte in dcp.json
    dcp.save(_state(), storage_writer=StorageWriter(root, step=2))
    meta = root / "step_00000002" / "dcp.json"
    raw = bytearray(meta.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    meta.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        StorageReader(root, step=2).read_metadata()
    with pytest.raises((CheckpointException, AssertionError), match="checksum mismatch"):
        dcp.load(_blank(), storage_reader=StorageReader(root, step=2))


def test_an_existing_step_is_never_overwritten(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    dcp.save(_state(0), storage_writer=StorageWriter(root, step=1))
    before = {p.name: p.read_bytes() for p in (root / "step_00000001").iterdir()}
    with pytest.raises(CheckpointException) as ei:
        dcp.save(_state(1), storage_writer=StorageWriter(root, step=1))
    err = _only_failure(ei.value)
    assert isinstance(err, FileExistsError) and "never overwrites" in str(err)
    assert {p.name: p.read_bytes() for p in (root / "step_00000001").iterdir()} == before
    assert sorted(os.listdir(root)) == ["step_00000001"]  # nothing left behind


def test_bad_arguments_are_refused_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a step directory"):
        StorageWriter(tmp_path / "ck")
    with pytest.raises(ValueError, match="not a step directory"):
        StorageReader(tmp_path / "step_12")  # 8 digits: step_00000012
    with pytest.raises(ValueError, match="non-negative"):
        StorageWriter(tmp_path, step=-1)
    with pytest.raises(TypeError):
        StorageWriter(tmp_path, step="3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        StorageWriter(tmp_path, step=1, timeout=0)
    with pytest.raises(ValueError, match="not a step directory"):
        StorageWriter("s3://bucket/run")  # an s3:// root needs step=N too
    with pytest.raises(ValueError, match="storage_options apply to an s3:// root"):
        StorageWriter(tmp_path, step=1, storage_options={"endpoint": "http://127.0.0.1:1"})
    assert StorageWriter.validate_checkpoint_id(str(tmp_path / "step_00000001"))
    assert not StorageReader.validate_checkpoint_id(str(tmp_path / "x"))
    with pytest.raises(CheckpointNotFoundError):
        StorageReader(tmp_path, step=1).read_metadata()
    # dcp.load wraps a failed metadata read (every rank gets it): the message names the step
    with pytest.raises(CheckpointException, match="no checkpoint for step 1"):
        dcp.load(_blank(), storage_reader=StorageReader(tmp_path, step=1))


def test_a_step_not_written_through_dcp_is_refused_by_the_reader(tmp_path: Path) -> None:
    with asyncckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": torch.zeros(3)}).result(60)
    with pytest.raises(CheckpointCorruptError, match="not written through DCP"):
        StorageReader(tmp_path, step=1).read_metadata()


_KILL_CHILD = textwrap.dedent(
    """
    import sys, torch, torch.distributed.checkpoint as dcp
    from asyncckpt.integrations.dcp import StorageWriter
    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(1 << 20, generator=g) for i in range(12)}  # 48 MiB
    state["meta"] = {"n": 12}
    print("ready", flush=True)
    dcp.save(state, storage_writer=StorageWriter(sys.argv[1], step=1))
    print("saved", flush=True)
    """
)


def _child(root: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, str(root)], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.slow  # > 15 s on a quiet 2-core machine: make test-slow (and CI) runs it
def test_a_kill_mid_save_never_leaves_a_step_dcp_would_load(tmp_path: Path) -> None:
    # one whole save first: its duration is the window the kills are drawn from
    p = _child(tmp_path / "whole")
    t0 = time.monotonic()
    assert p.stdout is not None and p.stdout.readline().strip() == "saved"
    took = time.monotonic() - t0  # the save alone (the interpreter's exit after it is not in it)
    assert p.wait(120) == 0
    ref = _blank_kill()
    dcp.load(ref, storage_reader=StorageReader(tmp_path / "whole", step=1))
    rng = random.Random(29)
    outcomes = []
    for i in range(5):
        root = tmp_path / f"k{i}"
        p = _child(root)
        time.sleep(rng.uniform(0.0, took * 1.5))
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        try:
            StorageReader(root, step=1).read_metadata()
        except CheckpointNotFoundError:
            left = [q.name for q in root.glob("step_00000001.tmp-*/*")] if root.exists() else []
            outcomes.append(f"none ({len(left)} files left in the attempt directory)")
            assert asyncckpt.find_latest(root) is None
            assert not (root / "step_00000001").exists()
            assert not [p for p in root.rglob(".metadata")]  # nor anything torch's own reader takes
            continue
        out = _blank_kill()
        dcp.load(out, storage_reader=StorageReader(root, step=1))
        outcomes.append("committed")  # the kill came after the commit: the whole state, exactly
        assert _same(out, ref)
    print(f"\nSIGKILL at 5 random points of a {took:.2f}s save: {outcomes}")


def _blank_kill() -> dict[str, Any]:
    state: dict[str, Any] = {f"t{i}": torch.zeros(1 << 20) for i in range(12)}
    state["meta"] = {}
    return state


# ------------------------------------------------------------------------------ 4 ranks -> 2
def _launch(tmp_path: Path, scenario: str, world: int) -> dict[int, dict[str, Any]]:
    port = free_port()
    logs = tmp_path / f"logs-{scenario}"
    logs.mkdir()
    outs = [logs / f"out{r}.json" for r in range(world)]
    hung = run_ranks(
        lambda r: [WORKER, scenario, str(r), str(world), str(port), str(tmp_path), str(outs[r])], world, logs, 180
    )
    assert not hung, f"ranks {hung} hung: {log_tail(logs, hung[0])}"
    res = {}
    for r in range(world):
        assert outs[r].exists(), log_tail(logs, r)
        res[r] = json.loads(outs[r].read_text())
        assert "crash" not in res[r], res[r]["crash"]
    return res


@pytest.mark.slow  # > 15 s on a quiet 2-core machine: make test-slow (and CI) runs it
def test_fsdp2_saved_on_4_ranks_loads_on_2_bit_for_bit_and_the_imported_dcp_checkpoint_too(tmp_path: Path) -> None:
    saved = _launch(tmp_path, "save", 4)
    assert saved[0]["keys"] > 0
    # the save whose rank 1 hit ENOSPC: every rank raised DCP's CheckpointException naming
    # rank 1 (OSError ENOSPC); nothing committed, the attempt left for gc
    for r in range(4):
        assert saved[r]["failed"] == {"1": ["OSError", errno.ENOSPC]}, saved[r]
    assert not (tmp_path / "ck" / "step_00000003").exists()
    assert len(list((tmp_path / "ck").glob("step_00000003.tmp-*"))) == 1
    # torch's own writer's checkpoint, imported (the pickled .metadata: an explicit opt-in)
    step_dir = import_dcp(tmp_path / "dcp", tmp_path / "imported", 7, allow_pickle=True)
    assert step_dir == tmp_path / "imported" / "step_00000007"
    r = run_cli("verify", str(tmp_path / "ck"), "--all")
    assert r.code == 0, r
    r = run_cli("verify", str(tmp_path / "imported"))
    assert r.code == 0, r
    loaded = _launch(tmp_path, "load", 2)
    for r, res in loaded.items():
        for what in ("dcp1", "dcp2", "imported"):
            assert res[what]["bad"] == [], (r, what, res[what]["bad"])
            assert res[what]["meta"] == {"epoch": 3, "rank0": "yes"}, (r, what)


def test_malformed_dcp_json_is_refused_as_a_value_error(tmp_path: Path) -> None:
    from asyncckpt.integrations import _dcp_meta

    dcp.save(_state(), storage_writer=StorageWriter(tmp_path, step=1))
    step_dir = tmp_path / "step_00000001"
    raw = (step_dir / "dcp.json").read_bytes()
    sizes = {p.name: p.stat().st_size for p in step_dir.iterdir()}
    meta, blobs = _dcp_meta.decode(raw, sizes)  # the real one decodes
    assert blobs and all(fqn in meta.state_dict_metadata for fqn in blobs), blobs
    good = json.loads(raw)
    tensor = next(iter(good["tensors"]))
    blob = next(iter(good["bytes"]))

    def bad(edit: Any) -> None:
        doc = json.loads(raw)
        edit(doc)
        with pytest.raises(ValueError):
            _dcp_meta.decode(json.dumps(doc).encode(), sizes)

    bad(lambda d: d.update(format="asyncckpt-dcp/9"))
    bad(lambda d: d["tensors"][tensor].update(dtype="F128"))
    bad(lambda d: d["tensors"][tensor].update(size=[-1]))
    bad(lambda d: d["tensors"][tensor].update(chunks=[[[0], [10**9]]]))  # outside the tensor
    bad(lambda d: d["tensors"][tensor].update(chunks=[[[0, 0, 0], [1, 1, 1]]]))  # another rank
    bad(lambda d: d["tensors"][tensor].update(memory_format="os.system"))
    bad(lambda d: d["tensors"][tensor].update(requires_grad="yes"))
    bad(lambda d: d["bytes"].update({blob: ["../../etc/passwd", 0, 1, 0]}))  # not a listed file
    bad(lambda d: d["bytes"].update({blob: [d["bytes"][blob][0], 0, 10**12, 0]}))  # past its end
    bad(lambda d: d["bytes"].update({tensor: d["bytes"][blob]}))  # a key both tensor and bytes
    bad(lambda d: d.update(mappings={"a": [{"x": 1}]}))
    bad(lambda d: d.update(storage_meta={"checkpoint_id": 5}))
    with pytest.raises(ValueError):
        _dcp_meta.decode(b"[" * 100_000, sizes)
    with pytest.raises(ValueError):
        _dcp_meta.decode(b"\xff\xfe", sizes)
