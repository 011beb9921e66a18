"""The one checksum of the project: CRC-32C (pure, torch-free, usable from any layer), and
the combination of two CRCs into the CRC of the concatenation."""

from __future__ import annotations

from typing import Any

import crc32c as _crc32c


def crc32c(data: Any, value: int = 0) -> int:
    """CRC-32C of ``data`` continuing from ``value`` (releases the GIL on large buffers)."""
    return int(_crc32c.crc32c(data, value))


_POLY = 0x82F63B78  # CRC-32C, reflected


# Polynomials over GF(2) modulo the CRC-32C polynomial, bit-reflected like the CRC itself
# (bit 31 is x^0). Appending n zero bytes to a message multiplies its CRC register by
# x^(8n) mod P, so crc(A + B) = crc(A) * x^(8 len(B)) + crc(B): a few 32-bit carry-less
# products instead of squaring 32x32 bit matrices (which cost ~4 ms a call in Python).
def _mulmod(a: int, b: int) -> int:
    """``a * b mod P`` in the reflected representation."""
    out, bit = 0, 1 << 31
    while a:
        if a & bit:
            out ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return out


def _powers() -> list[int]:
    """``x^(2^k) mod P`` for k in 0..30: the sequence repeats with period 31 for CRC-32C's P
    (x^(2^31) = x mod P), so ``x^(2^k)`` is entry ``k % 31`` for every k."""
    out = [1 << 30]  # x^1
    for _ in range(30):
        out.append(_mulmod(out[-1], out[-1]))
    assert _mulmod(out[-1], out[-1]) == out[0]
    return out


_X2K = _powers()


def crc32c_shift(nbytes: int) -> int:
    """``x^(8 nbytes) mod P``: what :func:`crc32c_append_zeros` multiplies a CRC by."""
    shift, k = 1 << 31, 3  # x^0; nbytes bytes = nbytes * 2^3 bits
    while nbytes > 0:
        if nbytes & 1:
            shift = _mulmod(_X2K[k % 31], shift)
        nbytes >>= 1
        k += 1
    return shift


def crc32c_append_zeros(crc: int, shift: int) -> int:
    """The CRC register after the zero bytes ``shift`` (from :func:`crc32c_shift`) stands for."""
    return _mulmod(shift, crc)


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32C of ``A + B`` from ``crc1 = crc(A)``, ``crc2 = crc(B)`` and ``len(B)``."""
    if len2 <= 0:
        return crc1
    return _mulmod(crc32c_shift(len2), crc1) ^ crc2
