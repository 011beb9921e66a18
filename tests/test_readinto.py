"""``load(into=)`` reads straight into the target tensors: every target kind, the checksum
combine, short reads, and the contract on a corrupt file (targets untouched)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import crc32c as _crc
import pytest
import torch

import asyncckpt
from asyncckpt import CheckpointCorruptError, Checkpointer, load
from asyncckpt.format._checksum import crc32c_combine
from asyncckpt.loading import _blocks, _readinto

SHARD = "rank00000.safetensors"


def _save(root: Path, step: int, state: Any) -> Path:
    with Checkpointer(root) as ck:
        return Path(ck.save(step, state).result(timeout=60).path)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = _model(seed)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    for _ in range(2):
        m(torch.randn(5, 8)).sum().backward()
        opt.step()
    return m, opt


def _ptrs(ts: dict[str, torch.Tensor]) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in ts.items()}


def _opt_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items() if torch.is_tensor(v)}


@pytest.mark.parametrize("length", [0, 1, 3, 4096, 65537, 1 << 20])
def test_crc32c_combine_matches_the_whole(length: int) -> None:
    data = os.urandom(2 * length + 5)
    a, b = data[: length + 5], data[length + 5 :]
    assert crc32c_combine(_crc.crc32c(a), _crc.crc32c(b), len(b)) == _crc.crc32c(data)


def test_module_and_optimizer_are_read_in_place(tmp_path: Path) -> None:
    m1, o1 = _trained(1)
    _save(tmp_path, 1, {"model": m1, "optim": o1})
    m2, o2 = _trained(2)
    before_m, before_o = _ptrs(m2.state_dict()), _ptrs(_opt_tensors(o2))
    state = load(tmp_path, 1, into={"model": m2, "optim": o2})
    for k, v in m1.state_dict().items():  # params, BatchNorm's running stats and int64 counter
        assert torch.equal(m2.state_dict()[k], v), k
    for k, v in _opt_tensors(o1).items():
        assert torch.equal(_opt_tensors(o2)[k], v), k
    assert _ptrs(m2.state_dict()) == before_m  # the same memory, not new tensors
    assert _ptrs(_opt_tensors(o2)) == before_o
    assert state["model"]["0.weight"].data_ptr() == before_m["0.weight"]  # the state holds the targets


def test_plain_tensors_non_contiguous_and_mismatched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_readinto, "BOUNCE", 64)  # several bounce rounds per staged tensor
    saved = {
        "c": torch.arange(40, dtype=torch.float32).reshape(5, 8),
        "t": torch.arange(300, dtype=torch.float64).reshape(20, 15),
        "wide": torch.arange(200, dtype=torch.int32).reshape(2, 100),  # a row larger than the bounce
        "d": torch.arange(6, dtype=torch.float32),
        "scalar": torch.tensor(7.0),
        "empty": torch.empty(0, 3),
        "l": [torch.ones(3, dtype=torch.bfloat16)],
    }
    _save(tmp_path, 1, saved)
    t_base = torch.zeros(15, 20, dtype=torch.float64)
    wide_base = torch.zeros(100, 2, dtype=torch.int32)
    target = {
        "c": torch.zeros(5, 8),
        "t": t_base.t(),  # non-contiguous: the bounce path
        "wide": wide_base.t(),
        "d": torch.zeros(6, dtype=torch.float64),  # another dtype: fresh tensor, converted by copy_
        "scalar": torch.tensor(0.0),
        "empty": torch.empty(0, 3),
        "l": [torch.zeros(3, dtype=torch.bfloat16)],
    }
    ptr = target["c"].data_ptr()
    load(tmp_path, 1, into=target)
    for k in ("c", "t", "wide", "d", "scalar", "empty"):
        assert torch.equal(target[k], saved[k].to(target[k].dtype)), k
    assert torch.equal(target["l"][0], saved["l"][0])
    assert target["c"].data_ptr() == ptr and target["t"].data_ptr() == t_base.data_ptr()
    assert target["d"].dtype == torch.float64


def test_shape_mismatch_raises_the_existing_errors(tmp_path: Path) -> None:
    _save(tmp_path, 1, {"w": torch.ones(3, 4), "m": torch.nn.Linear(4, 2)})
    with pytest.raises(ValueError, match="shape"):
        load(tmp_path, 1, into={"w": torch.zeros(4, 3), "m": torch.nn.Linear(4, 2)})
    with pytest.raises(RuntimeError, match="size mismatch"):
        load(tmp_path, 1, into={"w": torch.zeros(3, 4), "m": torch.nn.Linear(5, 2)})


def test_tied_weights(tmp_path: Path) -> None:
    def tied(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
        m[1].weight = m[0].weight
        return m

    src, dst = tied(1), tied(2)
    _save(tmp_path, 1, {"m": src})
    load(tmp_path, 1, into={"m": dst})
    assert torch.equal(dst[0].weight, src[0].weight) and dst[1].weight is dst[0].weight


def _flip_data_byte(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10  # inside the last tensor's bytes
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("verify_first", [True, False], ids=["verify-first", "one-pass"])
def test_corrupt_shard_into_targets_then_fallback_restores_every_target(tmp_path: Path, verify_first: bool) -> None:
    m1, o1 = _trained(1)
    _save(tmp_path, 1, {"model": m1, "optim": o1, "big": torch.arange(1 << 16, dtype=torch.float32)})
    m3, o3 = _trained(3)
    big = torch.zeros(1 << 16)
    target = {"model": m3, "optim": o3, "big": big}
    m2, o2 = _trained(2)
    step2 = _save(tmp_path, 2, {"model": m2, "optim": o2, "big": torch.arange(1 << 16, dtype=torch.float32) + 1})
    _flip_data_byte(step2 / SHARD)
    pristine = {k: v.clone() for k, v in m3.state_dict().items()}
    pristine_o = {k: v.clone() for k, v in _opt_tensors(o3).items()}
    with pytest.raises(CheckpointCorruptError) as ei:
        load(tmp_path, 2, into=target, verify_first=verify_first)
    assert ei.value.path is not None and ei.value.path.endswith(SHARD)
    if verify_first:
        # its contract: a checkpoint that fails verification writes no target
        assert all(torch.equal(m3.state_dict()[k], v) for k, v in pristine.items())
        assert all(torch.equal(_opt_tensors(o3)[k], v) for k, v in pristine_o.items())
        assert torch.equal(big, torch.zeros(1 << 16))
        assert "verify_first" not in str(ei.value)
    else:  # the default, one pass: step 2's bytes (the flipped one too) landed in the targets
        assert torch.equal(big[:16], torch.arange(16, dtype=torch.float32) + 1)
        # and the error says so, for a caller who would catch it and train on from the targets
        assert "partly overwritten" in str(ei.value) and "verify_first=True" in str(ei.value)
    # either way the newest that verifies, step 1, read in place over the same targets, restores all
    load(tmp_path, into=target, verify_first=verify_first)
    assert all(torch.equal(m3.state_dict()[k], v) for k, v in m1.state_dict().items())
    assert all(torch.equal(_opt_tensors(o3)[k], v) for k, v in _opt_tensors(o1).items())
    assert torch.equal(big, torch.arange(1 << 16, dtype=torch.float32))


def test_step_none_over_a_corrupt_newest_restores_the_older_step_in_one_pass(tmp_path: Path) -> None:
    m1, o1 = _trained(1)
    _save(tmp_path, 1, {"model": m1, "optim": o1})
    m2, o2 = _trained(2)
    _flip_data_byte(_save(tmp_path, 2, {"model": m2, "optim": o2}) / SHARD)
    m3, o3 = _trained(3)
    load(tmp_path, into={"model": m3, "optim": o3})  # step 2 is read (into the targets), fails, step 1 loads
    assert all(torch.equal(m3.state_dict()[k], v) for k, v in m1.state_dict().items())
    assert all(torch.equal(_opt_tensors(o3)[k], v) for k, v in _opt_tensors(o1).items())


def test_a_failed_fallback_after_a_one_pass_read_says_the_targets_are_dirty(tmp_path: Path) -> None:
    # step 2 (corrupt) holds "b", step 1 does not: the fallback to step 1 cannot restore "b"
    _save(tmp_path, 1, {"w": torch.arange(4.0)})
    _flip_data_byte(_save(tmp_path, 2, {"w": torch.arange(4.0) + 1, "b": torch.full((1 << 12,), 2.0)}) / SHARD)
    b = torch.full((1 << 12,), 7.0)
    with pytest.raises(KeyError) as ei:
        load(tmp_path, into={"w": torch.zeros(4), "b": b})
    assert "partly overwritten" in str(ei.value) and "verify_first=True" in str(ei.value)
    assert not torch.equal(b, torch.full((1 << 12,), 7.0))  # step 2's bytes landed: the note is true
    b.fill_(7.0)
    with pytest.raises(KeyError) as ei:
        load(tmp_path, into={"w": torch.zeros(4), "b": b}, verify_first=True)
    assert "partly overwritten" not in str(ei.value) and torch.equal(b, torch.full((1 << 12,), 7.0))
    # nothing read into the targets, nothing said: an empty root
    with pytest.raises(asyncckpt.CheckpointNotFoundError) as en:
        load(tmp_path / "empty", into={"b": b})
    assert "partly overwritten" not in str(en.value)


def test_an_io_error_after_verify_first_verified_says_the_targets_may_be_dirty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # EIO from the disk during the second pass only (after the whole shard verified): a fault
    # the OS cannot produce on demand here, so os.preadv stands in for it, armed by the phase
    import errno

    _save(tmp_path, 1, {"w": torch.arange(4.0)})
    _save(tmp_path, 2, {"w": torch.arange(4.0) + 1, "b": torch.full((1 << 12,), 2.0)})
    real_read_into, real_preadv = _readinto.read_into, os.preadv
    armed = [False]

    def read_into(fd: Any, path: str, dests: Any, checksum: bool = True, **kw: Any) -> Any:
        armed[0] = not checksum  # the second pass reads without a checksum
        try:
            return real_read_into(fd, path, dests, checksum=checksum, **kw)
        finally:
            armed[0] = False

    def preadv(fd: int, bufs: Any, offset: int) -> int:
        if armed[0]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(_readinto, "read_into", read_into)
    monkeypatch.setattr(os, "preadv", preadv)
    b = torch.full((1 << 12,), 7.0)
    with pytest.raises(asyncckpt.CheckpointReadError) as ei:  # the disk's fault, not the data's
        load(tmp_path, 2, into={"w": torch.zeros(4), "b": b}, verify_first=True)
    assert "Input/output error" in str(ei.value) and SHARD in str(ei.value)
    assert ei.value.errno == errno.EIO and not isinstance(ei.value, CheckpointCorruptError)
    assert "the shard verified, then reading it into the targets failed" in str(ei.value)
    # the first pass alone writes no target: without the fault the same load restores step 2
    monkeypatch.undo()
    got = load(tmp_path, 2, into={"w": torch.zeros(4), "b": b}, verify_first=True)
    assert torch.equal(got["b"], torch.full((1 << 12,), 2.0)) and got["b"] is b


def test_verify_first_must_be_a_bool(tmp_path: Path) -> None:
    _save(tmp_path, 1, {"w": torch.zeros(4)})
    with pytest.raises(TypeError, match="verify_first must be a bool"):
        load(tmp_path, 1, into={"w": torch.zeros(4)}, verify_first="yes")  # type: ignore[arg-type]


def test_corrupt_shard_without_targets_still_detected(tmp_path: Path) -> None:
    step = _save(tmp_path, 1, {"w": torch.arange(1 << 20, dtype=torch.float32)})
    _flip_data_byte(step / SHARD)
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        load(tmp_path, 1)
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        # no usable target (another dtype: copied, not read into): read once, checksummed
        load(tmp_path, 1, into={"w": torch.zeros(1 << 20, dtype=torch.float64)})


def test_short_reads_are_continued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = {"a": torch.arange(5000, dtype=torch.float32), "b": torch.arange(3000, dtype=torch.int64).reshape(30, 100)}
    _save(tmp_path, 1, saved)
    real = os.preadv

    def short(fd: int, buffers: list[Any], offset: int) -> int:
        n = max(1, min(sum(len(b) for b in buffers), 777))  # never more than 777 bytes at once
        view = memoryview(bytearray(n))
        got = real(fd, [view], offset)
        pos = 0
        for b in buffers:
            if pos >= got:
                break
            k = min(len(b), got - pos)
            memoryview(b).cast("B")[:k] = view[pos : pos + k]
            pos += k
        return got

    monkeypatch.setattr(os, "preadv", short)
    b_target = torch.zeros(100, 30, dtype=torch.int64).t()
    target = {"a": torch.zeros(5000), "b": b_target}
    load(tmp_path, 1, into=target)
    assert torch.equal(target["a"], saved["a"]) and torch.equal(target["b"], saved["b"])
    assert torch.equal(load(tmp_path, 1)["a"], saved["a"])


def test_truncated_during_read_is_corrupt_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, 1, {"a": torch.arange(5000, dtype=torch.float32)})
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: 0)  # the file "ends" at once
    with pytest.raises(CheckpointCorruptError, match="ended early"):
        load(tmp_path, 1, into={"a": torch.zeros(5000)})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_targets(tmp_path: Path) -> None:
    saved = {"a": torch.arange(1 << 20, dtype=torch.float32), "b": torch.arange(12.0).reshape(3, 4)}
    _save(tmp_path, 1, saved)
    target = {"a": torch.zeros(1 << 20, device="cuda"), "b": torch.zeros(4, 3, device="cuda").t()}
    ptr = target["a"].data_ptr()
    load(tmp_path, 1, into=target)
    assert torch.equal(target["a"].cpu(), saved["a"]) and torch.equal(target["b"].cpu(), saved["b"])
    assert target["a"].data_ptr() == ptr


_RSS_WORKER = textwrap.dedent(
    """
    import sys, torch, asyncckpt
    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    n = int(sys.argv[2]) // 4 // 16
    state = {"model": {f"w{i}": torch.empty(n).uniform_() for i in range(8)},
             "optim": {"state": {i: {"exp_avg": torch.empty(n).uniform_()} for i in range(8)}}}
    asyncckpt.load(sys.argv[1], 1)  # warm-up (imports, allocator) without a target: fresh tensors
    import gc; gc.collect()
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
    base = hwm()
    asyncckpt.load(sys.argv[1], 1, into=state)
    print(hwm() - base)
    """
)


def test_load_into_peak_memory_is_bounded_by_the_buffers(tmp_path: Path) -> None:
    size = 256 << 20
    n = size // 4 // 16
    _save(tmp_path, 1, {"model": {f"w{i}": torch.ones(n) for i in range(8)},
                        "optim": {"state": {i: {"exp_avg": torch.ones(n)} for i in range(8)}}})  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(asyncckpt.__file__).parents[1]), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", _RSS_WORKER, str(tmp_path), str(size)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    extra = int(out.stdout.split()[-1])
    print(f"load(into=) of a {size >> 20} MiB state: {extra / 2**20:.1f} MiB extra peak RSS")
    assert extra < size // 2, f"load(into=) of a {size >> 20} MiB state took {extra >> 20} MiB extra"


def test_targets_and_fresh_tensors_in_one_shard(tmp_path: Path) -> None:
    m1, o1 = _trained(1)
    step = _save(tmp_path, 1, {"model": m1, "optim": o1})
    m2 = _model(2)
    ptrs = _ptrs(m2.state_dict())
    state = load(tmp_path, 1, into={"model": m2})  # the optimizer state: fresh tensors, returned
    assert all(torch.equal(m2.state_dict()[k], v) for k, v in m1.state_dict().items())
    assert _ptrs(m2.state_dict()) == ptrs
    for i, s in o1.state_dict()["state"].items():
        assert all(torch.equal(state["optim"]["state"][i][k], v) for k, v in s.items())
    _flip_data_byte(step / SHARD)
    m3 = _model(3)
    pristine = {k: v.clone() for k, v in m3.state_dict().items()}
    with pytest.raises(CheckpointCorruptError):
        load(tmp_path, 1, into={"model": m3}, verify_first=True)
    assert all(torch.equal(m3.state_dict()[k], v) for k, v in pristine.items())


def _ranges_read(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """Every thread's destinations of the reads to come (``_read_range`` spied on)."""
    seen: list[list[Any]] = []
    real = _readinto._read_range

    def spy(fd: int, dests: list[Any], path: str, checksum: bool) -> int:
        seen.append(dests)
        return real(fd, dests, path, checksum)

    monkeypatch.setattr(_readinto, "_read_range", spy)
    return seen


def test_one_large_target_is_read_by_every_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_readinto, "BOUNCE", 4096)
    saved = {"big": torch.arange(1 << 18, dtype=torch.float32), "small": torch.arange(3.0)}
    _save(tmp_path, 1, saved)
    seen = _ranges_read(monkeypatch)
    target = {"big": torch.zeros(1 << 18), "small": torch.zeros(3)}
    load(tmp_path, 1, into=target)
    assert torch.equal(target["big"], saved["big"]) and torch.equal(target["small"], saved["small"])
    assert len(seen) == _readinto.THREADS  # one pass, split across every thread
    seen.clear()
    target = {"big": torch.zeros(1 << 18), "small": torch.zeros(3)}
    load(tmp_path, 1, into=target, verify_first=True)
    assert torch.equal(target["big"], saved["big"]) and torch.equal(target["small"], saved["small"])
    assert len(seen) == 2 * _readinto.THREADS  # both passes split across every thread


def test_one_large_non_contiguous_target_is_cut_by_rows_for_every_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staged target (non-contiguous here; CUDA targets take the same path) is cut along its
    leading dimension, so every thread reads a part and the pieces land in the right rows."""
    monkeypatch.setattr(_readinto, "BOUNCE", 4096)
    saved = {"t": torch.arange(512 * 300, dtype=torch.float32).reshape(512, 300)}
    _save(tmp_path, 1, saved)
    seen = _ranges_read(monkeypatch)
    target = {"t": torch.zeros(300, 512).t()}
    for verify_first in (False, True):
        target["t"].zero_()
        seen.clear()
        load(tmp_path, 1, into=target, verify_first=verify_first)
        assert torch.equal(target["t"], saved["t"])
        staged = [d for g in seen for d in g if isinstance(d, _readinto.Staged)]
        assert len({id(g) for g in seen}) >= _readinto.THREADS and len(staged) > _readinto.THREADS
        assert sum(d.nbytes for d in staged) == 512 * 300 * 4


def test_device_destinations_share_reads_and_one_checksum_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adjacent device destinations (contiguous CUDA targets' bytes; CPU tensors stand in here,
    copied at once instead of on a side stream) are read together into the bounce buffer and
    checksummed there: reads per bounce buffer, not per tensor."""
    monkeypatch.setattr(_readinto, "BOUNCE", 4096)
    data = bytes(torch.randint(0, 256, (100_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    f = tmp_path / "f"
    f.write_bytes(data)
    sizes = [7, 1, 300, 4096, 5000, *([13] * 200), 0]
    sizes.append(len(data) - sum(sizes))
    dsts = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    dests: list[_readinto.Dest] = []
    at = 0
    for t in dsts:
        dests.append(_readinto.Device(at, t))
        at += t.numel()
    reads = [0]
    real = os.preadv

    def counting(fd: int, bufs: Any, off: int) -> int:
        reads[0] += 1
        return real(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", counting)
    fd = os.open(f, os.O_RDONLY)
    try:
        crc = _readinto.read_into(fd, str(f), dests, checksum=True)
    finally:
        os.close(fd)
    assert crc == _crc.crc32c(data)
    assert b"".join(bytes(t.numpy()) for t in dsts) == data
    assert reads[0] <= len(data) // 4096 + 2 * _readinto.THREADS  # 207 tensors, ~25 buffers' worth


def test_expanded_target_keeps_the_old_error(tmp_path: Path) -> None:
    _save(tmp_path, 1, {"e": torch.arange(12.0).reshape(3, 4)})
    target = {"e": torch.zeros(1, 4).expand(3, 4)}  # one memory location per column
    with pytest.raises(RuntimeError, match="single memory location"):
        load(tmp_path, 1, into=target)  # raised by restore_into's copy_, as before


# ---------------------------------------------------------------------- read_blocks (resharded loads)
@pytest.mark.parametrize("length", [0, 1, 4095, 4096, 4097, 3 * 4096, 3 * 4096 + 7])
def test_block_crcs_match_the_whole_and_each_block(length: int) -> None:
    from asyncckpt.format._index import block_crcs

    data = os.urandom(length)
    whole, blocks = block_crcs(memoryview(data), 4096)
    assert whole == _crc.crc32c(data)
    assert blocks == [_crc.crc32c(data[i : i + 4096]) for i in range(0, length, 4096)]


def _random_blocks(
    rng: Any, fds: list[tuple[int, str, bytes]], block: int, dest: memoryview
) -> tuple[list[_blocks.Block], list[tuple[bytes, int]]]:
    """Blocks over the files with random runs into ``dest``: tiling, partial and none."""
    blocks, want, at = [], [], 0
    for fd, path, data in fds:
        for off in range(0, len(data), block):
            n = min(block, len(data) - off)
            kind = rng.integers(3)
            runs: list[tuple[int, memoryview]] = []
            if kind == 0:  # tiles the block: read straight into the destination
                cuts = sorted({0, n, *rng.integers(0, n + 1, 3).tolist()})
                spans = list(itertools.pairwise(cuts))
            elif kind == 1:  # parts of it: through the bounce buffer
                cuts = sorted(set(rng.integers(0, n + 1, 4).tolist()))
                spans = list(zip(cuts[::2], cuts[1::2], strict=False))
            else:
                spans = []  # only checked
            for a, b in spans:
                if b > a:
                    runs.append((a, dest[at : at + b - a]))
                    want.append((data[off + a : off + b], at))
                    at += b - a
            crc = _crc.crc32c(data[off : off + n])
            blocks.append(_blocks.Block(fd, path, off, n, crc, tuple(runs), f"block at {off}"))
    return blocks, want


@pytest.mark.parametrize("bounce", [64, 4096, 1 << 20])
def test_read_blocks_lands_every_run_and_checks_every_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bounce: int
) -> None:
    import numpy as np

    monkeypatch.setattr(_blocks, "BOUNCE", bounce)  # blocks larger than a segment stream through it
    rng = np.random.default_rng(bounce)
    files = []
    for i, size in enumerate((0, 5000, 3 * 4096 + 11, 40000)):
        p = tmp_path / f"f{i}"
        data = os.urandom(size)
        p.write_bytes(data)
        files.append((os.open(p, os.O_RDONLY), str(p), data))
    try:
        dest = memoryview(bytearray(sum(len(d) for _, _, d in files)))
        blocks, want = _random_blocks(rng, files, 4096, dest)
        order = rng.permutation(len(blocks))  # any order: read_blocks sorts
        _blocks.read_blocks([blocks[i] for i in order])
        for data, at in want:
            assert bytes(dest[at : at + len(data)]) == data
        # one checksum off: named, with the file
        bad = next(b for b in blocks if b.nbytes)
        broken = _blocks.Block(bad.fd, bad.path, bad.offset, bad.nbytes, (bad.crc or 0) ^ 1, bad.runs, "block X")
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch in block X") as e:
            _blocks.read_blocks([*blocks, broken])
        assert e.value.path == bad.path
        # unchecked blocks larger than a bounce buffer are cut and spread over the threads
        fd, path, data = files[-1]
        out = memoryview(bytearray(len(data)))
        _blocks.read_blocks([_blocks.Block(fd, path, 0, len(data), None, ((0, out),), "all")])
        assert bytes(out) == data
    finally:
        for fd, _, _ in files:
            os.close(fd)


def test_read_blocks_reports_a_file_that_ends_early(tmp_path: Path) -> None:
    p = tmp_path / "short"
    p.write_bytes(b"x" * 100)
    fd = os.open(p, os.O_RDONLY)
    try:
        out = memoryview(bytearray(200))
        with pytest.raises(CheckpointCorruptError, match="ended early") as e:
            _blocks.read_blocks([_blocks.Block(fd, str(p), 0, 200, None, ((0, out),), "all")])
        assert e.value.path == str(p)
    finally:
        os.close(fd)
