"""The one checksum of the project: CRC-32C (pure, torch-free, usable from any layer), the
combination of two CRCs into the CRC of the concatenation, and the CRCs of byte ranges
computed from a file's bytes as they stream past (:class:`RangeCheck`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import crc32c as _crc32c


def crc32c(data: Any, value: int = 0) -> int:
    """CRC-32C of ``data`` continuing from ``value`` (releases the GIL on large buffers)."""
    return int(_crc32c.crc32c(data, value))


def crc32c_chain(buffers: Sequence[Any], value: int = 0) -> int:
    """CRC-32C of the concatenation of ``buffers`` continuing from ``value``: :func:`crc32c`
    of each in turn, the C function called straight (a read of many small tensors makes
    one call a tensor)."""
    c = _crc32c.crc32c
    for b in buffers:
        value = c(b, value)
    return int(value)


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


class RangeCheck:
    """The CRC-32C of byte ranges of one file, computed from its bytes as they stream past
    (``reading.file_crc``): ``ranges`` are ``(begin, length, crc, what)``, sorted by begin
    (``_index.checked_ranges``); after the last byte, ``bad`` names each range whose bytes
    do not match (a range past the end of the file included)."""

    def __init__(self, ranges: Sequence[tuple[int, int, int, str]]) -> None:
        self._todo = list(ranges)
        self._next = 0
        self._active: list[list[Any]] = []  # [begin, end, crc so far, expected, what]
        self._seen = 0  # bytes fed so far
        self.bad: list[str] = []

    def feed(self, offset: int, data: memoryview) -> None:
        """The file's bytes ``[offset, offset + len(data))``, in file order."""
        end = offset + len(data)
        self._seen = max(self._seen, end)
        while self._next < len(self._todo) and self._todo[self._next][0] < end:
            begin, n, crc, what = self._todo[self._next]
            self._active.append([begin, begin + n, 0, crc, what])
            self._next += 1
        still = []
        for r in self._active:
            lo, hi = max(r[0], offset), min(r[1], end)
            if lo < hi:
                r[2] = crc32c(data[lo - offset : hi - offset], r[2])
            if r[1] <= end:
                if r[2] != r[3]:
                    self.bad.append(r[4])
            else:
                still.append(r)
        self._active = still

    def finish(self) -> None:
        """No more bytes: every range not wholly fed is bad."""
        for begin, n, crc, what in self._todo[self._next :]:  # none of their bytes came by
            self._active.append([begin, begin + n, 0, crc, what])
        self._next = len(self._todo)
        for r in self._active:
            if r[1] > self._seen or r[2] != r[3]:
                self.bad.append(r[4])
        self._active = []
