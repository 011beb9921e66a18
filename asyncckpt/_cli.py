"""The ``asyncckpt`` command line: list, inspect, verify, clean up and export checkpoints.

Run as ``asyncckpt COMMAND ...`` or ``python -m asyncckpt COMMAND ...``. Every command reads
the on-disk layout through the library's own discovery, loading and retention code, so what
the CLI calls complete is exactly what :func:`asyncckpt.find_latest` would resume from.

Exit status: 0 success, 1 a data problem (missing, incomplete or corrupt checkpoint, I/O
error), 2 a usage error. Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import concurrent.futures
import json
import math
import os
import re
import stat
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import torch

from ._checkpointer import load
from ._checksum import crc32c
from ._discovery import candidate_steps, complete_checkpoints, find_latest, open_step, read_manifest
from ._errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ._format import ST_TO_DTYPE, plan_layout
from ._header import TORCH_NAME, TensorSlot
from ._layout import parse_leftover, parse_step_dir, step_dir_name
from ._load import byte_view, open_regular, read_header, read_tree
from ._manifest import MANIFEST, Manifest, shard_name, tree_name
from ._retention import choose_victims, leftovers, retire
from ._storage import DEFAULT_OPS, Storage, remove_tree
from ._structure import MAX_DEPTH, tensor_names, unflatten

PROG = "asyncckpt"
#: Bytes read per call while verifying checksums.
_VERIFY_CHUNK = 8 * 1024 * 1024
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_RANK_FILE = re.compile(r"^rank(\d{5})\.(?:safetensors|json)$")
#: Output suffixes ``export`` understands, and the writer each one selects.
_EXPORT_SUFFIXES = (".safetensors", ".pt", ".pth")


class UsageError(Exception):
    """The command line asks for something that cannot be done as typed (exit status 2)."""


class DataError(Exception):
    """The data on disk does not allow what was asked, though it is not corrupt (exit status 1)."""


# ---------------------------------------------------------------------------- formatting


def human_bytes(n: int) -> str:
    """``n`` bytes as a short binary-unit string: ``512 B``, ``1.5 KiB``, ``12.0 MiB``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} PiB"


def human_age(seconds: float) -> str:
    """A duration as one unit, rounded down: ``42s``, ``5m``, ``3h``, ``2d`` (negative: ``0s``)."""
    s = max(0, int(seconds))
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def _short(e: CheckpointError) -> str:
    """The message of ``e`` without the trailing ``: path`` the library appends."""
    msg = str(e)
    path = getattr(e, "path", None)
    if path and msg.endswith(f": {path}"):
        msg = msg[: -len(path) - 2]
    return msg


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns separated by two spaces; the last column is not padded."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths[:-1], strict=True)] + [r[-1]]
        return "  ".join(cells).rstrip()

    return [line(header), *(line(r) for r in rows)]


def _local_time(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


class Progress:
    """A one-line byte-progress indicator redrawn in place on a terminal.

    When ``enabled`` is false every method does nothing, so callers need not check. Redraws
    at most ten times a second; :meth:`close` erases the line.
    """

    def __init__(self, stream: IO[str], total: int, enabled: bool) -> None:
        self._stream = stream
        self._total = max(total, 0)
        self._enabled = enabled
        self._done = 0
        self._label = ""
        self._t0 = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def label(self, text: str) -> None:
        """Show ``text`` in front of the bar from now on."""
        self._label = text
        self._draw(force=True)

    def advance(self, n: int) -> None:
        """Count ``n`` more bytes as done."""
        self._done += n
        self._draw(force=False)

    def _draw(self, force: bool) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1 and self._done < self._total:
            return
        self._last = now
        frac = min(1.0, self._done / self._total) if self._total else 1.0
        width = 24
        filled = int(frac * width)
        rate = self._done / max(now - self._t0, 1e-6)
        bar = "#" * filled + "-" * (width - filled)
        text = (
            f"{self._label} [{bar}] {frac * 100:5.1f}%  "
            f"{human_bytes(self._done)} / {human_bytes(self._total)}  {human_bytes(int(rate))}/s"
        )
        self._stream.write("\r\x1b[K" + text)
        self._stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Erase the progress line (if one was drawn)."""
        if self._enabled and self._drawn:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._drawn = False


# ---------------------------------------------------------------------------- scanning a root


@dataclass(frozen=True)
class StepDir:
    """One step-like directory under a root, as ``ls`` reports it.

    ``complete`` is true exactly when the library would load the step. ``problem`` is a
    stable code (``no-marker``, ``corrupt-manifest``, ``step-mismatch``, ``unexpected-file``,
    ``missing-file``, ``not-regular-file``, ``size-mismatch``, ``not-a-directory``,
    ``non-canonical-name``, ``save-leftover``, ``retire-leftover``, ``unreadable``) and
    ``reason`` its human explanation; both are ``None`` for complete steps. ``size`` and
    ``files`` count what is on disk; ``ranks`` comes from the manifest, else from the rank
    file names present (``None`` when unknown). ``modified`` is the newest mtime of the
    directory and its entries.
    """

    step: int
    name: str
    path: str
    complete: bool
    problem: str | None
    reason: str | None
    size: int
    files: int
    ranks: int | None
    created: float | None
    modified: float

    def as_json(self, now: float) -> dict[str, Any]:
        """The row as a JSON-ready dict (``age_s`` measured from ``now``)."""
        return {
            "step": self.step,
            "name": self.name,
            "path": os.path.abspath(self.path),
            "status": "complete" if self.complete else "incomplete",
            "complete": self.complete,
            "problem": self.problem,
            "reason": self.reason,
            "size": self.size,
            "files": self.files,
            "ranks": self.ranks,
            "created": self.created,
            "modified": self.modified,
            "age_s": round(now - (self.created if self.created is not None else self.modified), 3),
        }


@dataclass(frozen=True)
class _Usage:
    size: int
    files: int
    ranks: int | None
    modified: float


def _usage(path: str) -> _Usage:
    """Bytes, entry count, ranks (from rank file names) and newest mtime of ``path``; never follows links."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        return _Usage(st.st_size if stat.S_ISREG(st.st_mode) else 0, 1, None, st.st_mtime)
    size, files, newest = 0, 0, st.st_mtime
    ranks: set[int] = set()
    try:
        with os.scandir(path) as it:
            for entry in it:
                files += 1
                m = _RANK_FILE.match(entry.name)
                if m:
                    ranks.add(int(m.group(1)))
                try:
                    est = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                newest = max(newest, est.st_mtime)
                if stat.S_ISREG(est.st_mode):
                    size += est.st_size
    except OSError:
        pass
    return _Usage(size, files, len(ranks) or None, newest)


def _diagnose_files(step_dir: str, manifest: Manifest) -> tuple[str, str]:
    """Why the files of ``step_dir`` do not match ``manifest`` (same order of checks as the library)."""
    try:
        present = set(os.listdir(step_dir))
    except OSError as e:
        return "unreadable", f"cannot list the directory ({e.strerror})"
    extra = sorted(present - {f.name for f in manifest.files} - {MANIFEST})
    if extra:
        return "unexpected-file", f"unexpected file(s) not in the manifest: {', '.join(extra[:5])}"
    for f in manifest.files:
        try:
            st = os.lstat(os.path.join(step_dir, f.name))
        except OSError:
            return "missing-file", f"{f.name} is missing"
        if not stat.S_ISREG(st.st_mode):
            return "not-regular-file", f"{f.name} is not a regular file"
        if st.st_size != f.size:
            return "size-mismatch", f"size mismatch: {f.name} is {st.st_size} bytes, the manifest says {f.size}"
    return "unreadable", "the files do not match the manifest"


def _examine_committed(root: str, name: str, step: int) -> StepDir:
    """Classify a directory with a committed-looking name, using the library's own checks for the verdict."""
    path = os.path.join(root, name)
    usage = _usage(path)
    manifest: Manifest | None = None
    problem: str | None = None
    reason: str | None = None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        problem, reason = "not-a-directory", "a symbolic link (the library never follows one)"
    elif not stat.S_ISDIR(st.st_mode):
        problem, reason = "not-a-directory", "not a directory"
    elif name != step_dir_name(step):
        problem, reason = "non-canonical-name", f"not the canonical name {step_dir_name(step)}; the library ignores it"
    else:
        try:
            _, manifest = open_step(root, step)
        except CheckpointNotFoundError:
            problem, reason = "no-marker", "no completion marker (manifest.json is missing)"
        except CheckpointCorruptError as e:
            try:
                manifest = read_manifest(path)
            except CheckpointError as me:
                problem, reason = "corrupt-manifest", f"corrupt manifest: {_short(me)}"
            else:
                if manifest.step != step:
                    problem, reason = "step-mismatch", f"the manifest is for step {manifest.step}"
                else:
                    problem, reason = _diagnose_files(path, manifest)
                    if problem == "unreadable":
                        reason = _short(e)
    return StepDir(
        step=step,
        name=name,
        path=path,
        complete=problem is None,
        problem=problem,
        reason=reason,
        size=usage.size,
        files=usage.files,
        ranks=manifest.world_size if manifest is not None else usage.ranks,
        created=manifest.created if manifest is not None else None,
        modified=usage.modified,
    )


def _examine_leftover(root: str, name: str, step: int) -> StepDir:
    """Describe an in-progress (``.tmp-``) or retiring (``.deleting-``) directory."""
    path = os.path.join(root, name)
    usage = _usage(path)
    if ".tmp-" in name:
        problem, reason = "save-leftover", "leftover of a crashed save attempt (or a save still in progress)"
    else:
        problem, reason = "retire-leftover", "leftover of an interrupted retirement (being deleted)"
    return StepDir(step, name, path, False, problem, reason, usage.size, usage.files, usage.ranks, None, usage.modified)


def scan_root(root: str) -> list[StepDir]:
    """Every step directory under ``root``: complete, incomplete and leftovers, oldest step first.

    Entries that are not step-like are ignored. Raises ``CheckpointNotFoundError`` if
    ``root`` is not a directory.
    """
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointNotFoundError(f"{root} is not a directory") from None
    out: list[StepDir] = []
    for name in names:
        try:
            step = parse_step_dir(name)
            if step is not None:
                out.append(_examine_committed(root, name, step))
                continue
            step = parse_leftover(name)
            if step is not None:
                out.append(_examine_leftover(root, name, step))
        except FileNotFoundError:
            continue  # removed while we looked
    out.sort(key=lambda d: (d.step, d.complete, d.modified, d.name))
    return out


def _require_dir(root: str) -> str:
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"{root} is not a directory")
    return root


def _resolve_step(root: str, step: int | None) -> tuple[str, Manifest]:
    """The directory and manifest of ``step``, or of the newest complete checkpoint when ``None``."""
    _require_dir(root)
    if step is None:
        info = find_latest(root)
        if info is None:
            raise CheckpointNotFoundError(f"no complete checkpoint under {root}")
        step = info.step
    return open_step(root, step)


def _check_rank(manifest: Manifest, rank: int) -> None:
    if rank >= manifest.world_size:
        raise CheckpointNotFoundError(
            f"step {manifest.step} was saved by {manifest.world_size} rank(s); there is no rank {rank}"
        )


# ---------------------------------------------------------------------------- ls


def cmd_ls(args: argparse.Namespace) -> int:
    """Print one row per step directory (newest last); ``--json`` prints a JSON list."""
    root: str = args.root
    dirs = scan_root(root)
    now = time.time()
    if args.json:
        print(json.dumps([d.as_json(now) for d in dirs], indent=2))
        return 0
    if not dirs:
        print(f"{PROG}: no step directories under {root}", file=sys.stderr)
        return 0
    rows = []
    for d in dirs:
        age = now - (d.created if d.created is not None else d.modified)
        rows.append(
            [
                str(d.step),
                "complete" if d.complete else "incomplete",
                human_bytes(d.size),
                str(d.files),
                "?" if d.ranks is None else str(d.ranks),
                human_age(age),
                d.name,
                d.reason or "",
            ]
        )
    for line in _table(["STEP", "STATUS", "SIZE", "FILES", "RANKS", "AGE", "DIRECTORY", "NOTE"], rows):
        print(line)
    return 0


# ---------------------------------------------------------------------------- info


def read_slots(path: str, size: int) -> dict[str, TensorSlot]:
    """The tensors a safetensors shard of ``size`` bytes declares, from its header alone.

    Raises ``CheckpointCorruptError`` naming ``path`` if the header is unreadable or does
    not tile the data section exactly.
    """
    fd = open_regular(path, size)
    try:
        _, _, slots, _ = read_header(fd, path, size)
        return {s.name: s for s in slots}
    except OSError as e:
        raise CheckpointCorruptError(f"cannot read shard ({e.strerror})", path) from None
    finally:
        os.close(fd)


def _listed(step_dir: str, manifest: Manifest, name: str) -> tuple[str, int, int]:
    """Path, size and CRC of ``name`` as the manifest lists it (corrupt if it does not)."""
    try:
        f = manifest.file(name)
    except CheckpointCorruptError:
        raise CheckpointCorruptError(f"manifest does not list {name}", os.path.join(step_dir, MANIFEST)) from None
    return os.path.join(step_dir, f.name), f.size, f.crc32c


def read_rank_outline(step_dir: str, manifest: Manifest, rank: int) -> tuple[Any, dict[str, TensorSlot]]:
    """Rank ``rank``'s structure tree (checksum verified) and its shard's tensor slots.

    Reads only the small structure file and the shard header, never the tensor data.
    Raises ``CheckpointCorruptError`` if they disagree on the tensor names.
    """
    tree_path, tree_size, tree_crc = _listed(step_dir, manifest, tree_name(rank))
    shard_path, shard_size, _ = _listed(step_dir, manifest, shard_name(rank))
    tree = read_tree(tree_path, tree_size, tree_crc)
    slots = read_slots(shard_path, shard_size)
    if sorted(tensor_names(tree)) != sorted(slots):
        raise CheckpointCorruptError("structure and shard disagree on tensor names", shard_path)
    return tree, slots


def _key_label(key: Any) -> str:
    if isinstance(key, str) and key and key.isprintable() and key == key.strip():
        return key
    return repr(key)


def _value_repr(v: Any, limit: int = 72) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


@dataclass(frozen=True)
class Entry:
    """One line of ``info``: a key path and what is stored there.

    ``kind`` is ``tensor`` (``dtype``/``shape``/``nbytes`` set), ``value`` (``value`` set),
    ``bytes`` (``nbytes`` set), or ``dict``/``list``/``tuple`` (``length`` set).
    """

    path: tuple[str | int, ...]
    depth: int
    label: str
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    nbytes: int | None = None
    value: Any = None
    length: int | None = None

    def describe(self) -> str:
        """The right-hand column of the text view."""
        if self.kind == "tensor":
            return f"{self.dtype} {list(self.shape or ())}  {human_bytes(self.nbytes or 0)}"
        if self.kind == "bytes":
            return f"bytes ({human_bytes(self.nbytes or 0)})"
        if self.kind == "value":
            return _value_repr(self.value)
        if self.length == 0:
            return f"{self.kind} (empty)"
        unit = "key" if self.kind == "dict" else "item"
        return f"{self.kind} ({self.length} {unit}{'s' if self.length != 1 else ''})"

    def as_json(self) -> dict[str, Any]:
        """The entry as a JSON-ready dict (non-finite floats become strings)."""
        out: dict[str, Any] = {"path": list(self.path), "kind": self.kind}
        if self.kind == "tensor":
            out.update(dtype=self.dtype, shape=list(self.shape or ()), nbytes=self.nbytes)
        elif self.kind == "bytes":
            out["nbytes"] = self.nbytes
        elif self.kind == "value":
            v = self.value
            out["type"] = type(v).__name__
            out["value"] = repr(v) if isinstance(v, float) and not math.isfinite(v) else v
        else:
            out["length"] = self.length
        return out


#: Tags of single values (see asyncckpt._structure), shown as their tag and JSON.
_VALUE_TAGS = frozenset(
    "$np $complex $bytearray $size $dtype $device $generator $path $date $timedelta $datetime".split()
)


def outline(tree: Any, slots: dict[str, TensorSlot]) -> list[Entry]:
    """Walk a structure tree depth-first into :class:`Entry` lines, in saved order.

    A dict at the top level is shown by its keys (no line for the root itself). Raises
    ``CheckpointCorruptError`` on a malformed node.
    """
    out: list[Entry] = []

    def walk(node: Any, path: tuple[str | int, ...], label: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise CheckpointCorruptError(f"structure nested deeper than {MAX_DEPTH} levels")
        children: list[tuple[str | int, str, Any]] | None = None
        kind = ""
        if node is None or isinstance(node, (bool, int, float, str)):
            out.append(Entry(path, depth, label, "value", value=node))
            return
        if isinstance(node, list):
            kind, children = "list", [(i, f"[{i}]", v) for i, v in enumerate(node)]
        elif isinstance(node, dict) and len(node) == 1:
            ((tag, val),) = node.items()
            if tag == "$dict" and isinstance(val, list):
                kind, children = "dict", []
                for item in val:
                    if not (
                        isinstance(item, list)
                        and len(item) == 2
                        and isinstance(item[0], (str, int))
                        and not isinstance(item[0], bool)
                    ):
                        raise CheckpointCorruptError("malformed $dict item in the structure")
                    children.append((item[0], _key_label(item[0]), item[1]))
            elif tag in ("$odict", "$defaultdict") and isinstance(val, list) and len(val) == 2:
                return walk({"$dict": val[0] if tag == "$odict" else val[1]}, path, label, depth)
            elif tag == "$tuple" and isinstance(val, list):
                kind, children = "tuple", [(i, f"[{i}]", v) for i, v in enumerate(val)]
            elif tag in ("$set", "$frozenset") and isinstance(val, list):
                kind, children = tag[1:], [(i, f"[{i}]", v) for i, v in enumerate(val)]
            elif tag == "$param" and isinstance(val, list) and len(val) == 2:
                return walk(val[0], path, label, depth)
            elif (
                tag == "$ndarray"
                and isinstance(val, list)
                and len(val) == 3
                and isinstance(val[0], str)
                and val[0] in slots
                and isinstance(val[2], list)
            ):
                s = slots[val[0]]
                out.append(Entry(path, depth, label, "tensor", f"numpy.{val[1]}", tuple(val[2]), s.end - s.begin))
                return
            elif tag in _VALUE_TAGS:
                # numpy scalars, complex, torch.Size/dtype/device/Generator, paths, datetimes
                out.append(Entry(path, depth, label, "value", value=f"{tag[1:]}({json.dumps(val)[:200]})"))
                return
            elif tag == "$tensor" and isinstance(val, str) and val in slots:
                s = slots[val]
                out.append(Entry(path, depth, label, "tensor", TORCH_NAME[s.dtype], s.shape, s.end - s.begin))
                return
            elif tag == "$float" and val in ("nan", "inf", "-inf"):
                out.append(Entry(path, depth, label, "value", value=float(val)))
                return
            elif tag == "$bytes" and isinstance(val, str):
                try:
                    n = len(base64.b64decode(val.encode("ascii"), validate=True))
                except (ValueError, binascii.Error):
                    raise CheckpointCorruptError("malformed $bytes in the structure") from None
                out.append(Entry(path, depth, label, "bytes", nbytes=n))
                return
        if children is None:
            raise CheckpointCorruptError(f"malformed node in the structure at {'.'.join(map(str, path)) or '<root>'}")
        if depth >= 0:
            out.append(Entry(path, depth, label, kind, length=len(children)))
        for key, child_label, child in children:
            walk(child, (*path, key), child_label, depth + 1)

    is_root_dict = isinstance(tree, dict) and len(tree) == 1 and "$dict" in tree
    walk(tree, (), "<root>", -1 if is_root_dict else 0)
    return out


def cmd_info(args: argparse.Namespace) -> int:
    """Print the saved keys of one rank of one step: tensors with dtype/shape/bytes, other values as saved."""
    step_dir, manifest = _resolve_step(args.root, args.step)
    _check_rank(manifest, args.rank)
    tree, slots = read_rank_outline(step_dir, manifest, args.rank)
    entries = outline(tree, slots)
    rank_bytes = sum(s.end - s.begin for s in slots.values())
    if args.json:
        doc = {
            "step": manifest.step,
            "path": os.path.abspath(step_dir),
            "rank": args.rank,
            "world_size": manifest.world_size,
            "created": manifest.created,
            "nbytes": manifest.nbytes,
            "rank_nbytes": rank_bytes,
            "tensors": len(slots),
            "extra": manifest.extra,
            "entries": [e.as_json() for e in entries],
        }
        print(json.dumps(doc, indent=2))
        return 0
    print(f"step {manifest.step}  {os.path.abspath(step_dir)}")
    print(f"created {_local_time(manifest.created)} ({human_age(time.time() - manifest.created)} ago)")
    print(
        f"rank {args.rank} of {manifest.world_size}: {len(slots)} tensor(s), {human_bytes(rank_bytes)}"
        f" (all ranks: {human_bytes(manifest.nbytes)})"
    )
    if manifest.extra:
        print(f"extra {json.dumps(manifest.extra, sort_keys=True)}")
    print()
    labels = ["  " * e.depth + e.label for e in entries]
    width = min(max((len(label) for label in labels), default=0), 56)
    for label, e in zip(labels, entries, strict=True):
        print(f"{label.ljust(width)}  {e.describe()}".rstrip())
    return 0


# ---------------------------------------------------------------------------- verify


def file_crc(path: str, size: int, progress: Progress) -> int:
    """CRC-32C of the regular file ``path``, which must be ``size`` bytes, read in bounded chunks.

    Raises ``CheckpointCorruptError`` naming ``path`` if it cannot be read in full.
    """
    fd = open_regular(path, size)
    try:
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass  # only a hint
        buf = memoryview(bytearray(min(_VERIFY_CHUNK, max(size, 1))))
        crc, off = 0, 0
        while off < size:
            n = os.preadv(fd, [buf[: min(len(buf), size - off)]], off)
            if n <= 0:
                raise CheckpointCorruptError("file ended early", path)
            crc = crc32c(buf[:n], crc)
            off += n
            progress.advance(n)
        return crc
    except OSError as e:
        raise CheckpointCorruptError(f"cannot read ({e.strerror})", path) from None
    finally:
        os.close(fd)


def verify_step(step_dir: str, manifest: Manifest, progress: Progress) -> list[str]:
    """Recompute every file's CRC-32C and check each rank would load; return the problems found.

    Each problem is one line naming the offending file. Tensor data is streamed, never held
    in memory. An empty list means ``load()`` of any rank of this step would succeed.
    """
    problems: list[str] = []
    for f in manifest.files:
        path = os.path.join(step_dir, f.name)
        try:
            if file_crc(path, f.size, progress) != f.crc32c:
                problems.append(f"checksum mismatch: {path}")
        except CheckpointCorruptError as e:
            problems.append(str(e))
    if problems:
        return problems
    total = 0
    for rank in range(manifest.world_size):
        try:
            tree, slots = read_rank_outline(step_dir, manifest, rank)
            total += sum(s.end - s.begin for s in slots.values())
            meta = {n: torch.empty(s.shape, dtype=ST_TO_DTYPE[s.dtype], device="meta") for n, s in slots.items()}
            unflatten(tree, meta)
        except CheckpointCorruptError as e:
            problems.append(str(e))
        except (ValueError, TypeError, RecursionError) as e:
            problems.append(f"malformed structure ({e}): {os.path.join(step_dir, tree_name(rank))}")
    if not problems and total != manifest.nbytes:
        problems.append(
            f"shards hold {total} tensor bytes, the manifest says {manifest.nbytes}: {os.path.join(step_dir, MANIFEST)}"
        )
    return problems


def cmd_verify(args: argparse.Namespace) -> int:
    """Verify the chosen steps; print one ``ok`` line per good step, one error line per problem."""
    root = _require_dir(args.root)
    if args.all:
        steps = candidate_steps(root)
        if not steps:
            raise CheckpointNotFoundError(f"no checkpoints under {root}")
    elif args.step is not None:
        steps = [args.step]
    else:
        latest = find_latest(root)
        if latest is None:
            raise CheckpointNotFoundError(f"no complete checkpoint under {root}")
        steps = [latest.step]
        newer = [s for s in candidate_steps(root) if s > latest.step]
        if newer:
            print(
                f"{PROG}: note: {len(newer)} newer step director{'ies are' if len(newer) > 1 else 'y is'} incomplete "
                f"(step {', '.join(map(str, newer[:5]))}); verifying step {latest.step}, the newest complete one",
                file=sys.stderr,
            )
    failed = 0
    opened: list[tuple[str, Manifest]] = []
    for step in steps:
        try:
            opened.append(open_step(root, step))
        except CheckpointError as e:
            failed += 1
            what = "incomplete" if os.path.lexists(os.path.join(root, step_dir_name(step))) else "not found"
            print(f"{PROG}: step {step}: {what}: {e}", file=sys.stderr)
    progress = Progress(sys.stderr, sum(f.size for _, m in opened for f in m.files), sys.stderr.isatty())
    try:
        for step_dir, manifest in opened:
            progress.label(f"verifying step {manifest.step}")
            problems = verify_step(step_dir, manifest, progress)
            progress.close()
            if problems:
                failed += 1
                for p in problems:
                    print(f"{PROG}: step {manifest.step}: corrupt: {p}", file=sys.stderr)
            else:
                size = sum(f.size for f in manifest.files)
                print(f"step {manifest.step}: ok ({len(manifest.files)} files, {human_bytes(size)} verified)")
    finally:
        progress.close()
    if len(steps) > 1:
        print(f"{len(steps) - failed} of {len(steps)} checkpoints ok")
    return 1 if failed else 0


# ---------------------------------------------------------------------------- gc


def _retire(root: str, keep_last: int) -> list[int]:
    """Run the library's own retention (rename to ``.deleting-``, fsync the root, remove)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-gc") as pool:
        return asyncio.run(retire(Storage(pool), root, keep_last))


def cmd_gc(args: argparse.Namespace) -> int:
    """Remove old leftovers and, with ``--keep-last``, complete checkpoints beyond the newest N.

    Leftovers modified within ``--min-age`` seconds are kept (a save may still be writing
    them). Incomplete directories with a committed name are never removed, only reported.
    ``--dry-run`` prints what would happen and changes nothing.
    """
    root = _require_dir(args.root)
    dry: bool = args.dry_run
    verb = "would remove" if dry else "removed"
    now = time.time()
    freed = 0
    for path in leftovers(root):
        name = os.path.basename(path)
        try:
            usage = _usage(path)
        except FileNotFoundError:
            continue
        age = now - usage.modified
        if age < args.min_age:
            print(
                f"kept {name}: modified {human_age(age)} ago, a save may still be writing it "
                f"(--min-age {args.min_age:g}s; pass --min-age 0 to remove it)"
            )
            continue
        what = "crashed save attempt" if ".tmp-" in name else "interrupted retirement"
        if not dry:
            try:
                remove_tree(path, DEFAULT_OPS)
            except FileNotFoundError:
                pass  # removed concurrently (by the library's own clean-up): fine
        print(f"{verb} {name} (leftover of a {what}, {human_bytes(usage.size)})")
        freed += usage.size
    if args.keep_last is not None:
        infos = complete_checkpoints(root)
        sizes = {}
        for i in infos:
            try:
                sizes[i.step] = _usage(str(i.path)).size
            except FileNotFoundError:
                sizes[i.step] = 0
        victims = choose_victims([i.step for i in infos], args.keep_last) if dry else _retire(root, args.keep_last)
        for step in victims:
            print(f"{'would retire' if dry else 'retired'} step {step} ({human_bytes(sizes.get(step, 0))})")
            freed += sizes.get(step, 0)
        kept = [i.step for i in infos if i.step not in victims]
        if kept:
            print(f"keeping {len(kept)} complete checkpoint(s): step {', '.join(map(str, kept))}")
    for d in scan_root(root):
        if not d.complete and d.problem not in ("save-leftover", "retire-leftover"):
            print(f"left alone {d.name}: incomplete, {d.reason}; inspect it and remove it by hand if unwanted")
    print(f"{'would free' if dry else 'freed'} {human_bytes(freed)}")
    return 0


# ---------------------------------------------------------------------------- export


def named_tensors(state: Any) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """Flatten a loaded state into ``(dotted name, tensor)`` pairs in saved order.

    Names join dict keys and list/tuple indices with ``.`` exactly as they were (a key
    ``"layer.weight"`` under ``"model"`` gives ``model.layer.weight``). Also returns the
    names of the non-tensor values that were skipped.
    """
    tensors: list[tuple[str, torch.Tensor]] = []
    skipped: list[str] = []

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, torch.Tensor):
            tensors.append((".".join(path) if path else "_", node))
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, str(k)))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, (*path, str(i)))
        else:
            skipped.append(".".join(path) if path else "_")

    walk(state, ())
    return tensors, skipped


def select_key(tensors: list[tuple[str, torch.Tensor]], key: str | None) -> dict[str, torch.Tensor]:
    """The tensors under dotted prefix ``key`` with the prefix stripped (all of them when ``None``).

    Raises ``CheckpointNotFoundError`` when nothing lies under ``key``, ``UsageError`` when
    ``key`` names one tensor rather than a subtree, and ``DataError`` when two tensors end
    up with the same name.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        if key is None:
            new = name
        elif name.startswith(key + "."):
            new = name[len(key) + 1 :]
        elif name == key:
            raise UsageError(f"--key {key} names a single tensor, not a subtree; use its parent key")
        else:
            continue
        if new in out:
            raise DataError(f"two tensors would both be named {new!r} in the exported file")
        out[new] = t
    if not out:
        tops = sorted({n.split(".", 1)[0] for n, _ in tensors})
        hint = f" (top-level keys with tensors: {', '.join(tops[:10])})" if tops else ""
        raise CheckpointNotFoundError(f"no tensors under key {key!r}{hint}")
    return out


def write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` as one safetensors file (``format: pt`` metadata) at ``path``, fsynced."""
    layout = plan_layout([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], {"format": "pt"})
    with open(path, "xb") as f:
        f.write(layout.header)
        for s in layout.slots:
            f.write(byte_view(tensors[s.name].detach().cpu().contiguous()))
        f.flush()
        if f.tell() != layout.file_size:
            raise OSError(f"wrote {f.tell()} bytes, expected {layout.file_size}")
        os.fsync(f.fileno())


def write_torch(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """``torch.save`` the flat dict ``tensors`` to ``path`` (loadable with ``weights_only=True``), fsynced."""
    with open(path, "xb") as f:
        torch.save({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, f)
        f.flush()
        os.fsync(f.fileno())


def _atomic_write(dest: str, writer: Callable[[str], None], force: bool) -> None:
    """Have ``writer`` fill a temporary file beside ``dest``, then rename it into place.

    A crash never leaves a partial file under ``dest``. Without ``force`` an existing
    ``dest`` is a usage error.
    """
    if os.path.lexists(dest) and not force:
        raise UsageError(f"{dest} already exists (pass --force to overwrite it)")
    parent = os.path.dirname(os.path.abspath(dest))
    tmp = os.path.join(parent, f".{os.path.basename(dest)}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        writer(tmp)
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    DEFAULT_OPS.fsync_dir(parent)


def cmd_export(args: argparse.Namespace) -> int:
    """Write one rank's tensors (or those under ``--key``) of a step as a flat name→tensor file."""
    dest: str = args.to
    if os.path.lexists(dest) and not args.force:
        raise UsageError(f"{dest} already exists (pass --force to overwrite it)")
    parent = os.path.realpath(os.path.dirname(os.path.abspath(dest)))
    inside = os.path.basename(parent)
    if os.path.dirname(parent) == os.path.realpath(args.root) and (
        parse_step_dir(inside) is not None or parse_leftover(inside) is not None
    ):
        raise UsageError(f"refusing to write into {inside}: an extra file there makes the checkpoint incomplete")
    _, manifest = _resolve_step(args.root, args.step)
    _check_rank(manifest, args.rank)
    state = load(args.root, manifest.step, rank=args.rank, verify=True)
    pairs, skipped = named_tensors(state)
    tensors = select_key(pairs, args.key)
    if args.key is not None:
        skipped = [s for s in skipped if s.startswith(args.key + ".")]
    writer = write_safetensors if dest.lower().endswith(".safetensors") else write_torch
    _atomic_write(dest, lambda p: writer(p, tensors), args.force)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    where = f" under {args.key!r}" if args.key is not None else ""
    print(
        f"wrote {len(tensors)} tensor(s){where}, {human_bytes(nbytes)}, of step {manifest.step} rank {args.rank} "
        f"to {dest}"
    )
    if skipped:
        shown = ", ".join(skipped[:5]) + (", ..." if len(skipped) > 5 else "")
        print(f"{PROG}: note: skipped {len(skipped)} non-tensor value(s): {shown}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------- argument parsing


def _non_negative_int(text: str) -> int:
    try:
        v = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return v


def _positive_int(text: str) -> int:
    v = _non_negative_int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not v >= 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"expected a non-negative number of seconds, got {text!r}")
    return v


def _export_path(text: str) -> str:
    if not text.lower().endswith(_EXPORT_SUFFIXES):
        raise argparse.ArgumentTypeError(f"{text!r} must end in .safetensors, .pt or .pth")
    return text


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``asyncckpt`` command (each subcommand sets ``func``)."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=_Formatter,
        description="Inspect, verify, clean up and export asyncckpt checkpoints.",
        epilog=(
            "exit status: 0 ok, 1 missing/incomplete/corrupt data or I/O error, 2 usage error\n\n"
            "examples:\n"
            "  asyncckpt ls ckpt/\n"
            "  asyncckpt verify ckpt/ --all\n"
            "  asyncckpt export ckpt/ --step 300 --key model --to model.safetensors\n\n"
            "run 'asyncckpt COMMAND --help' for the options of a command"
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, description: str, examples: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=summary,
            description=description,
            epilog="examples:\n" + examples,
            formatter_class=_Formatter,
        )
        p.add_argument("root", metavar="ROOT", help="the checkpoint root directory (holds step_NNNNNNNN/)")
        return p

    p = command(
        "ls",
        "list every step directory, complete or not",
        "List every step directory under ROOT, oldest first: complete checkpoints, incomplete\n"
        "ones (and why: no completion marker, corrupt manifest, size mismatch, ...) and leftovers\n"
        "of crashed save attempts or interrupted retirements, with their size, file count,\n"
        "ranks and age. 'complete' means exactly what load() would accept.",
        "  asyncckpt ls ckpt/\n  asyncckpt ls ckpt/ --json | jq '.[] | select(.complete) | .step'",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=cmd_ls)

    p = command(
        "info",
        "show the saved keys of a checkpoint",
        "Show the tree of keys one rank saved in a step: every tensor with its dtype, shape and\n"
        "size, and every other value (numbers, strings, ...) as saved. Reads only the structure\n"
        "file and the shard header, not the tensor data (use 'verify' to check the data).",
        "  asyncckpt info ckpt/                  # newest complete step, rank 0\n"
        "  asyncckpt info ckpt/ --step 300 --rank 3\n"
        "  asyncckpt info ckpt/ --json",
    )
    p.add_argument("--step", type=_non_negative_int, metavar="N", help="the step (default: newest complete)")
    p.add_argument("--rank", type=_non_negative_int, default=0, metavar="R", help="the rank to show (default: 0)")
    p.add_argument("--json", action="store_true", help="print JSON: one entry per key path")
    p.set_defaults(func=cmd_info)

    p = command(
        "verify",
        "recompute every checksum",
        "Recompute the CRC-32C of every file of a checkpoint and check every rank's structure\n"
        "and shard header agree, streaming the data (memory use stays small). Shows a progress\n"
        "bar on a terminal. Exits 0 when valid, 1 when a checkpoint is incomplete or corrupt\n"
        "(naming the file).",
        "  asyncckpt verify ckpt/                # the newest complete step (what load() resumes from)\n"
        "  asyncckpt verify ckpt/ --step 300\n"
        "  asyncckpt verify ckpt/ --all          # every step directory with a committed name",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=_non_negative_int, metavar="N", help="verify this step")
    which.add_argument("--all", action="store_true", help="verify every step directory")
    p.set_defaults(func=cmd_verify)

    p = command(
        "gc",
        "remove leftovers and old checkpoints",
        "Remove leftovers of crashed save attempts and interrupted retirements and, with\n"
        "--keep-last N, retire complete checkpoints beyond the newest N, under the library's own\n"
        "retention rules: only complete checkpoints count, the newest complete one is never\n"
        "removed, and a checkpoint is renamed out of the way (atomically, root fsynced) before\n"
        "its files are deleted. Leftovers modified within --min-age are kept, because a running\n"
        "job may still be writing them. Incomplete directories with a committed name are only\n"
        "reported, never removed.",
        "  asyncckpt gc ckpt/ --dry-run\n  asyncckpt gc ckpt/ --keep-last 3\n  asyncckpt gc ckpt/ --min-age 0",
    )
    p.add_argument("--keep-last", type=_positive_int, metavar="N", help="keep only the newest N complete checkpoints")
    p.add_argument(
        "--min-age",
        type=_seconds,
        default=3600.0,
        metavar="SECONDS",
        help="only remove leftovers not modified for this long (default: 3600)",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    p.set_defaults(func=cmd_gc)

    p = command(
        "export",
        "write one rank's tensors to a single .safetensors or .pt file",
        "Write the tensors of one rank (default 0) of a step as one flat name->tensor file for\n"
        "other tools: .safetensors (read by safetensors.torch.load_file and Hugging Face loaders)\n"
        "or .pt/.pth (a torch.save of the dict, loadable with torch.load(weights_only=True)).\n"
        "Names are the dotted key paths; --key keeps only the subtree under a key and strips\n"
        "that prefix (model.layer.weight becomes layer.weight). Non-tensor values are skipped.\n"
        "The data is verified while it is read; the output is written atomically.",
        "  asyncckpt export ckpt/ --step 300 --to all.safetensors\n"
        "  asyncckpt export ckpt/ --step 300 --key model --to model.safetensors\n"
        "  asyncckpt export ckpt/ --step 300 --key model --to model.pt",
    )
    p.add_argument("--step", type=_non_negative_int, required=True, metavar="N", help="the step to export")
    p.add_argument("--key", metavar="KEY", help="export only the subtree under this dotted key, prefix stripped")
    p.add_argument("--rank", type=_non_negative_int, default=0, metavar="R", help="the rank to export (default: 0)")
    p.add_argument(
        "--to", type=_export_path, required=True, metavar="OUT", help="output file: *.safetensors, *.pt or *.pth"
    )
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.set_defaults(func=cmd_export)
    return parser


def _error(command: str | None, message: str) -> None:
    print(f"{PROG}{' ' + command if command else ''}: error: {message}", file=sys.stderr)


def _oserror_text(e: OSError) -> str:
    if e.strerror and e.filename is not None:
        return f"{e.strerror}: {e.filename}"
    return str(e) or type(e).__name__


def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    return e.code if isinstance(e.code, int) else 2


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``) and return the exit status.

    Never raises for expected failures: usage errors return 2, data and I/O errors return 1,
    each after one line on stderr.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error argparse already printed
        return _exit_status(e)
    command: str = args.command
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except UsageError as e:
        _error(command, str(e))
        return 2
    except (CheckpointError, DataError) as e:
        _error(command, str(e))
        return 1
    except BrokenPipeError:
        # the reader went away (``asyncckpt ls | head``): stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 141
    except OSError as e:
        _error(command, _oserror_text(e))
        return 1
    except KeyboardInterrupt:
        _error(command, "interrupted")
        return 130
