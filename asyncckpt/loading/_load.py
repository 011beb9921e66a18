"""Loading: read one rank's shard back, verify it, rebuild the state, restore in place.

Nothing here unpickles. Every byte read is bounded by the sizes the manifest recorded and
the file actually has, and by the limits of ``_bounds`` checked before anything is parsed or
allocated; every defect becomes ``CheckpointCorruptError`` naming the file, an I/O fault of
the storage ``CheckpointReadError`` naming it (``_readfault``: not damage), and a state too
large for this machine's memory a ``CheckpointError`` saying how much it needs. Reads are
parallel (``_readinto``). :func:`load_files` reads a step's ``StepFiles``: the step a root
holds open (``Root.open_reader``), so a checkpoint retired meanwhile is reported as gone, not
as corrupt.

Where the bytes land. With ``load(into=)``, ``_targets.plan_targets`` finds the target
tensors that take a saved tensor as it is (same dtype and shape, CPU or CUDA) and the shard
is read straight into them; the other saved tensors go to fresh tensors, restored by
``_targets.restore_into`` as before. Peak extra memory: the I/O threads' bounce buffers, plus
the fresh tensors.

The contract on damage. By default the read is one pass: every piece lands in its target
and is checksummed there, on the thread that read it, while it is still in cache; a
checkpoint that then fails verification raises ``CheckpointCorruptError`` with the targets
partly overwritten. That is safe for ``load(step=None)``: its fallback loads an older step
over the same targets, and restoring is strict (every target key must be in the step, with
its shape), so a fallback that succeeds rewrote every target. With ``verify_first`` a
checkpoint that fails verification writes no target: the first pass reads the fresh
tensors' bytes into them and only checksums the targets' bytes through the bounce buffers
(leaving the pages in the page cache); only when the whole file verified does the second
pass read the targets' bytes into the targets, from the page cache. Its price is that
second, in-memory pass (and a shard larger than the page cache is read from disk twice).
``verify=False`` is one pass without checksums.

Lazy loads (``load(..., mmap=True)``, :func:`map_shard`): the tensors are views of a private
(copy-on-write) mapping of the shard, so nothing is copied and the pages are read when first
touched; writes to them stay in this process, never reach the file. With ``verify`` the
whole shard's CRC-32C is checked once, up front, through the I/O threads' bounce buffers
(the pages pass through the page cache, nothing is kept: no copy of the state in memory);
``verify=False`` skips it and reads nothing. The mapping holds the file's inode, so the
tensors stay valid after retention removes the step.
"""

from __future__ import annotations

import contextlib
import mmap as _mmap
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from .._errors import CheckpointCorruptError, CheckpointError
from ..format._bounds import check_memory, check_structure_size, human, parse_structure
from ..format._checksum import crc32c, crc32c_combine
from ..format._gcpause import paused_gc
from ..format._header import TensorSlot, declared_length, parse_slots
from ..format._manifest import MANIFEST, Manifest, shard_name, tree_name
from ..format._safetensors import ST_TO_DTYPE
from ..format._structure_decode import unflatten
from ..roots._readfault import read_error, regular_file
from ..roots.posix._discovery import read_regular_file
from . import _readinto
from ._stepfiles import StepFiles
from ._targets import plan_targets, unflatten_named

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def open_regular(path: str, size: int) -> int:
    """Open ``path`` for reading, refusing symlinks, FIFOs and anything but a regular file of
    exactly ``size`` bytes (``CheckpointCorruptError`` naming the path; an I/O fault is
    ``CheckpointReadError``)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise read_error(e, "cannot open", path) from None
    return regular_file(fd, size, path)


def read_header(fd: _readinto.Source, path: str, size: int) -> tuple[bytes, int, list[TensorSlot], dict[str, Any]]:
    """Read and validate a shard's header: its raw bytes, the data offset, its slots, and the
    header's ``__metadata__`` entry alone as a dict (``{}`` without one): the parsed entries,
    ~0.5 KB a tensor, die here instead of living through the load."""
    try:
        if size < 8:
            raise ValueError(f"a file of {size} bytes has no header length")
        prefix = _readinto.pread(fd, 8, 0, path)
        n = declared_length(prefix, size, path)
        head = prefix + _readinto.pread(fd, n, 8, path)
        data_start = 8 + n
        if data_start % 8:
            raise ValueError("data section is not 8-byte aligned")
        _, header, slots = parse_slots(head, size, path)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointCorruptError(f"bad safetensors header ({e})", path) from None
    return head, data_start, slots, header


def read_shard(path: str, size: int, expected_crc: int | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a safetensors shard of ``size`` bytes; return its tensors and header metadata.

    Verifies the CRC-32C of the whole file when ``expected_crc`` is given.
    """
    fd = open_regular(path, size)
    try:
        return read_shard_fd(fd, path, size, expected_crc)
    finally:
        os.close(fd)


def _allocate(slots: list[TensorSlot], need: int, path: str) -> dict[str, torch.Tensor]:
    check_memory(need, f"loading {len(slots)} tensors", path)
    try:
        return {s.name: torch.empty(s.shape, dtype=ST_TO_DTYPE[s.dtype]) for s in slots}
    except (RuntimeError, MemoryError) as e:  # the allocator refused after all
        raise CheckpointError(f"loading the shard needs {human(need)} of memory ({type(e).__name__}): {path}") from None


Header = tuple[bytes, int, list[TensorSlot], dict[str, Any]]


def read_shard_fd(
    fd: _readinto.Source,
    path: str,
    size: int,
    expected_crc: int | None,
    targets: Mapping[str, torch.Tensor] | None = None,
    parsed: Header | None = None,
    verify_first: bool = False,
    before_read: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """:func:`read_shard` on an open file (the caller closes it).

    ``targets`` (from :func:`plan_targets`) names tensors to read straight into instead of
    fresh ones; they come back in the result, checksummed as their bytes land (partly
    written if the file then fails). With ``verify_first`` and a checksum to verify, no
    target is written before the whole file verified: the first pass reads the fresh tensors
    and only checksums the targets' bytes, the second reads those bytes into the targets.
    ``parsed``: :func:`read_header`'s result for this file, if the caller has it.
    ``before_read`` is called with every tensor the result holds (the fresh ones and the
    targets, by name) once they exist and before any byte is read into them.
    """
    targets = targets or {}
    try:
        head, data_start, slots, header = parsed or read_header(fd, path, size)
        ordered: list[TensorSlot] = sorted(slots, key=lambda s: s.begin)
        fresh = [s for s in ordered if s.name not in targets]
        with paused_gc():  # a tensor, a view and a destination per saved tensor
            tensors = _allocate(fresh, sum(s.end - s.begin for s in fresh), path)
            if before_read is not None:
                before_read({**tensors, **targets})
            guard = expected_crc is not None and verify_first
            first, into = _destinations(ordered, data_start, tensors, targets, guard)
        crc = _readinto.read_into(fd, path, first, checksum=expected_crc is not None)
        if expected_crc is not None:
            if crc32c_combine(crc32c(head), crc, size - data_start) != expected_crc:
                raise CheckpointCorruptError("checksum mismatch", path)
            if into:  # verified: now the targets, from the page cache the first pass filled
                try:
                    _readinto.read_into(fd, path, into, checksum=False)
                except OSError as e:
                    raise _noted(unreadable(e, "shard", path), AFTER_VERIFY_NOTE) from None
        tensors.update(targets)
        meta = header.get("__metadata__", {})
        return tensors, meta
    except OSError as e:
        raise unreadable(e, "shard", path) from None
    except MemoryError:
        raise CheckpointError(f"not enough memory to read the shard: {path}") from None


def _destinations(
    ordered: list[TensorSlot],
    data_start: int,
    tensors: Mapping[str, torch.Tensor],
    targets: Mapping[str, torch.Tensor],
    guard: bool,
) -> tuple[list[_readinto.Dest], list[_readinto.Dest]]:
    """Where each slot's bytes go: ``first`` covers the file (fresh tensors, the targets, or
    with ``guard`` only a checksum of the targets' bytes), ``into`` the targets' second pass."""
    first: list[_readinto.Dest] = []  # everything; with guard, the targets' bytes only checksummed
    into: list[_readinto.Dest] = []  # the targets' bytes, once the whole file verified
    for s in ordered:
        offset, nbytes = data_start + s.begin, s.end - s.begin
        t = targets.get(s.name)
        if t is None:
            first.append(_readinto.Whole(offset, nbytes, tensors[s.name]))
            continue
        if t.is_cpu and t.is_contiguous():
            into.append(_readinto.Whole(offset, nbytes, t))
        elif t.is_cuda and t.is_contiguous():
            into.append(_readinto.Device(offset, t.detach().reshape(-1).view(torch.uint8)))
        else:
            into.append(_readinto.Staged(offset, nbytes, t))
        first.append(_readinto.Skip(offset, nbytes) if guard else into.pop())
    return first, into


def check_tree_size(path: str, size: int) -> None:
    check_structure_size(size, path)  # (the bound every reader shares)


def read_tree(path: str, size: int, expected_crc: int | None) -> Any:
    """Read and parse one rank's structure file (bounded: see ``_bounds``)."""
    check_tree_size(path, size)
    try:
        raw = read_regular_file(path, size)
    except OSError as e:
        raise read_error(e, "cannot read structure", path) from None
    return parse_structure(raw, path, size, expected_crc)


def _rebuild(
    tree: Any, tensors: dict[str, torch.Tensor], tree_path: str, shard_path: str, names_checked: bool = False
) -> Any:
    """The state of ``tree`` over ``tensors`` (one per name of the shard). ``names_checked``:
    :func:`plan_targets` already compared the tree's tensor names with the shard's."""
    try:
        with paused_gc():  # the state's containers, rebuilt: many small objects
            if names_checked:
                return unflatten(tree, tensors)
            state, _ = unflatten_named(tree, tensors, shard_path)
            return state
    except (ValueError, TypeError, RecursionError, OverflowError) as e:
        raise CheckpointCorruptError(f"malformed structure ({e})", tree_path) from None
    except MemoryError:
        raise CheckpointError(f"not enough memory to rebuild the state: {tree_path}") from None


def _listed(step_dir: str, manifest: Manifest, name: str) -> tuple[str, int, int]:
    try:
        f = manifest.file(name)
    except CheckpointCorruptError:
        raise CheckpointCorruptError(f"manifest does not list {name}", os.path.join(step_dir, MANIFEST)) from None
    return f.name, f.size, f.crc32c


def load_rank(step_dir: str, manifest: Manifest, rank: int, verify: bool) -> Any:
    """Rebuild rank ``rank``'s saved state from a complete step directory (by path)."""
    tree_name_, tree_size, tree_crc = _listed(step_dir, manifest, tree_name(rank))
    shard_name_, shard_size, shard_crc = _listed(step_dir, manifest, shard_name(rank))
    tree_path = os.path.join(step_dir, tree_name_)
    shard_path = os.path.join(step_dir, shard_name_)
    tree = read_tree(tree_path, tree_size, tree_crc if verify else None)
    tensors, _ = read_shard(shard_path, shard_size, shard_crc if verify else None)
    return _rebuild(tree, tensors, tree_path, shard_path)


def unreadable(e: OSError, what: str, path: str) -> CheckpointError:
    """The error a failed read of ``what`` raises (``_readfault.read_error``): an object
    store's own error as it is (gone, timed out, unavailable: not damage), an I/O fault as
    ``CheckpointReadError``, never ``CheckpointCorruptError`` unless the errno describes the file."""
    return read_error(e, f"cannot read {what}", path)


def load_files(
    files: StepFiles,
    rank: int,
    verify: bool,
    into: Any = None,
    strip_prefixes: Sequence[str] = (),
    mmap: bool = False,
    verify_first: bool = False,
) -> Any:
    """Rebuild rank ``rank``'s state from the files of a complete step without a global index.

    Both files are opened before either is read, so a retirement that starts afterwards
    cannot touch a local read; one that removed a file first raises ``Vanished``. With
    ``into``, the tensors of ``into`` that match a saved tensor (:func:`plan_targets`) are
    read into in place (with ``verify_first``: only after the whole shard verified); the
    returned state holds them. With ``mmap`` the tensors are views of the mapped shard
    (:func:`map_shard`; ``into`` must be ``None``, the files local).

    The collector is paused for the whole load, reads included (``_gcpause``): a pause per
    phase let each collection between them traverse everything the earlier phases built and
    still held (the tree, the slots, a destination and a tensor per saved tensor), promoting
    it towards a full pass. The temporaries die before the pause ends.
    """
    with paused_gc():
        return _load_files(files, rank, verify, into, strip_prefixes, mmap, verify_first)


def _load_files(
    files: StepFiles,
    rank: int,
    verify: bool,
    into: Any,
    strip_prefixes: Sequence[str],
    mmap: bool,
    verify_first: bool,
) -> Any:
    """:func:`load_files`' body (the collector paused by the caller)."""
    manifest = files.manifest
    tree_name_, shard_name_ = tree_name(rank), shard_name(rank)
    tree_size, shard_size = files.size(tree_name_), files.size(shard_name_)
    tree_crc, shard_crc = manifest.file(tree_name_).crc32c, manifest.file(shard_name_).crc32c
    tree_path, shard_path = files.path(tree_name_), files.path(shard_name_)
    check_tree_size(tree_path, tree_size)
    files.source(tree_name_)
    shard_fd = files.source(shard_name_)
    try:
        raw = files.read(tree_name_, None)
    except OSError as e:
        raise unreadable(e, "structure", tree_path) from None
    targets: dict[str, torch.Tensor] = {}
    parsed: Header | None = None
    expected = shard_crc if verify else None
    if mmap:
        tree = parse_structure(raw, tree_path, tree_size, tree_crc if verify else None)
        del raw
        assert isinstance(shard_fd, int)
        tensors = map_shard(shard_fd, shard_path, shard_size, expected)
        return _rebuild(tree, tensors, tree_path, shard_path)
    # the shard's header parsed before the tree: its parse holds ~1 KB a tensor for a moment,
    # which the tree's parse then reuses instead of adding to
    try:
        parsed = read_header(shard_fd, shard_path, shard_size)
    except OSError as e:
        raise unreadable(e, "shard", shard_path) from None
    # the state is rebuilt over the tensors once they exist, before their bytes are read, so
    # the tree is gone while the reads' destinations live (the peak of a load of many
    # tensors); not where a node uses its tensor's values as it is decoded (a generator's
    # state: the text names the tag, perhaps also inside a string, which only costs the order)
    early = b'"$generator"' not in raw
    tree = parse_structure(raw, tree_path, tree_size, tree_crc if verify else None)
    del raw
    if into is not None:
        targets = plan_targets(into, tree, parsed[2], tuple(strip_prefixes), tree_path, shard_path)
    rebuilt: list[Any] = []
    pending = [tree]
    del tree

    def rebuild(tensors: dict[str, torch.Tensor]) -> None:
        # with into=, plan_targets compared the names with the header's; the tensors are the header's
        rebuilt.append(_rebuild(pending.pop(), tensors, tree_path, shard_path, names_checked=into is not None))

    hook = rebuild if early else None
    tensors, _ = read_shard_fd(shard_fd, shard_path, shard_size, expected, targets, parsed, verify_first, hook)
    if not early:
        rebuild(tensors)
    return rebuilt[0]


_E = TypeVar("_E", bound=BaseException)

AFTER_VERIFY_NOTE = (
    " (verify_first: the shard verified, then reading it into the targets failed:"
    " they may be partly overwritten)"
)


def _noted(exc: _E, note: str) -> _E:
    """``exc`` with ``note`` appended to its message (when it is a single string, or an
    ``OSError``'s ``strerror``; once)."""
    if isinstance(exc, OSError) and isinstance(exc.strerror, str):
        if note not in exc.strerror:
            exc.strerror = f"{exc.strerror}{note}"
    elif len(exc.args) == 1 and isinstance(exc.args[0], str) and note not in exc.args[0]:
        exc.args = (f"{exc.args[0]}{note}",)
    return exc


PARTIAL_TARGETS_NOTE = (
    " (into=: the targets may be partly overwritten by a checkpoint read into them in place;"
    " load(..., verify_first=True) verifies the whole step before writing any target)"
)


@contextlib.contextmanager
def noting_partial_targets(reader: Any) -> Iterator[None]:
    """An error leaving the block says, once ``reader.dirty`` (a read into the targets of
    ``into=`` failed or was given up: a corrupt step, an I/O error, a step another rank
    refused, a fallback), that the targets may be partly overwritten, whatever its type: a
    caller who catches it and starts afresh must not trust them, and ``verify_first`` would
    have kept them. An error that has nothing to do with such a read (a shape mismatch, a
    key the checkpoint lacks, after a read that succeeded) says nothing of it."""
    try:
        yield
    except (CheckpointError, KeyError, ValueError, RuntimeError) as exc:
        if reader.dirty:
            _noted(exc, PARTIAL_TARGETS_NOTE)
        raise


# ---------------------------------------------------------------------- lazy (mapped) loads
def check_mmap(mmap: object, into: Any) -> None:
    """Refuse a bad ``mmap=`` argument at the call: ``TypeError`` for a non-bool,
    ``ValueError`` together with ``into=`` (mapped tensors are for reading; restoring copies
    into the targets anyway, so it would only add a mapping)."""
    if type(mmap) is not bool:
        raise TypeError(f"mmap must be a bool, not {type(mmap).__name__}")
    if mmap and into is not None:
        raise ValueError("mmap=True returns tensors backed by the checkpoint's file and cannot be combined with into=")


def map_shard(fd: int, path: str, size: int, expected_crc: int | None) -> dict[str, torch.Tensor]:
    """The tensors of an open shard as views of one private mapping of the file (no copy).

    With ``expected_crc`` the whole file is checksummed first, through bounded buffers, and a
    mismatch raises ``CheckpointCorruptError`` before anything is mapped. The mapping lives
    as long as any tensor of it (each holds a reference), and holds the inode after an
    unlink. Writes to the tensors are private to this process (copy-on-write).
    """
    if expected_crc is not None:
        try:
            _readinto.verify_file(fd, path, size, expected_crc)
        except OSError as e:
            raise unreadable(e, "shard", path) from None
    try:
        _, data_start, slots, _ = read_header(fd, path, size)
        mapped = _mmap.mmap(fd, size, flags=_mmap.MAP_PRIVATE, prot=_mmap.PROT_READ | _mmap.PROT_WRITE)
    except OSError as e:
        raise read_error(e, "cannot map shard", path) from None
    out: dict[str, torch.Tensor] = {}
    for s in slots:
        dtype = ST_TO_DTYPE[s.dtype]
        count = (s.end - s.begin) // dtype.itemsize
        if count == 0:  # frombuffer refuses empty views
            out[s.name] = torch.empty(s.shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=data_start + s.begin)
        out[s.name] = flat.view(s.shape)
    return out
