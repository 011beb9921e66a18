"""Bounds on what a reader accepts, checked before anything is allocated (torch-free).

One acceptance rule for both directions: whatever ``save()`` accepts, ``load()`` restores,
and whatever a reader would refuse, ``save()`` refuses at the call (``TypeError`` /
``ValueError`` naming the key path and the limit). Each limit is therefore defined once, here
or beside the format it belongs to (``_header``), and used by the writer's check and the
reader's alike; the committing rank also checks the manifest and the global index it is
about to commit with the very parsers ``load()`` uses (``_commit``).

A hostile or damaged file must still cost bounded time and memory to refuse. Where a fixed
number would refuse honest states (a sampler's permutation of 9M ints, 200 MiB of ``bytes``,
600k tensors in one shard), the bound scales with the bytes the file actually has, whose size
the sealed manifest records and the reader checks before reading: parsing is linear in them,
and the memory the parse and the rebuilt state need is estimated from them and checked
against the memory available now. A real checkpoint larger than this machine's memory fails
with a ``CheckpointError`` saying how much it needs, before the allocation.

=========================  ===========================  ====================================
what                       limit                        why that number
=========================  ===========================  ====================================
manifest.json              64 MiB, 2**18 files,         65k ranks x 2 files is ~14 MB
                           2**22 JSON items
rankRRRRR.json             the bytes the manifest       parsing is linear in them; memory
                           seals; memory: 3 x bytes +   as below (no fixed count: an honest
                           2 x 96 B per JSON item       state may hold 9M values)
shard header               100 MiB read (``_header``),  the safetensors reference limit
                           100,000,000 B written;       (``save()`` and ``export`` refuse a
                           tensors: as many as it       header over it: every file written
                           holds; memory as above       opens with safetensors)
state nesting              200 levels                   hostile files must not exhaust the
                                                        stack (``save()`` refuses deeper)
tensor data / structure    available memory             MemAvailable + SwapFree, cgroup
                                                        memory.max, RLIMIT_AS / RLIMIT_DATA
=========================  ===========================  ====================================

"JSON items" are counted as the bytes ``,`` ``[`` ``{`` of the file (inside strings too): an
upper bound of the values the parser would create, computed at C speed. Where that bound
does not fit the memory available, the items outside strings are counted (a 9 MB string of
commas holds one value, not 9M), still at C speed, before anything is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .._errors import CheckpointCorruptError, CheckpointError
from ._checksum import crc32c
from ._gcpause import paused_gc

MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_MANIFEST_FILES = 2**18
MAX_MANIFEST_ITEMS = 2**22
#: A state, and the tree a reader decodes, nests at most this many levels: ``save()`` refuses
#: deeper states, readers deeper trees (a hostile file must not exhaust the stack).
MAX_DEPTH = 200
#: Bytes of memory one parsed JSON item may take (a list slot plus a small object), for the
#: memory checks of structure files and shard headers.
ITEM_BYTES = 96
#: A JSON string: its quotes and everything between them (escapes included), unrolled so the
#: match is linear with no backtracking.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


#: Interpreter frames (and JSON levels) a tree MAX_DEPTH levels deep may take to encode,
#: parse or rebuild, beyond the caller's own: up to 4 JSON levels per level (an OrderedDict's
#: ``{"$odict": [[[key, value]], meta]}``), 3 Python frames per level, and some spare.
STACK_ROOM = 5 * MAX_DEPTH + 100
_room_lock = threading.Lock()
_room_users = 0
_room_restore: tuple[int, int] | None = None  # (the limit before, the limit we set)


def _stack_depth() -> int:
    n, f = 0, sys._getframe(1)
    while f.f_back is not None:
        n, f = n + 1, f.f_back
    return n + 1


@contextlib.contextmanager
def recursion_room() -> Iterator[None]:
    """Room on the interpreter's recursion limit for a tree :data:`MAX_DEPTH` levels deep,
    whatever the caller's own stack depth, for the block: a state ``save()`` accepted from a
    shallow stack must not become "not valid JSON" when loaded from a deep one (the JSON
    parser and encoder count against the same limit as Python frames).

    The limit is raised when it is too low and put back when the last block on any thread
    ends, unless someone else changed it meanwhile. A hostile tree nested deeper than
    :data:`MAX_DEPTH` still meets the (raised) limit: a ``RecursionError`` the callers turn
    into ``CheckpointCorruptError``.
    """
    global _room_users, _room_restore
    need = _stack_depth() + STACK_ROOM
    with _room_lock:
        current = sys.getrecursionlimit()
        if need > current:
            sys.setrecursionlimit(need)
            if _room_restore is None:
                _room_restore = (current, need)
            else:
                _room_restore = (_room_restore[0], need)
        _room_users += 1
    try:
        yield
    finally:
        with _room_lock:
            _room_users -= 1
            if _room_users == 0 and _room_restore is not None:
                before, ours = _room_restore
                _room_restore = None
                if sys.getrecursionlimit() == ours:
                    sys.setrecursionlimit(before)


def json_items(raw: bytes) -> int:
    """An upper bound of the number of values ``json.loads(raw)`` creates (C speed, no allocation)."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1


def json_items_outside_strings(raw: bytes) -> int:
    """:func:`json_items` without the bytes inside strings: still an upper bound of the values
    ``json.loads(raw)`` creates, much closer for text-heavy files (C speed; one copy of the
    file without its strings' contents, at most ``len(raw)`` bytes)."""
    return json_items(_STRING.sub(b'""', raw))


def json_memory(nbytes: int, items: int) -> int:
    """Bytes of memory parsing ``nbytes`` of JSON holding ``items`` values may take: the text,
    its decoded copy and the strings parsed out of it, the parsed values and what a reader
    builds from them (one object per value)."""
    return 3 * nbytes + 2 * items * ITEM_BYTES


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


SMALL_NEED = 1 << 20


def check_memory(need: int, what: str, path: str, room: int | None = None) -> None:
    """Raise ``CheckpointError`` naming ``path`` if ``need`` bytes cannot be allocated now
    (``room``: :func:`available_memory`, when the caller has it already). A need under
    :data:`SMALL_NEED` is not looked up: reading /proc and the cgroup files costs more than a
    small load, and a process that cannot allocate a MiB fails with ``MemoryError`` anyway."""
    if room is None and need < SMALL_NEED:
        return
    room = available_memory() if room is None else room
    if room is not None and need > room:
        raise CheckpointError(
            f"{what} needs {human(need)} of memory but only {human(room)} is available "
            f"(free memory, cgroup and rlimits): {path}"
        )


def check_json_memory(text: bytes, what: str, path: str) -> None:
    """``CheckpointError`` naming ``path`` unless parsing the JSON ``text`` fits the memory
    available now (:func:`json_memory`; the items outside strings are counted only when the
    quick count does not fit)."""
    need = json_memory(len(text), json_items(text))
    if need < SMALL_NEED:
        return
    room = available_memory()
    # the closer count copies the text without its strings, in pieces: only where that fits
    if room is not None and need > room and len(text) + 40 * text.count(b'"') < room:
        try:
            need = json_memory(len(text), json_items_outside_strings(text))
        except MemoryError:
            pass  # the quick count's verdict stands
    check_memory(need, what, path, room)


def check_structure_size(size: int, path: str) -> None:
    """Before a structure file of ``size`` bytes (as its manifest seals it) is read:
    ``CheckpointError`` naming ``path`` unless even its cheapest parse fits the memory
    available (a sparse 1 TiB file is refused unread)."""
    check_memory(json_memory(size, 0), "reading the structure file", path)


def parse_structure(
    raw: bytes,
    path: str,
    size: int,
    expected_crc: int | None,
    object_hook: Callable[[dict[str, Any]], Any] | None = None,
) -> Any:
    """Check and parse the bytes of a structure file: size, checksum, memory, JSON
    (``object_hook``: ``json.loads``', e.g. ``_structure_decode.compact_node``)."""
    if len(raw) != size or (expected_crc is not None and crc32c(raw) != expected_crc):
        raise CheckpointCorruptError("checksum mismatch", path)
    check_json_memory(raw, "parsing the structure file", path)
    try:
        with paused_gc(), recursion_room():  # many small containers, no garbage cycles
            text = raw.decode("utf-8")
            del raw  # (gone during the parse if the caller kept no reference to it)
            return json.loads(text, object_hook=object_hook)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"structure is not valid JSON ({e})", path) from None
    except MemoryError:
        raise CheckpointError(f"not enough memory to parse the structure file: {path}") from None
