"""Review: CRC-32C combine against the crc32c package, and the zero-byte shift for lengths
far past what a file holds, against the plain operator (zlib's method: a 32x32 GF(2)
matrix squared once per bit of the length)."""

from __future__ import annotations

import os
import random

import crc32c as _crc
import pytest

from asyncckpt.format._checksum import crc32c_append_zeros, crc32c_combine, crc32c_shift
from asyncckpt.format._index import block_crcs

_POLY = 0x82F63B78


def _times(mat: tuple[int, ...], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _compose(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(a, col) for col in b)


def _reference_append_zeros(crc: int, nbytes: int) -> int:
    op = tuple(1 << i for i in range(32))
    zero_bit = (_POLY, *(1 << n for n in range(31)))
    byte = _compose(zero_bit, zero_bit)
    byte = _compose(byte, byte)
    byte = _compose(byte, byte)
    while nbytes:
        if nbytes & 1:
            op = _compose(byte, op)
        nbytes >>= 1
        if nbytes:
            byte = _compose(byte, byte)
    return _times(op, crc)


@pytest.mark.parametrize(
    "nbytes", [0, 1, 2, 3, 8, 4095, 4096, 1 << 20, 2**31 - 1, 2**32 + 5, 2**40, 2**40 + 12345, 2**60 + 1,
               2**61, 2**62 + 3, 2**63 - 1, 2**64 + 7, 2**100 + 1],
)  # fmt: skip
def test_shift_matches_the_operator_for_any_length(nbytes: int) -> None:
    rng = random.Random(nbytes)
    for _ in range(3):
        crc = rng.getrandbits(32)
        assert crc32c_append_zeros(crc, crc32c_shift(nbytes)) == _reference_append_zeros(crc, nbytes)


def test_combine_matches_crc32c_over_random_lengths() -> None:
    rng = random.Random(7)
    for _ in range(500):
        la = rng.choice([0, 1, 2, rng.randrange(100), rng.randrange(5000)])
        lb = rng.choice([0, 1, 2, rng.randrange(100), rng.randrange(5000)])
        a, b = os.urandom(la), os.urandom(lb)
        assert crc32c_combine(_crc.crc32c(a), _crc.crc32c(b), lb) == _crc.crc32c(a + b)


def test_block_crcs_over_many_block_sizes() -> None:
    rng = random.Random(11)
    for _ in range(150):
        n = rng.choice([0, 1, rng.randrange(3000), rng.randrange(70000)])
        block = rng.choice([1, 2, 3, 7, 64, 4096, rng.randrange(1, 5000), max(1, n), n + 1, max(1, n - 1)])
        data = os.urandom(n)
        whole, crcs = block_crcs(memoryview(data), block)
        assert whole == _crc.crc32c(data)
        assert crcs == [_crc.crc32c(data[i : i + block]) for i in range(0, n, block)]
