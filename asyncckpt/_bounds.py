"""Bounds on what a reader accepts, checked before anything is allocated (torch-free).

A hostile or damaged file must cost bounded time and memory to refuse. Each limit is far
above anything a real checkpoint reaches (a real manifest lists two files per rank, a real
structure file a few JSON items per saved value) and is checked on sizes and byte counts
before the file is parsed. A checkpoint that is real but larger than this machine's memory
fails with a ``CheckpointError`` saying how much it needs, before the allocation.

=========================  ===========================  ====================================
what                       limit                        why that number
=========================  ===========================  ====================================
manifest.json              64 MiB, 2**18 files,         65k ranks x 2 files is ~14 MB
                           2**22 JSON items
rankRRRRR.json             256 MiB, 2**23 JSON items    8M saved values (a list of 8M ints)
shard header               100 MiB, 2**19 tensors       the safetensors reference limit;
                                                        524k tensors in one rank's shard
tensor data / structure    available memory             MemAvailable + SwapFree, cgroup
                                                        memory.max, RLIMIT_AS / RLIMIT_DATA
=========================  ===========================  ====================================

"JSON items" are counted as the bytes ``,`` ``[`` ``{`` in the file (inside strings too): an
upper bound of the values the parser would create, computed at C speed.
"""

from __future__ import annotations

import json
import os
import resource
from typing import Any

from ._checksum import crc32c
from ._errors import CheckpointCorruptError, CheckpointError

MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_MANIFEST_FILES = 2**18
MAX_MANIFEST_ITEMS = 2**22
MAX_TREE_BYTES = 256 * 1024 * 1024
MAX_TREE_ITEMS = 2**23
#: Bytes of memory one parsed JSON item may take (a list slot plus a small object), for the
#: memory check of structure files.
ITEM_BYTES = 96


def json_items(raw: bytes) -> int:
    """An upper bound of the number of values ``json.loads(raw)`` creates (C speed, no allocation)."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1


def human(n: int) -> str:
    """``n`` bytes in binary units (``1.5 GiB``)."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if x < 1024 or unit == "PiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"  # pragma: no cover


def _meminfo(*keys: str) -> int | None:
    try:
        with open("/proc/meminfo", "rb") as f:
            text = f.read(1 << 16).decode("ascii", "replace")
    except OSError:
        return None
    found = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in keys:
            try:
                found[name] = int(rest.split()[0]) * 1024
            except (ValueError, IndexError):
                return None
    return sum(found.values()) if len(found) == len(keys) else None


def _read_small(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16).decode("ascii", "replace")
    except OSError:
        return None


def _cgroup_room() -> int | None:
    """Room left under this process's cgroup v2 memory.max (page cache counts as free)."""
    own = _read_small("/proc/self/cgroup") or ""
    rel = next((line[3:] for line in own.splitlines() if line.startswith("0::")), None)
    for base in [f"/sys/fs/cgroup{rel}" if rel else None, "/sys/fs/cgroup"]:
        if base is None:
            continue
        limit = (_read_small(os.path.join(base, "memory.max")) or "").strip()
        current = (_read_small(os.path.join(base, "memory.current")) or "").strip()
        if not limit or limit == "max" or not current:
            continue
        try:
            room = int(limit) - int(current)
        except ValueError:
            continue
        for line in (_read_small(os.path.join(base, "memory.stat")) or "").splitlines():
            if line.startswith("file "):
                try:
                    room += int(line.split()[1])
                except (ValueError, IndexError):
                    pass
        return max(0, room)
    return None


def _rlimit_room() -> int | None:
    """Room left under RLIMIT_AS / RLIMIT_DATA (against this process's VmSize / VmData)."""
    status = _read_small("/proc/self/status") or ""
    used = {}
    for line in status.splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmSize", "VmData"):
            try:
                used[name] = int(rest.split()[0]) * 1024
            except (ValueError, IndexError):
                pass
    rooms = []
    for lim, key in ((resource.RLIMIT_AS, "VmSize"), (getattr(resource, "RLIMIT_DATA", None), "VmData")):
        if lim is None:
            continue
        soft = resource.getrlimit(lim)[0]
        if soft != resource.RLIM_INFINITY and key in used:
            rooms.append(max(0, soft - used[key]))
    return min(rooms) if rooms else None


def available_memory() -> int | None:
    """Bytes this process can still allocate, as well as the system tells (``None``: unknown)."""
    rooms = []
    system = _meminfo("MemAvailable", "SwapFree")
    if system is None and hasattr(os, "sysconf"):
        try:
            system = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            system = None
    for room in (system, _cgroup_room(), _rlimit_room()):
        if room is not None:
            rooms.append(room)
    return min(rooms) if rooms else None


def check_memory(need: int, what: str, path: str) -> None:
    """Raise ``CheckpointError`` naming ``path`` if ``need`` bytes cannot be allocated now."""
    room = available_memory()
    if room is not None and need > room:
        raise CheckpointError(
            f"{what} needs {human(need)} of memory but only {human(room)} is available "
            f"(free memory, cgroup and rlimits): {path}"
        )


def parse_structure(raw: bytes, path: str, size: int, expected_crc: int | None) -> Any:
    """Check and parse the bytes of a structure file: size, checksum, item count, memory, JSON."""
    if len(raw) != size or (expected_crc is not None and crc32c(raw) != expected_crc):
        raise CheckpointCorruptError("checksum mismatch", path)
    items = json_items(raw)
    if items > MAX_TREE_ITEMS:
        raise CheckpointCorruptError(f"structure file has more than {MAX_TREE_ITEMS} JSON items", path)
    # the text, its decoded copy, the parsed tree and the state rebuilt from it
    check_memory(2 * len(raw) + 2 * items * ITEM_BYTES, "parsing the structure file", path)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"structure is not valid JSON ({e})", path) from None
    except MemoryError:
        raise CheckpointError(f"not enough memory to parse the structure file: {path}") from None
