"""Review: read_into over mixed Direct / Device (CPU tensors standing in for CUDA targets) /
Staged (non-contiguous) / Skip / Tiles (runs of contiguous CPU tensors) destinations, at small
bounce sizes: every byte lands where it belongs and the returned CRC-32C is the range's, with short
reads (the preadv stand-in) and zero-byte tensors; a file that ends early is
CheckpointCorruptError for every kind."""

from __future__ import annotations

import os
import random
from array import array
from pathlib import Path
from typing import Any

import crc32c as _crc
import pytest
import torch

from asyncckpt import CheckpointCorruptError
from asyncckpt.loading import _readinto

_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _layout(rng: random.Random, bounce: int) -> tuple[bytes, list[_readinto.Dest], list[tuple[torch.Tensor, Any]]]:
    blobs: list[bytes] = []
    dests: list[_readinto.Dest] = []
    checks: list[tuple[torch.Tensor, Any]] = []
    at = rng.randrange(0, 5)  # the range need not start at 0
    blobs.append(os.urandom(at))
    for _ in range(rng.randrange(1, 12)):
        kind = rng.choice(["direct", "device", "staged", "skip", "scalar", "tiles"])
        if kind == "tiles":  # a run of contiguous CPU tensors: the small ones take _read_tiles' path
            sizes = [rng.choice([1, 3, 8, bounce, rng.randrange(1, bounce + 1), 0, 2 * bounce + 1])
                     for _ in range(rng.randrange(1, 30))]  # fmt: skip
            run = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
            raws = [os.urandom(n) for n in sizes]
            dests.append(_readinto.Tiles(at, sum(sizes), run, array("q", sizes)))
            checks += [(t, torch.frombuffer(bytearray(r), dtype=torch.uint8) if r else t.clone())
                       for t, r in zip(run, raws, strict=True)]  # fmt: skip
            blobs += raws
            at += sum(sizes)
            continue
        itemsize = rng.choice(list(_DTYPES))
        rows = rng.choice([0, 1, 2, 3, rng.randrange(1, 40)])
        cols = rng.choice([1, 2, rng.randrange(1, 3 * bounce // itemsize + 3)])
        shape: tuple[int, ...] = () if kind == "scalar" else (rows, cols)
        src = torch.randint(0, 100, shape, dtype=_DTYPES[itemsize])
        raw = bytes(src.reshape(-1).view(torch.uint8).numpy()) if src.numel() else b""
        if kind in ("direct", "device"):
            t = torch.zeros(len(raw), dtype=torch.uint8)
            dests.append(_readinto.Direct(at, memoryview(t.numpy()).cast("B")) if kind == "direct"
                         else _readinto.Device(at, t))  # fmt: skip
            checks.append((t, torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else t.clone()))
        elif kind == "skip":
            dests.append(_readinto.Skip(at, len(raw)))
        else:
            t = torch.zeros(shape[::-1], dtype=src.dtype).t() if shape else torch.zeros((), dtype=src.dtype)
            dests.append(_readinto.Staged(at, len(raw), t))
            checks.append((t, src))
        blobs.append(raw)
        at += len(raw)
    return b"".join(blobs), dests, checks


@pytest.mark.parametrize("short", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_mixed_destinations_land_and_chain_their_crc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, short: bool
) -> None:
    rng = random.Random(seed)
    monkeypatch.setattr(_readinto, "BOUNCE", rng.choice([8, 16, 64, 4096]))
    monkeypatch.setattr(_readinto, "IOV_MAX", rng.choice([1, 2, 5, 1024]))
    data, dests, checks = _layout(rng, _readinto.BOUNCE)
    start = dests[0].offset
    f = tmp_path / "f"
    f.write_bytes(data)
    if short:
        real = os.preadv
        cut = random.Random(seed + 1)

        def short_preadv(fd: int, bufs: Any, off: int) -> int:  # the OS returning fewer bytes
            bufs = list(bufs)
            total = sum(len(b) for b in bufs)
            if total < 2 or cut.random() < 0.5:
                return real(fd, bufs, off)
            tmp = bytearray(cut.randrange(1, total))
            got = real(fd, [tmp], off)
            pos = 0
            for b in bufs:
                m = min(len(b), got - pos)
                if got - pos <= 0:  # (an empty view before the end takes nothing: the rest goes on)
                    break
                memoryview(b).cast("B")[:m] = tmp[pos : pos + m]
                pos += m
            return got

        monkeypatch.setattr(os, "preadv", short_preadv)
    fd = os.open(f, os.O_RDONLY)
    try:
        crc = _readinto.read_into(fd, str(f), dests, checksum=True, threads=rng.choice([1, 2, 3, 4, 7]))
    finally:
        os.close(fd)
    assert crc == _crc.crc32c(data[start:])
    for got, want in checks:
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["direct", "device", "staged", "skip", "tiles"])
@pytest.mark.parametrize("have", [0, 1, 63, 64, 65, 199])
def test_a_file_that_ends_early_is_corrupt_for_every_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, have: int
) -> None:
    monkeypatch.setattr(_readinto, "BOUNCE", 64)
    f = tmp_path / "f"
    f.write_bytes(os.urandom(have))
    d: _readinto.Dest
    if kind == "direct":
        d = _readinto.Direct(0, memoryview(bytearray(200)))
    elif kind == "device":
        d = _readinto.Device(0, torch.zeros(200, dtype=torch.uint8))
    elif kind == "staged":
        d = _readinto.Staged(0, 200, torch.zeros(20, 10, dtype=torch.uint8).t())
    elif kind == "tiles":
        d = _readinto.Tiles(0, 200, [torch.zeros(8, dtype=torch.uint8) for _ in range(25)], array("q", [8] * 25))
    else:
        d = _readinto.Skip(0, 200)
    fd = os.open(f, os.O_RDONLY)
    try:
        for threads in (1, 4):
            with pytest.raises(CheckpointCorruptError, match="ended early"):
                _readinto.read_into(fd, str(f), [d], checksum=True, threads=threads)
    finally:
        os.close(fd)
