"""``load(..., mmap=True)``: tensors backed by the shard file (a private mapping), verified once
up front without a copy (or not at all with ``verify=False``), valid after retention removed
the step; refused with ``into=``, for s3 roots and for indexed steps; damage is
``CheckpointCorruptError``."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import asyncckpt
from asyncckpt import CheckpointCorruptError, Checkpointer

STEP = "step_00000001"
REPO = Path(__file__).resolve().parents[1]


def state() -> dict[str, Any]:
    torch.manual_seed(0)
    shared = torch.randn(4, 3)
    model = collections.OrderedDict(w=torch.randn(5, 7), b=torch.arange(3, dtype=torch.int64))
    return {
        "model": model,
        "half": torch.randn(6).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "param": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "arr": np.arange(6, dtype=np.float64).reshape(2, 3),
        "tied": {"a": shared, "b": shared},
        "step": 7,
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def mapped_files() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ck"
    with Checkpointer(r) as ck:
        ck.save(1, state())
    return r


@pytest.mark.parametrize("verify", [True, False])
def test_values_equal_and_backed_by_the_file(root: Path, verify: bool) -> None:
    got = asyncckpt.load(root, 1, mmap=True, verify=verify)
    assert same(got, state()) and same(got, asyncckpt.load(root, 1))
    assert isinstance(got["param"], torch.nn.Parameter) and not got["param"].requires_grad
    assert got["tied"]["a"] is got["tied"]["b"]
    assert str(root / STEP / "rank00000.safetensors") in mapped_files()
    # private: writing to a mapped tensor changes this process's copy, never the file
    got["model"]["w"].fill_(0.0)
    got["arr"][:] = -1
    again = asyncckpt.load(root, 1, mmap=True)
    assert same(again, state())


def test_checkpointer_load_passes_mmap_through(root: Path) -> None:
    with Checkpointer(root) as ck:
        got = ck.load(mmap=True)
    assert same(got, state())


def test_refused_at_the_call(root: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="into="):
        asyncckpt.load(root, 1, mmap=True, into={"model": {}})
    with pytest.raises(TypeError, match="mmap must be a bool"):
        asyncckpt.load(root, 1, mmap=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local root"):
        asyncckpt.load("s3://bucket/run", mmap=True)
    with Checkpointer(root) as ck:
        with pytest.raises(ValueError, match="into="):
            ck.load(mmap=True, into={"step": 0})
        with pytest.raises(TypeError):
            ck.load(mmap="yes")  # type: ignore[arg-type]


def test_corrupt_and_truncated_shards(root: Path) -> None:
    shard = root / STEP / "rank00000.safetensors"
    raw = bytearray(shard.read_bytes())
    good = bytes(raw)
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    at = 8 + int.from_bytes(raw[:8], "little") + header["model.w"]["data_offsets"][0]
    raw[at] ^= 0x10
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch") as e:
        asyncckpt.load(root, 1, mmap=True)
    assert e.value.path == str(shard)
    # verify=False skips the check explicitly: the flipped byte is what comes back
    got = asyncckpt.load(root, 1, mmap=True, verify=False)
    assert not torch.equal(got["model"]["w"], state()["model"]["w"])
    del got
    shard.write_bytes(good[:-100])
    with pytest.raises(CheckpointCorruptError, match=r"recorded in the manifest|not a regular file"):
        asyncckpt.load(root, 1, mmap=True, verify=False)


def test_tensors_stay_valid_after_retention_removes_the_step(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Checkpointer(root, keep_last=1) as ck:
        ck.save(1, {"w": torch.arange(1000.0)})
        ck.flush()
        held = ck.load(1, mmap=True)["w"]
        for step in (2, 3):
            ck.save(step, {"w": torch.full((1000,), float(step))})
        ck.flush()
        assert ck.steps() == [3] and not (root / STEP).exists()
        assert torch.equal(held, torch.arange(1000.0))  # the mapping holds the removed file's inode
        assert any("(deleted)" in f and "rank00000.safetensors" in f for f in mapped_files())
    assert torch.equal(held * 2, torch.arange(1000.0) * 2)


_RSS = """
import json, sys, torch, asyncckpt
def kib(key):
    for line in open('/proc/self/status'):
        if line.startswith(key + ':'):
            return int(line.split()[1])
asyncckpt.load(sys.argv[1], 1, mmap=True, verify=True)  # warm up imports and threads
open('/proc/self/clear_refs', 'w').write('5')
anon, base = kib('RssAnon'), kib('VmRSS')
state = asyncckpt.load(sys.argv[1], 1, mmap=sys.argv[2] == 'mmap')
peak = kib('VmHWM')
total = sum(float(t.sum()) for t in state.values())  # touch every page
print(json.dumps({"peak": peak - base, "anon": kib('RssAnon') - anon, "rss": kib('VmRSS') - base}))
"""


@pytest.mark.slow  # > 15 s in make test's parallel phase: make test-slow (and CI) runs it
@pytest.mark.timeout(200)
def test_memory_is_not_a_second_copy(tmp_path: Path) -> None:
    """A 128 MiB state: a verified mapped load keeps its peak extra memory to the verification
    buffers, and touching every tensor adds file pages, not a private copy (anonymous memory)."""
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(1, {f"t{i}": torch.full((8 << 20,), float(i)) for i in range(4)})  # 4 x 32 MiB
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = {}
    for mode in ("mmap", "copy"):
        r = subprocess.run(
            [sys.executable, "-c", _RSS, str(root), mode], capture_output=True, text=True, timeout=150, env=env
        )
        assert r.returncode == 0, r.stderr
        res[mode] = {k: v / 1024 for k, v in json.loads(r.stdout).items()}  # MiB
    print(res)
    assert res["copy"]["anon"] > 120  # the plain load holds a private copy of the state
    assert res["mmap"]["peak"] < 40 and res["mmap"]["anon"] < 40, res
    assert res["mmap"]["rss"] < 128 + 40, res  # touched: the file's pages, once


def test_indexed_step_is_refused(tmp_path: Path) -> None:
    """A step with a global index (here: DTensors on a 1-rank gloo group) cannot be mapped."""
    root = tmp_path / "ck"
    code = f"""
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from asyncckpt import Checkpointer
dist.init_process_group("gloo", init_method="file://{tmp_path}/pg", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
with Checkpointer({str(root)!r}) as ck:
    ck.save(1, {{"w": distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])}})
os._exit(0)
"""
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    with pytest.raises(ValueError, match="global index"):
        asyncckpt.load(root, 1, mmap=True)
    assert torch.equal(asyncckpt.load(root, 1)["w"], torch.arange(6.0))


def test_newest_corrupt_falls_back_to_an_older_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.ones(10)})
        ck.save(2, {"w": torch.full((10,), 2.0)})
    shard = root / "step_00000002" / "rank00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x01
    shard.write_bytes(bytes(raw))
    got = asyncckpt.load(root, mmap=True)
    assert torch.equal(got["w"], torch.ones(10))
    assert any("step 2" in r.getMessage() and "corrupt" in r.getMessage() for r in caplog.records)
