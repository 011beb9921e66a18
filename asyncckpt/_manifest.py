"""The manifest: the completion marker that names every file of a checkpoint.

``manifest.json`` is written last (tmp name, fsync, rename, directory fsync) and is the
only proof that a step is complete. It lists each file with its size and CRC-32C, and
carries a checksum of its own canonical encoding so a flipped bit anywhere in it is
detected rather than trusted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ._checksum import crc32c
from ._errors import CheckpointCorruptError

MANIFEST = "manifest.json"
FORMAT = "asyncckpt/1"
#: Names a manifest may list: plain file names inside the step directory, nothing else.
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
#: Manifests larger than this are refused unread (hostile files must not exhaust memory).
MAX_MANIFEST_BYTES = 64 * 1024 * 1024


def shard_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def tree_name(rank: int) -> str:
    return f"rank{rank:05d}.json"


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint as committed."""

    name: str
    size: int
    crc32c: int
    rank: int


@dataclass(frozen=True)
class Manifest:
    """A parsed, self-consistent manifest."""

    step: int
    attempt: str
    world_size: int
    nbytes: int
    created: float
    files: tuple[FileEntry, ...]
    extra: dict[str, Any]
    #: global ranks of the writing group, in group-rank order (``None``: an older manifest)
    ranks: tuple[int, ...] | None = None

    def file(self, name: str) -> FileEntry:
        for f in self.files:
            if f.name == name:
                return f
        raise CheckpointCorruptError(f"manifest does not list {name}")


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def encode(
    step: int,
    attempt: str,
    world_size: int,
    nbytes: int,
    created: float,
    files: list[FileEntry],
    extra: dict[str, Any],
    ranks: list[int] | None = None,
) -> bytes:
    """Serialize a manifest, sealed with a CRC-32C of its canonical body.

    ``ranks``: the global ranks of the group that wrote it, in group-rank order.
    """
    body: dict[str, Any] = {
        "format": FORMAT,
        "step": step,
        "attempt": attempt,
        "world_size": world_size,
        "nbytes": nbytes,
        "created": created,
        "files": [
            {"name": f.name, "size": f.size, "crc32c": f.crc32c, "rank": f.rank}
            for f in sorted(files, key=lambda f: f.name)
        ],
        "extra": extra,
    }
    if ranks is not None:
        body["ranks"] = list(ranks)
    sealed = dict(body, checksum=crc32c(_canonical(body)))
    return json.dumps(sealed, sort_keys=True, indent=1, ensure_ascii=True).encode() + b"\n"


def _uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def decode(raw: bytes, path: str) -> Manifest:
    """Parse and check a manifest; any defect raises ``CheckpointCorruptError`` naming ``path``."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"manifest is not valid JSON ({e})", path) from None
    if not isinstance(doc, dict) or "checksum" not in doc:
        raise CheckpointCorruptError("manifest has no checksum", path)
    seal = doc.pop("checksum")
    if not _uint(seal) or crc32c(_canonical(doc)) != seal:
        raise CheckpointCorruptError("manifest checksum mismatch", path)
    if raw != json.dumps(dict(doc, checksum=seal), sort_keys=True, indent=1, ensure_ascii=True).encode() + b"\n":
        raise CheckpointCorruptError("manifest is not in canonical form", path)
    if doc.get("format") != FORMAT:
        raise CheckpointCorruptError(f"unknown manifest format {doc.get('format')!r}", path)
    try:
        files = []
        names = set()
        for f in doc["files"]:
            name, size, crc, rank = f["name"], f["size"], f["crc32c"], f["rank"]
            if not (isinstance(name, str) and _SAFE_NAME.match(name) and name != MANIFEST):
                raise ValueError(f"unsafe file name {name!r}")
            if name in names or not (_uint(size) and _uint(crc) and _uint(rank)):
                raise ValueError(f"bad entry for {name!r}")
            names.add(name)
            files.append(FileEntry(name, size, crc, rank))
        step, attempt, ws, nbytes = doc["step"], doc["attempt"], doc["world_size"], doc["nbytes"]
        created, extra = doc["created"], doc["extra"]
        if not (_uint(step) and isinstance(attempt, str) and _uint(ws) and ws >= 1 and _uint(nbytes)):
            raise ValueError("bad header fields")
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not isinstance(extra, dict):
            raise ValueError("bad header fields")
        created = float(created)
        ranks = doc.get("ranks")  # absent in manifests written before it was recorded
        if ranks is not None and not (
            isinstance(ranks, list) and len(ranks) == ws and all(_uint(r) for r in ranks)
        ):
            raise ValueError("bad ranks")
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise CheckpointCorruptError(f"manifest is malformed ({e})", path) from None
    return Manifest(step, attempt, ws, nbytes, created, tuple(files), extra, None if ranks is None else tuple(ranks))
