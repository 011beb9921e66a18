"""The one checksum of the project: CRC-32C (pure, torch-free, usable from any layer)."""

from __future__ import annotations

from typing import Any

import crc32c as _crc32c


def crc32c(data: Any, value: int = 0) -> int:
    """CRC-32C of ``data`` continuing from ``value`` (releases the GIL on large buffers)."""
    return int(_crc32c.crc32c(data, value))
