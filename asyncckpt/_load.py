"""Loading: read one rank's shard back, verify it, rebuild the state, restore in place.

Nothing here unpickles. Every byte read is bounded by the sizes the manifest recorded and
the file actually has, and by the limits of ``_bounds`` checked before anything is parsed or
allocated; every defect becomes ``CheckpointCorruptError`` naming the file, and a state too
large for this machine's memory a ``CheckpointError`` saying how much it needs. Tensors are
read straight into freshly allocated tensors with vectored reads, checksummed as they
arrive. :func:`load_pinned` reads through a pinned step directory (``_discovery``), so a
checkpoint retired meanwhile is reported as gone, not as corrupt.
"""

from __future__ import annotations

import collections
import os
import stat
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import numpy as np
import torch

from ._bounds import MAX_TREE_BYTES, check_memory, human, parse_structure
from ._checksum import crc32c
from ._discovery import PinnedStep, read_regular_file
from ._errors import CheckpointCorruptError, CheckpointError
from ._format import ST_TO_DTYPE
from ._header import MAX_HEADER, TensorSlot, parse_header, validate_header
from ._manifest import MANIFEST, Manifest, shard_name, tree_name
from ._structure import COMPILE_PREFIX, strip_state_dict_prefixes, tensor_names, unflatten

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_PIECE = 16 * 1024 * 1024
_BATCH = 64 * 1024 * 1024


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype, bf16 included)."""
    if t.numel() == 0:
        return memoryview(bytearray())
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def _readv_exact(fd: int, pieces: list[memoryview], offset: int, path: str) -> None:
    """Fill ``pieces`` from ``fd`` starting at ``offset``; short reads are continued."""
    i = 0
    while i < len(pieces):
        batch: list[memoryview] = []
        nbytes = 0
        while i + len(batch) < len(pieces) and len(batch) < _IOV_MAX and nbytes < _BATCH:
            p = pieces[i + len(batch)]
            batch.append(p)
            nbytes += len(p)
        got = os.preadv(fd, batch, offset)
        if got == nbytes:
            offset += got
            i += len(batch)
            continue
        # short read: finish the batch piece by piece
        for p in batch:
            if got >= len(p):
                got -= len(p)
                offset += len(p)
                continue
            pos = got
            offset += got
            got = 0
            while pos < len(p):
                n = os.preadv(fd, [p[pos:]], offset)
                if n <= 0:
                    raise CheckpointCorruptError("file ended early", path)
                pos += n
                offset += n
        i += len(batch)


def _split(mv: memoryview) -> list[memoryview]:
    return [mv[i : i + _PIECE] for i in range(0, len(mv), _PIECE)] or []


def open_regular(path: str, size: int) -> int:
    """Open ``path`` for reading, refusing symlinks, FIFOs and anything but a regular file of
    exactly ``size`` bytes (``CheckpointCorruptError`` naming the path)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CheckpointCorruptError(f"cannot open ({e.strerror})", path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise CheckpointCorruptError(f"not a regular file of {size} bytes", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_header(fd: int, path: str, size: int) -> tuple[bytes, int, list[TensorSlot], dict[str, Any]]:
    """Read and validate a shard's header: its raw bytes, the data offset, its slots, the dict."""
    prefix = os.pread(fd, 8, 0)
    try:
        n = int.from_bytes(prefix[:8], "little") if len(prefix) == 8 else -1
        if n < 0 or n > MAX_HEADER or n > size - 8:
            raise ValueError(f"declared header length {n} does not fit the file ({size} bytes)")
        head = prefix + os.pread(fd, n, 8)
        _, header = parse_header(head, size)
        data_start = 8 + n
        if data_start % 8:
            raise ValueError("data section is not 8-byte aligned")
        slots = validate_header(header, size - data_start)
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


def read_shard_fd(
    fd: int, path: str, size: int, expected_crc: int | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """:func:`read_shard` on an open file (the caller closes it)."""
    try:
        head, data_start, slots, header = read_header(fd, path, size)
        crc = crc32c(head) if expected_crc is not None else 0
        ordered: list[TensorSlot] = sorted(slots, key=lambda s: s.begin)
        tensors = _allocate(ordered, size - data_start, path)
        pieces: list[memoryview] = []
        for s in ordered:
            pieces.extend(_split(byte_view(tensors[s.name])))
        _readv_exact(fd, pieces, data_start, path)
        if expected_crc is not None:
            for p in pieces:
                crc = crc32c(p, crc)
            if crc != expected_crc:
                raise CheckpointCorruptError("checksum mismatch", path)
        meta = header.get("__metadata__", {})
        return tensors, meta
    except OSError as e:
        raise CheckpointCorruptError(f"cannot read shard ({e.strerror})", path) from None
    except MemoryError:
        raise CheckpointError(f"not enough memory to read the shard: {path}") from None


def _check_tree_size(path: str, size: int) -> None:
    if size > MAX_TREE_BYTES:
        raise CheckpointCorruptError(f"structure file of {size} bytes exceeds the {human(MAX_TREE_BYTES)} limit", path)


def read_tree(path: str, size: int, expected_crc: int | None) -> Any:
    """Read and parse one rank's structure file (bounded: see ``_bounds``)."""
    _check_tree_size(path, size)
    try:
        raw = read_regular_file(path, size)
    except OSError as e:
        raise CheckpointCorruptError(f"cannot read structure ({e.strerror})", path) from None
    return parse_structure(raw, path, size, expected_crc)


def _rebuild(tree: Any, tensors: dict[str, torch.Tensor], tree_path: str, shard_path: str) -> Any:
    try:
        if sorted(set(tensor_names(tree))) != sorted(tensors):  # tied tensors are named twice
            raise CheckpointCorruptError("structure and shard disagree on tensor names", shard_path)
        return unflatten(tree, tensors)
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


def load_pinned(pinned: PinnedStep, rank: int, verify: bool) -> Any:
    """Rebuild rank ``rank``'s state from a pinned, complete step directory.

    Both files are opened before either is read, so a retirement that starts afterwards
    cannot touch the read; one that removed a file first raises ``Vanished``.
    """
    manifest = pinned.manifest
    assert manifest is not None
    tree_name_, tree_size, tree_crc = _listed(pinned.path, manifest, tree_name(rank))
    shard_name_, shard_size, shard_crc = _listed(pinned.path, manifest, shard_name(rank))
    tree_path = os.path.join(pinned.path, tree_name_)
    shard_path = os.path.join(pinned.path, shard_name_)
    _check_tree_size(tree_path, tree_size)
    tree_fd = pinned.open_file(tree_name_, tree_size)
    try:
        shard_fd = pinned.open_file(shard_name_, shard_size)
        try:
            try:
                raw = _read_all(tree_fd, tree_size)
            except OSError as e:
                raise CheckpointCorruptError(f"cannot read structure ({e.strerror})", tree_path) from None
            tree = parse_structure(raw, tree_path, tree_size, tree_crc if verify else None)
            del raw
            tensors, _ = read_shard_fd(shard_fd, shard_path, shard_size, shard_crc if verify else None)
        finally:
            os.close(shard_fd)
    finally:
        os.close(tree_fd)
    return _rebuild(tree, tensors, tree_path, shard_path)


def _read_all(fd: int, size: int) -> bytes:
    chunks = []
    pos = 0
    while pos < size:
        b = os.pread(fd, size - pos, pos)
        if not b:
            break
        chunks.append(b)
        pos += len(b)
    return b"".join(chunks)


def restore_into(target: Any, loaded: Any, path: str = "", strip_prefixes: Sequence[str] = ()) -> None:
    """Restore ``loaded`` into ``target`` in place.

    Objects with ``load_state_dict`` get it called; tensors get ``copy_``, numpy arrays
    ``np.copyto``, ``torch.Generator`` objects ``set_state``; dicts and lists are walked, and
    other values in mutable containers are replaced. A module loads keys saved without
    wrapper prefixes: a ``torch.compile`` wrapper (``_orig_mod.``) and any of
    ``strip_prefixes`` (e.g. DDP's ``"module."``) are matched on both sides, so a checkpoint
    of a compiled or wrapped model loads into a plain one and the other way round. Raises
    ``KeyError`` when ``target`` holds a key the checkpoint lacks, ``ValueError`` on a type or
    shape mismatch (targets may be partly overwritten then).
    """
    where = path or "<root>"
    if isinstance(target, torch.Tensor):
        if not isinstance(loaded, torch.Tensor):
            raise ValueError(f"{where}: checkpoint holds {type(loaded).__name__}, target is a tensor")
        if target.shape != loaded.shape:
            raise ValueError(f"{where}: shape {tuple(loaded.shape)} in checkpoint, {tuple(target.shape)} in target")
        with torch.no_grad():
            target.copy_(loaded)
        return
    if isinstance(target, np.ndarray):
        if not isinstance(loaded, np.ndarray) or loaded.shape != target.shape or loaded.dtype != target.dtype:
            got = f"{loaded.dtype}{list(loaded.shape)}" if isinstance(loaded, np.ndarray) else type(loaded).__name__
            raise ValueError(f"{where}: checkpoint holds {got}, target is an array {target.dtype}{list(target.shape)}")
        np.copyto(target, loaded)
        return
    if isinstance(target, torch.Generator):
        if not isinstance(loaded, torch.Generator):
            raise ValueError(f"{where}: checkpoint holds {type(loaded).__name__}, target is a torch.Generator")
        target.set_state(loaded.get_state())
        return
    if isinstance(target, torch.nn.Module) and isinstance(loaded, Mapping):
        module, state = _match_module(target, loaded, tuple(strip_prefixes))
        module.load_state_dict(state)
        return
    load_state_dict = getattr(target, "load_state_dict", None)
    if callable(load_state_dict):
        load_state_dict(loaded)
        return
    if isinstance(target, Mapping):
        if not isinstance(loaded, Mapping):
            raise ValueError(f"{where}: checkpoint holds {type(loaded).__name__}, target is a mapping")
        for key in list(target):
            sub = f"{path}.{key}" if path else str(key)
            if key not in loaded:
                raise KeyError(f"{sub} is not in the checkpoint")
            if _is_leaf(target[key]) and isinstance(target, MutableMapping):
                target[key] = loaded[key]
            else:
                restore_into(target[key], loaded[key], sub, strip_prefixes)
        return
    if isinstance(target, (list, tuple)):
        if not isinstance(loaded, (list, tuple)) or len(loaded) != len(target):
            raise ValueError(f"{where}: sequence length or type differs from the checkpoint")
        for i, (t, v) in enumerate(zip(target, loaded, strict=True)):
            sub = f"{path}.{i}" if path else str(i)
            if _is_leaf(t) and isinstance(target, MutableSequence):
                target[i] = v
            else:
                restore_into(t, v, sub, strip_prefixes)
        return
    # a plain value at the top level or inside a tuple: nothing to restore in place


def _is_leaf(v: Any) -> bool:
    """A value restored by replacing it, not in place."""
    if isinstance(v, (torch.Tensor, np.ndarray, torch.Generator, Mapping, list, tuple)):
        return False
    return not callable(getattr(v, "load_state_dict", None))


def _match_module(
    target: torch.nn.Module, loaded: Mapping[Any, Any], prefixes: tuple[str, ...]
) -> tuple[torch.nn.Module, Mapping[Any, Any]]:
    """The module that takes ``loaded`` and the state renamed for it.

    A wrapper whose keys all carry one of the prefixes (``_orig_mod.`` of ``torch.compile``
    always, the named ones such as ``module.`` of DDP) hands over to the module it wraps; the
    checkpoint's keys and ``_metadata`` lose the same prefixes (old checkpoints may have them).
    """
    wanted = (COMPILE_PREFIX, *prefixes)
    unwrapped = True
    while unwrapped:
        unwrapped = False
        for p in wanted:
            if _is_wrapper(target, p[:-1]):
                target, unwrapped = getattr(target, p[:-1]), True
                break
    if not all(isinstance(k, str) for k in loaded):
        return target, loaded
    items, meta = strip_state_dict_prefixes(loaded, wanted)
    state: collections.OrderedDict[str, Any] = collections.OrderedDict(items)
    if meta is not None:
        state._metadata = meta  # type: ignore[attr-defined]
    return target, state


def _is_wrapper(m: torch.nn.Module, attr: str) -> bool:
    """Whether every key of ``m``'s state dict is ``attr.`` + a key of its child ``attr``.

    Decided from the module's structure, without calling ``state_dict()`` (which may be
    expensive or collective for some wrappers).
    """
    children = [name for name, _ in m.named_children()]
    return (
        children == [attr]
        and next(m.parameters(recurse=False), None) is None
        and next(m.buffers(recurse=False), None) is None
        and type(m).get_extra_state is torch.nn.Module.get_extra_state
    )
