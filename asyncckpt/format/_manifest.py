"""The manifest: the completion marker that names every file of a checkpoint.

``manifest.json`` is written last (tmp name, fsync, rename, directory fsync) and is the
only proof that a step is complete. It lists each file with its size and CRC-32C, and
carries a checksum of its own canonical encoding so a flipped bit anywhere in it is
detected rather than trusted. It records the run the step belongs to (``run``, see
``_runs``; absent in manifests written before runs were recorded).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .._errors import CheckpointCorruptError
from ._bounds import MAX_MANIFEST_BYTES, MAX_MANIFEST_FILES, MAX_MANIFEST_ITEMS, json_items
from ._checksum import crc32c

MANIFEST = "manifest.json"
FORMAT = "asyncckpt/1"
#: A step with a global tensor index (``index.json``: DTensors, dedupe) or tied tensors (one
#: name in several tree nodes): readers that know only ``asyncckpt/1`` refuse it instead of
#: misreading it. Other states keep FORMAT.
FORMAT_INDEXED = "asyncckpt/2"
FORMATS = (FORMAT, FORMAT_INDEXED)
#: Names a manifest may list: plain file names inside the step directory, nothing else.
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
#: A run id (``_runs``): a lowercase hex token.
RUN_ID = re.compile(r"^[0-9a-f]{1,64}$")


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
    format: str = FORMAT
    #: the run the step belongs to (``_runs``; ``None``: written before run ids were recorded)
    run: str | None = None
    _by_name: dict[str, FileEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {f.name: f for f in self.files})

    def file(self, name: str) -> FileEntry:
        """The entry of ``name`` (``CheckpointCorruptError`` if the manifest does not list it)."""
        f = self._by_name.get(name)
        if f is None:
            raise CheckpointCorruptError(f"manifest does not list {name}")
        return f


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
    format: str = FORMAT,
    run: str | None = None,
) -> bytes:
    """Serialize a manifest, sealed with a CRC-32C of its canonical body.

    ``ranks``: the global ranks of the group that wrote it, in group-rank order. ``run``: the
    id of the run the step belongs to (``_runs``), sealed like every other field.
    """
    body: dict[str, Any] = {
        "format": format,
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
    if run is not None:
        if not RUN_ID.match(run):
            raise ValueError(f"run id must be a lowercase hex token, not {run!r}")
        body["run"] = run
    sealed = dict(body, checksum=crc32c(_canonical(body)))
    return json.dumps(sealed, sort_keys=True, indent=1, ensure_ascii=True).encode() + b"\n"


def _uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def decode(raw: bytes, path: str) -> Manifest:
    """Parse and check a manifest; any defect raises ``CheckpointCorruptError`` naming ``path``.

    Bounded before parsing (size, JSON item count) and checked for consistency: every file
    belongs to a rank below ``world_size`` and every rank has a file, so nothing that walks
    the ranks can be sent on a walk of 10**12 of them. Unknown top-level fields are kept
    under the seal (a newer writer may add them) and ignored.
    """
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(f"manifest larger than {MAX_MANIFEST_BYTES} bytes", path)
    if json_items(raw) > MAX_MANIFEST_ITEMS:
        raise CheckpointCorruptError(f"manifest has more than {MAX_MANIFEST_ITEMS} JSON items", path)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError, MemoryError) as e:
        raise CheckpointCorruptError(f"manifest is not valid JSON ({type(e).__name__}: {e})", path) from None
    if not isinstance(doc, dict) or "checksum" not in doc:
        raise CheckpointCorruptError("manifest has no checksum", path)
    seal = doc.pop("checksum")
    try:
        canonical = _canonical(doc)
    except (ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"manifest is malformed ({e})", path) from None
    if not _uint(seal) or crc32c(canonical) != seal:
        raise CheckpointCorruptError("manifest checksum mismatch", path)
    if doc.get("format") not in FORMATS:
        raise CheckpointCorruptError(f"unknown manifest format {doc.get('format')!r}", path)
    try:
        entries = doc["files"]
        if not isinstance(entries, list) or len(entries) > MAX_MANIFEST_FILES:
            raise ValueError(f"files must be a list of at most {MAX_MANIFEST_FILES} entries")
        files = []
        names = set()
        ranks = set()
        for f in entries:
            name, size, crc, rank = f["name"], f["size"], f["crc32c"], f["rank"]
            if not (isinstance(name, str) and _SAFE_NAME.match(name) and name != MANIFEST):
                raise ValueError(f"unsafe file name {name!r}")
            if name in names or not (_uint(size) and _uint(crc) and _uint(rank)):
                raise ValueError(f"bad entry for {name!r}")
            if size >= 2**63 or crc >= 2**32:
                raise ValueError(f"bad entry for {name!r}")
            names.add(name)
            ranks.add(rank)
            files.append(FileEntry(name, size, crc, rank))
        step, attempt, ws, nbytes = doc["step"], doc["attempt"], doc["world_size"], doc["nbytes"]
        created, extra = doc["created"], doc["extra"]
        if not (_uint(step) and isinstance(attempt, str) and _uint(ws) and ws >= 1 and _uint(nbytes)):
            raise ValueError("bad header fields")
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not isinstance(extra, dict):
            raise ValueError("bad header fields")
        if step >= 2**63:
            raise ValueError(f"step {step} is beyond 2**63 - 1")
        # ranks are distinct ints >= 0: all below ws and ws of them is exactly range(ws)
        if len(ranks) != ws or max(ranks, default=-1) >= ws:
            raise ValueError(f"world_size {ws} does not match the ranks of the files listed")
        created = float(created)
        group = doc.get("ranks")  # global ranks; absent in manifests written before it was recorded
        if group is not None and not (
            isinstance(group, list) and len(group) == ws and all(_uint(r) for r in group)
        ):
            raise ValueError("bad ranks")
        run = doc.get("run")  # absent in manifests written before runs were recorded
        if run is not None and not (isinstance(run, str) and RUN_ID.match(run)):
            raise ValueError("bad run id")
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise CheckpointCorruptError(f"manifest is malformed ({e})", path) from None
    # last, as the dearest check: the bytes must be exactly what encode() writes
    if raw != json.dumps(dict(doc, checksum=seal), sort_keys=True, indent=1, ensure_ascii=True).encode() + b"\n":
        raise CheckpointCorruptError("manifest is not in canonical form", path)
    return Manifest(
        step, attempt, ws, nbytes, created, tuple(files), extra, None if group is None else tuple(group), doc["format"],
        run,
    )
