"""CUDA paths on a real GPU: D2H staging into the pinned arena on a side stream, and restores
into CUDA targets through the double-buffered pinned bounce buffers. Skipped without CUDA
(CI has no GPU; these ran on an H200 lent for the purpose, see benchmarks/results/)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import CheckpointCorruptError
from asyncckpt.loading import _readinto

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REPO = Path(__file__).resolve().parents[1]


def busy(x: torch.Tensor, rounds: int = 40) -> torch.Tensor:
    """``x`` through a chain of kernels long enough (tens of ms) that a copy queued behind
    them on another stream would read stale memory if the streams were not ordered."""
    w = torch.full((x.shape[-1], x.shape[-1]), 1.0 / x.shape[-1], device=x.device)
    for _ in range(rounds):
        x = torch.tanh(x @ w + 0.5)
    return x


def shard_of(info: asyncckpt.CheckpointInfo) -> Path:
    return Path(info.path) / "rank00000.safetensors"


def test_save_holds_the_values_at_the_call_while_the_stream_mutates_them(tmp_path: Path) -> None:
    torch.manual_seed(0)
    big = busy(torch.randn(4096, 4096, device="cuda"))  # still computing when save() is called
    small = torch.randn(1000, device="cuda")
    expect = {"big": big.clone(), "small": small.clone()}  # queued in order: the values at the call
    with asyncckpt.Checkpointer(tmp_path / "ck") as ck:
        h = ck.save(1, {"big": big, "small": small, "cpu": torch.arange(5.0)})
        big.mul_(-1.0).add_(7.0)  # the loop mutates at once, on its own stream
        small.zero_()
        info = h.result(120)
    assert info.statistics is not None and info.statistics.device_copy_s > 0.0
    got = asyncckpt.load(tmp_path / "ck")
    assert torch.equal(got["big"], expect["big"].cpu())
    assert torch.equal(got["small"], expect["small"].cpu())
    assert torch.equal(got["cpu"], torch.arange(5.0))


def test_save_from_a_side_stream_of_the_caller(tmp_path: Path) -> None:
    """The copy waits for the caller's *current* stream, whichever it is."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = busy(torch.randn(2048, 2048, device="cuda"))
        expect = x.clone()
        with asyncckpt.Checkpointer(tmp_path / "ck") as ck:
            h = ck.save(1, {"x": x})
            x.fill_(3.0)
            h.result(120)
    torch.cuda.synchronize()
    assert torch.equal(asyncckpt.load(tmp_path / "ck")["x"], expect.cpu())


def test_reserve_pins_the_arena_and_saves_reuse_it(tmp_path: Path) -> None:
    state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(77, device="cuda", dtype=torch.bfloat16)}
    with asyncckpt.Checkpointer(tmp_path / "ck", keep_last=2) as ck:
        ck.reserve(state)
        arenas = ck.staging_statistics().free
        assert arenas and all(a.pinned for a in arenas)
        ptrs = {a.address for a in arenas}
        for step in range(3):
            state["w"].add_(1.0)
            ck.save(step, state).result(120)
        assert {a.address for a in ck.staging_statistics().free} <= ptrs  # reused
        got = ck.load()
    assert torch.equal(got["w"], state["w"].cpu()) and torch.equal(got["b"], state["b"].cpu())


def _targets() -> dict[str, torch.Tensor]:
    """CUDA targets of every shape the reader distinguishes: large (many bounce buffers,
    cut across threads), non-contiguous, bf16, 0-d, empty, one row."""
    return {
        "large": torch.zeros(6 * 1024, 1024, device="cuda"),  # 24 MiB: 6 bounce buffers
        "flat": torch.zeros(5 * 1024 * 1024 + 3, device="cuda"),
        "t": torch.zeros(300, 500, device="cuda").t(),
        "bf16": torch.zeros(1000, 33, dtype=torch.bfloat16, device="cuda"),
        "scalar": torch.zeros((), device="cuda", dtype=torch.int64),
        "empty": torch.zeros(0, 8, device="cuda"),
        "row": torch.zeros(1, 4096, device="cuda"),
    }


def _saved() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out: dict[str, torch.Tensor] = {}
    for k, t in _targets().items():
        out[k] = torch.randn(t.shape, generator=g).to(t.dtype) if t.is_floating_point() else torch.tensor(42)
    return out


@pytest.mark.parametrize("verify_first", [False, True])
def test_load_into_cuda_targets_every_shape(tmp_path: Path, verify_first: bool) -> None:
    saved = _saved()
    with asyncckpt.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, saved).result(120)
    targets = _targets()
    ptrs = {k: t.data_ptr() for k, t in targets.items()}
    out = asyncckpt.load(tmp_path / "ck", into=targets, verify_first=verify_first)
    for k, t in targets.items():
        assert out[k] is t and t.data_ptr() == ptrs[k], k  # read into the targets, not replaced
        assert torch.equal(t.cpu(), saved[k]), k


def test_load_waits_for_kernels_still_writing_the_targets(tmp_path: Path) -> None:
    """A kernel of the caller's stream that writes a target, queued before load(into=), runs
    before the loaded bytes land (else it would overwrite them afterwards)."""
    saved = {"x": torch.randn(2048, 2048)}
    with asyncckpt.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, saved).result(120)
    x = torch.zeros(2048, 2048, device="cuda")
    x.copy_(busy(torch.randn(2048, 2048, device="cuda")))  # queued, still running
    asyncckpt.load(tmp_path / "ck", into={"x": x})
    torch.cuda.synchronize()
    assert torch.equal(x.cpu(), saved["x"])


def test_corrupt_byte_names_the_shard_with_cuda_targets(tmp_path: Path) -> None:
    saved = _saved()
    with asyncckpt.Checkpointer(tmp_path / "ck") as ck:
        info = ck.save(1, saved).result(120)
    shard = shard_of(info)
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 5000)  # inside the tensor data
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    targets = _targets()
    with pytest.raises(CheckpointCorruptError) as e:
        asyncckpt.load(tmp_path / "ck", step=1, into=targets)
    assert e.value.path is not None and "rank00000.safetensors" in str(e.value.path)
    before = {k: t.clone() for k, t in _targets().items()}
    with pytest.raises(CheckpointCorruptError):
        asyncckpt.load(tmp_path / "ck", step=1, into=before, verify_first=True)
    assert all(torch.equal(t, _targets()[k]) for k, t in before.items())  # verify_first: untouched


def test_staged_cuda_targets_are_cut_for_every_thread() -> None:
    t = torch.zeros(64 * 1024, 256, device="cuda")  # 64 MiB
    pieces = _readinto._split([_readinto.Staged(0, t.numel() * 4, t)], _readinto.THREADS)
    assert len(pieces) == _readinto.THREADS
    assert sum(d.nbytes for g in pieces for d in g) == t.numel() * 4


def test_generator_and_rng_state_on_cuda_round_trip(tmp_path: Path) -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    torch.randn(10, device="cuda", generator=g)
    state: dict[str, Any] = {"g": g, "cuda_rng": torch.cuda.get_rng_state_all()}
    with asyncckpt.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state).result(120)
    got = asyncckpt.load(tmp_path / "ck")
    assert got["g"].device.type == "cuda"
    assert torch.equal(torch.randn(10, device="cuda", generator=got["g"]), torch.randn(10, device="cuda", generator=g))
    assert all(torch.equal(a, b) for a, b in zip(got["cuda_rng"], state["cuda_rng"], strict=True))


@pytest.mark.timeout(600)
def test_fsdp2_example_saved_on_the_gpu_resumes_on_cpu_ranks_and_back(tmp_path: Path, monkeypatch: Any) -> None:
    """examples/fsdp2_train.py: 1 GPU rank (NCCL) killed mid-save, resumed on 2 CPU ranks
    (gloo) and killed again, resumed on the GPU; every resume bit-identical to the saved
    model and optimizer (the checkpoint is a global description, whatever device wrote it)."""
    from test_fsdp2_example import records, resumed, torchrun

    root, refs = tmp_path / "root", tmp_path / "refs"
    common = ["--root", str(root), "--ref-dir", str(refs), "--save-every", "4"]
    code, out = torchrun(1, tmp_path, "gpu", *common, "--kill-at", "8", "--loss-log", str(tmp_path / "a.jsonl"))
    assert code != 0 and "SIGKILL" in out, out[-3000:]
    first = asyncckpt.find_latest(root)
    assert first is not None and first.step in (4, 8)

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    code, out = torchrun(2, tmp_path, "cpu", *common, "--kill-at", "12", "--loss-log", str(tmp_path / "b.jsonl"))
    assert code != 0, out[-3000:]
    got = resumed(records(tmp_path / "b.jsonl"))
    assert got == [{"resumed": first.step, "world": 2, "identical": True}], out[-3000:]
    second = asyncckpt.find_latest(root)
    assert second is not None and second.world_size == 2 and second.step in (8, 12)

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    code, out = torchrun(1, tmp_path, "gpu2", *common, "--steps", "14", "--loss-log", str(tmp_path / "c.jsonl"))
    assert code == 0, out[-3000:]
    got = resumed(records(tmp_path / "c.jsonl"))
    assert got == [{"resumed": second.step, "world": 1, "identical": True}], out[-3000:]
