"""The global tensor index of a step that holds DTensors: ``index.json``.

A DTensor is saved as chunks: every rank that writes a box of it (one replica per box, see
``_sharding.ShardInfo.writer``) stores its local shard in its own ``rankRRRRR.safetensors``
under the usual dotted name. Each rank reports its part (:func:`rank_part`, on the writer
thread, CRC-32C of every slot computed from the staging buffer); the leader merges the parts
(:func:`merge`) into one index, written before the manifest and listed in it with its size
and CRC, so a checkpoint is a global description readable without the mesh that wrote it::

    {"format": "asyncckpt-index/1", "world_size": 4, "block": 1048576,
     "tensors": {"model.up.weight": {"dtype": "F32", "shape": [8, 6],
                                     "placements": ["SS(0,2)", "S(0)"], "mesh": [2, 2],
                                     "chunks": [[[0, 0], [2, 6], "rank00000.safetensors",
                                                 4096, 48, 3735928559], ...],
                                     "blocks": [[3735928559], ...]}},
     "plain": {"0": {"model.buf": ["F32", [4], 4144, 16, 123]}, "1": ..., "3": null}}

A chunk is ``[offsets, sizes, file, begin (absolute file byte), nbytes, crc32c]``.
``blocks`` (parallel to ``chunks``) holds the CRC-32C of every ``block``-byte block of each
chunk, blocks aligned to the chunk's first byte, the last one short, so a reader that needs
part of a chunk reads and verifies only the blocks covering it. Both fields are additive: an
index written before them (no ``block``) loads through the whole-chunk CRC, and a reader that
does not know them ignores them, so the format string stays ``asyncckpt-index/1``.
``plain`` lists, per rank, where each of its other tensors lies in its file, with a CRC, so
a reader can take one rank's values without reading its DTensor chunks (``null``: a rank that
held no DTensor reported nothing; its file is then read whole, checked by the manifest's
CRC). ``placements`` and ``mesh`` are informational; the loader uses shape and chunks only.
``aliases`` (additive too) maps a DTensor name to the one it is tied to (GPT-2's
``lm_head.weight`` -> ``wte.weight``): stored once, and readers resolve every rank's tree
through it.
Torch-free.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

from ._checksum import crc32c, crc32c_append_zeros, crc32c_shift
from ._header import ITEMSIZE
from ._reshard import Box, SavedChunk, check_chunk_index, check_tiling

log = logging.getLogger("asyncckpt")

INDEX = "index.json"
FORMAT = "asyncckpt-index/1"
#: Refuse index files larger than this before parsing them.
MAX_INDEX_BYTES = 1 << 30
#: Bytes per block CRC. CRC-32C runs at the same 12.9-13.3 GB/s (pread + CRC: 2.36-2.44 GB/s)
#: for 64 KiB to 4 MiB blocks on the 2-core VM, so the size trades the over-read of a
#: partial read (at most one block at each end of a range) against the per-block
#: bookkeeping of the reader and the index size (about 11 bytes of JSON per block).
#: Readers take the size from the index, never from here.
BLOCK = 1 << 20
#: Largest block size a reader accepts (hostile indexes: bounded bounce buffers).
MAX_BLOCK = 1 << 30


def block_crcs(data: memoryview, block: int) -> tuple[int, list[int]]:
    """The CRC-32C of ``data`` and of each of its ``block``-byte blocks (the last one short).

    One pass over the bytes: the whole CRC is combined from the blocks' (one shift for
    every full block; the short last block is continued from the running CRC).
    """
    n = len(data)
    crcs = [crc32c(data[i : i + block]) for i in range(0, n, block)]
    whole, shift = 0, crc32c_shift(block)
    full = n // block
    for c in crcs[:full]:
        whole = crc32c_append_zeros(whole, shift) ^ c
    if full < len(crcs):
        whole = crc32c(data[full * block :], whole)
    return whole, crcs


def rank_part(
    buffer: memoryview,
    data_start: int,
    slots: Any,
    dtensors: list[dict[str, Any]],
    file: str,
    writers: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """This rank's part of the index, from the file image ``buffer`` it writes as ``file``.

    ``slots``: that image's ``TensorSlot`` list; ``dtensors``: one description per DTensor the
    rank holds (name, dtype, shape, placements, mesh, box or None, writer), from ``save()``;
    ``writers``: the deduplicated plain tensors and the rank writing each (``_dedupe.plan``).
    Every written chunk gets its CRC-32C and its :data:`BLOCK` block CRCs (one pass).
    """
    by_name = {s.name: s for s in slots}
    tensors: dict[str, Any] = {}
    written: set[str] = set()
    aliases: dict[str, str] = {}
    for d in dtensors:
        for alias in d.get("aliases", ()):
            aliases[alias] = d["name"]
        entry = {k: d[k] for k in ("dtype", "shape", "placements", "mesh")}
        entry["chunk"] = None
        s = by_name.get(d["name"]) if d["writer"] else None
        if s is not None:  # (a box another holder writes, by the dedupe round's plan, is not here)
            begin, n = data_start + s.begin, s.end - s.begin
            whole, blocks = block_crcs(buffer[begin : begin + n], BLOCK)
            entry["chunk"] = [d["box"][0], d["box"][1], begin, n, whole, blocks]
            written.add(d["name"])
        tensors[d["name"]] = entry
    plain = [
        [s.name, s.dtype, list(s.shape), file, data_start + s.begin, s.end - s.begin,
         crc32c(buffer[data_start + s.begin : data_start + s.end])]
        for s in slots
        if s.name not in written
    ]  # fmt: skip
    part = {"file": file, "tensors": tensors, "plain": plain, "writers": dict(writers or {}), "block": BLOCK}
    if aliases:
        part["aliases"] = aliases
    return part


def merge(world: int, parts: Mapping[int, dict[str, Any] | None]) -> bytes:
    """The index file from every rank's part (``None``: a rank without DTensors).

    A DTensor's identity is its name: the same box reported by several ranks (replicas
    outside the DTensor's own mesh, e.g. FSDP over ``mesh["dp"]`` of a dp x tp mesh, which
    holds one copy per tp column, when they were not deduplicated before the write) is
    indexed once, the lowest rank's copy; copies whose CRCs differ are logged.

    Raises ``ValueError`` when ranks disagree on a DTensor's dtype or global shape, or on a
    tie: a name some rank tied to another DTensor (its part's ``aliases``) may appear as a
    DTensor of its own only on ranks that wrote no bytes of it (a local shard over no storage
    cannot show the tie); it is then stored once, under the name it is tied to.
    """
    tensors: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    # name -> box -> (rank, crc) of the copy indexed; name -> two ranks whose copies differ
    seen: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, int]]] = {}
    drift: dict[str, tuple[int, int]] = {}
    # name -> (placements, mesh shape) -> the first rank holding it in that layout
    layouts: dict[str, dict[tuple[tuple[str, ...], tuple[int, ...]], int]] = {}
    first = min((r for r, p in parts.items() if p is not None), default=0)
    block = (parts.get(first) or {}).get("block", BLOCK)
    for r in range(world):
        part = parts.get(r)
        if part is None:
            plain[str(r)] = None
            continue
        for name, e in part["tensors"].items():
            have = tensors.get(name)
            if have is None:
                have = tensors[name] = {k: e[k] for k in ("dtype", "shape", "placements", "mesh")}
                have["chunks"], have["blocks"] = [], []
            elif (have["dtype"], have["shape"]) != (e["dtype"], e["shape"]):
                raise ValueError(
                    f"ranks disagree on DTensor {name!r}: {have['dtype']}{have['shape']} vs "
                    f"{e['dtype']}{e['shape']} on rank {r}"
                )
            layouts.setdefault(name, {}).setdefault((tuple(e["placements"]), tuple(e["mesh"])), r)
            if e["chunk"] is not None:
                offs, sizes, begin, n, crc, blocks = e["chunk"]
                if part["block"] != block:
                    raise ValueError(f"rank {r} used blocks of {part['block']} bytes, rank {first} of {block}")
                box = (tuple(offs), tuple(sizes))
                got = seen.setdefault(name, {}).get(box)
                if got is not None:  # the same box of the same global tensor: one copy is indexed
                    if got[1] != crc:
                        drift.setdefault(name, (got[0], r))
                    continue
                seen[name][box] = (r, crc)
                have["chunks"].append([offs, sizes, part["file"], begin, n, crc])
                have["blocks"].append(blocks)
        plain[str(r)] = {p[0]: p[1:] for p in part["plain"]}
    deduped = 0
    for r in range(world):
        part = parts.get(r) or {}
        for name, w in part.get("writers", {}).items():
            if name in part["tensors"]:
                continue  # a DTensor box another holder writes: its chunk is indexed once above
            if w != r:  # written once, by rank w: rank r's value is that copy
                have = (parts.get(w) or {}).get("writers", {}).get(name) == w and plain[str(w)].get(name)
                if not have:
                    raise ValueError(f"rank {w} was to write {name!r} for rank {r} but did not report it")
                plain[str(r)][name] = have
                deduped += 1
    for name, (a, b) in sorted(drift.items())[:10]:
        log.warning(
            "DTensor %r: ranks %d and %d hold the same box with different bytes (replicas that drifted "
            "apart); the checkpoint keeps rank %d's copy", name, a, b, a,
        )  # fmt: skip
    aliases: dict[str, str] = {}
    for _, part in sorted(parts.items()):
        for alias, target in (part or {}).get("aliases", {}).items():
            if aliases.setdefault(alias, target) != target:
                raise ValueError(f"ranks disagree on DTensor {alias!r}: tied to {aliases[alias]!r} and to {target!r}")
    for alias, target in aliases.items():
        if target not in tensors or target in aliases:
            raise ValueError(f"DTensor {alias!r} is tied to {target!r}, which no rank saved")
        own, kept = tensors.pop(alias, None), tensors[target]
        if own is not None and (own["chunks"] or (own["dtype"], own["shape"]) != (kept["dtype"], kept["shape"])):
            raise ValueError(f"ranks disagree on whether DTensor {alias!r} is tied to {target!r}")
    for name, found in layouts.items():
        if len(found) > 1 and name in tensors:  # one global tensor, laid out differently by some ranks
            _check_one_layout(name, tensors[name], found)
    for e in tensors.values():
        order = sorted(range(len(e["chunks"])), key=lambda i: e["chunks"][i][0])
        e["chunks"] = [e["chunks"][i] for i in order]
        e["blocks"] = [e["blocks"][i] for i in order]
    doc: dict[str, Any] = {"format": FORMAT, "world_size": world, "block": block, "tensors": tensors, "plain": plain}
    if aliases:
        doc["aliases"] = aliases
    if any((p or {}).get("writers") for p in parts.values()):
        doc["dedupe"] = {"hash": "xxh3-128", "copies_not_written": deduped}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _check_one_layout(name: str, e: dict[str, Any], found: Mapping[Any, int]) -> None:
    """``ValueError`` naming the layouts when the chunks ranks wrote of one DTensor, laid out
    differently on different meshes, do not tile it (the index must describe each global
    tensor once; equal boxes were merged already)."""
    try:
        check_tiling(e["shape"], [Box(tuple(c[0]), tuple(c[1])) for c in e["chunks"]], name)
    except ValueError as err:
        shown = "; ".join(f"{list(p)} on a mesh {list(m)} (rank {r})" for (p, m), r in sorted(found.items()))
        raise ValueError(
            f"ranks hold DTensor {name!r} in different layouts whose chunks do not tile it ({err}): {shown}; "
            "save one global tensor in one layout (or under different names)"
        ) from None


def _uint(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _ints(v: object) -> bool:
    return isinstance(v, list) and all(_uint(x) for x in v)


def parse(raw: bytes, world: int, file_sizes: Mapping[str, int], plain_only: bool = False) -> dict[str, Any]:
    """Parse and validate an index read back (``ValueError`` on any defect).

    The one validator of a global index: the loader (``_load_global``), ``verify``
    (``reading.verify_step``) and the committing rank before the commit point call it, so
    they can never disagree on which index is good. ``file_sizes``: every file the manifest
    lists, with its size (a chunk or entry outside them is a defect).

    Every DTensor's chunks must tile its shape and lie inside files the manifest lists
    (``_reshard.check_chunk_index``, cost bounded by the chunk count), chunks with equal
    boxes counting as one (the first listed: indexes written before :func:`merge` merged a
    sub-mesh DTensor's twins list each copy); every plain entry
    must lie inside the file it names; block CRCs, where the index has them (``block``), must
    be one 32-bit CRC per block of every chunk. ``plain_only`` skips the DTensors (the torch-
    and numpy-free CLI shows and checks only the plain entries).

    Each DTensor comes back as ``{"dtype", "shape", "chunks", "crcs", "block", "blocks"}``:
    ``block`` is the block size (``None`` for an index written before block CRCs, whose
    chunks are then read and checked whole) and ``blocks`` one CRC list per chunk.
    """
    if len(raw) > MAX_INDEX_BYTES:
        raise ValueError(f"index larger than {MAX_INDEX_BYTES} bytes")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, RecursionError) as err:
        raise ValueError(f"index is not valid JSON ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("world_size") != world:
        raise ValueError("index has an unknown format or another world size than the manifest")
    tensors, plain = doc.get("tensors"), doc.get("plain")
    if not isinstance(tensors, dict) or not isinstance(plain, dict):
        raise ValueError("index is malformed")
    block = doc.get("block")
    if block is not None and not (_uint(block) and 0 < block <= MAX_BLOCK):
        raise ValueError(f"index has a bad block size {block!r}")
    aliases = doc.get("aliases", {})
    if not (isinstance(aliases, dict) and all(isinstance(a, str) and isinstance(t, str) for a, t in aliases.items())):
        raise ValueError("index aliases are malformed")
    out: dict[str, Any] = {}
    if not plain_only:
        out = _parse_tensors(tensors, file_sizes, block)
        for alias, target in aliases.items():
            if alias in out or target not in out:
                raise ValueError(f"index alias {alias!r} -> {target!r} names no single stored DTensor")
    ranks: dict[int, dict[str, tuple[str, tuple[int, ...], str, int, int, int]] | None] = {}
    for r in range(world):
        entries = plain.get(str(r))
        if entries is None:
            ranks[r] = None
            continue
        if not isinstance(entries, dict):
            raise ValueError(f"plain entries of rank {r} are malformed")
        got: dict[str, tuple[str, tuple[int, ...], str, int, int, int]] = {}
        for name, p in entries.items():
            if not (isinstance(p, list) and len(p) == 6 and p[0] in ITEMSIZE and _ints(p[1])):
                raise ValueError(f"plain entry {name!r} of rank {r} is malformed")
            dtype, shape, file, begin, n, crc = p
            if not (_uint(begin) and _uint(n) and _uint(crc)) or n != math.prod(shape) * ITEMSIZE[dtype]:
                raise ValueError(f"plain entry {name!r} of rank {r} is malformed")
            size = file_sizes.get(file) if isinstance(file, str) else None
            if size is None or begin + n > size:
                raise ValueError(f"plain entry {name!r} of rank {r} lies outside the files listed")
            got[name] = (dtype, tuple(shape), file, begin, n, crc)
        ranks[r] = got
    return {"tensors": out, "plain": ranks, "aliases": aliases}


def lacking(index: Mapping[str, Any], names: Iterable[str]) -> list[str]:
    """The DTensor names of a rank's tree (``names``; aliases resolved or not) that the parsed
    ``index`` does not store: a load of that rank raises ``CheckpointCorruptError`` for each."""
    tensors, aliases = index["tensors"], index["aliases"]
    return [n for n in dict.fromkeys(names) if n not in tensors and aliases.get(n) not in tensors]


def checked_ranges(index: Mapping[str, Any]) -> dict[str, list[tuple[int, int, int, str]]]:
    """Every byte range of the step's files whose CRC-32C a load checks, per file, as
    ``(begin, length, crc, what)`` sorted and without repeats: each block of every DTensor
    chunk (the chunk whole in an index without block CRCs) and every plain entry. A verify
    that checks these and the files the manifest lists checks every byte a load can read.
    ``index``: what :func:`parse` returned (not ``plain_only``)."""
    out: dict[str, set[tuple[int, int, int, str]]] = {}
    for name, e in index["tensors"].items():
        item = ITEMSIZE[e["dtype"]]
        for i, c in enumerate(e["chunks"]):
            n = c.nbytes(item)
            what = f"a chunk of {name!r}"
            if e["block"] is None:
                out.setdefault(c.file, set()).add((c.begin, n, e["crcs"][i], what))
                continue
            size = e["block"]
            for k, crc in enumerate(e["blocks"][i]):
                length = min(size, n - k * size)
                out.setdefault(c.file, set()).add((c.begin + k * size, length, crc, f"block {k} of {what}"))
    for entries in index["plain"].values():
        for name, (_, _, file, begin, n, crc) in (entries or {}).items():
            out.setdefault(file, set()).add((begin, n, crc, f"{name!r}"))
    # one range written for several ranks (dedupe) is named by any of them: checked once
    return {f: sorted({r[:3]: r for r in rs}.values()) for f, rs in out.items()}


def _crc_list(v: object, count: int) -> bool:
    return isinstance(v, list) and len(v) == count and all(_uint(c) and c < 2**32 for c in v)


def _parse_tensors(tensors: dict[str, Any], file_sizes: Mapping[str, int], block: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, e in tensors.items():
        if not isinstance(e, dict) or e.get("dtype") not in ITEMSIZE or not _ints(e.get("shape")):
            raise ValueError(f"index entry of {name!r} is malformed")
        item = ITEMSIZE[e["dtype"]]
        chunks, crcs = [], []
        raw_chunks = e.get("chunks")
        if not isinstance(raw_chunks, list):
            raise ValueError(f"index entry of {name!r} is malformed")
        for c in raw_chunks:
            if not (isinstance(c, list) and len(c) == 6 and _ints(c[0]) and _ints(c[1])):
                raise ValueError(f"chunk of {name!r} is malformed")
            offs, sizes, file, begin, n, crc = c
            if not (isinstance(file, str) and _uint(begin) and _uint(n) and _uint(crc) and crc < 2**32):
                raise ValueError(f"chunk of {name!r} is malformed")
            if len(offs) != len(sizes) or n != math.prod(sizes) * item:
                raise ValueError(f"chunk of {name!r} has {n} bytes for {sizes}")
            chunks.append(SavedChunk(Box(tuple(offs), tuple(sizes)), file, begin))
            crcs.append(crc)
        blocks = e.get("blocks")
        if block is None and blocks is not None:
            raise ValueError(f"block CRCs of {name!r} without a block size")
        if block is not None:
            if not (isinstance(blocks, list) and len(blocks) == len(chunks)) or not all(
                _crc_list(b, -(-c.nbytes(item) // block)) for b, c in zip(blocks, chunks, strict=True)
            ):
                raise ValueError(f"block CRCs of {name!r} are malformed")
        # an index written before DTensor twins were merged (a sub-mesh DTensor's copies, one
        # per parent-mesh coordinate, each listed) still loads: an equal box is the same chunk
        first = list({c.box: i for i, c in reversed(list(enumerate(chunks)))}.values())
        if len(first) < len(chunks):
            first.sort()
            chunks, crcs = [chunks[i] for i in first], [crcs[i] for i in first]
            blocks = [blocks[i] for i in first] if blocks is not None else None
        check_chunk_index(e["shape"], chunks, item, file_sizes, name)
        out[name] = {
            "dtype": e["dtype"], "shape": tuple(e["shape"]), "chunks": chunks, "crcs": crcs,
            "block": block, "blocks": blocks,
        }  # fmt: skip
    return out
