"""DCP's ``Metadata`` as JSON, and back: ``dcp.json`` of a step written through DCP.

``torch.distributed.checkpoint`` pickles its ``Metadata`` (``.metadata``); unpickling runs
code named by the file. Here every field is encoded by hand and decoded by type-checking
code that builds nothing but DCP's own dataclasses::

    {"format": "asyncckpt-dcp/1", "version": "1.0.0",
     "tensors": {"model.up.weight": {"dtype": "F32", "size": [8, 6], "requires_grad": false,
                                     "memory_format": "contiguous_format", "pin_memory": false,
                                     "chunks": [[[0, 0], [4, 6]], [[4, 0], [4, 6]]]}},
     "bytes": {"optim.param_groups": ["rank00001.safetensors", 8192, 811, 3735928559]},
     "mappings": {"model.up.weight": ["model", "up.weight"]},
     "storage_meta": {"checkpoint_id": "ck/step_00000010", "save_id": "...", "modules": []}}

``tensors`` is ``state_dict_metadata``'s tensor entries (where each chunk's bytes lie is
the step's ``index.json``, one mechanism for asyncckpt's loader and DCP's); ``bytes`` its
other entries, each with where its bytes lie (file, begin, length, CRC-32C). ``mappings``
is ``planner_data`` as ``DefaultSavePlanner`` makes it (flat key -> key path of the nested
state dict); any other ``planner_data`` cannot be stored without pickle and is refused at
the save. ``storage_data`` is not stored: it is the writer's business, and this layer
locates the bytes through the index.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..format._bounds import json_items
from ..format._safetensors import DTYPE_TO_ST, ST_TO_DTYPE

FILE = "dcp.json"
FORMAT = "asyncckpt-dcp/1"
#: Refuse a ``dcp.json`` larger than this, or with more JSON items, before parsing it.
MAX_BYTES = 1 << 30
MAX_ITEMS = 50_000_000

_MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve_format": torch.preserve_format,
}
_MEMORY_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}

#: Where one bytes entry lies: (file, begin, length, crc32c).
BytesLocation = tuple[str, int, int, int]


def dtype_name(dtype: torch.dtype, what: str) -> str:
    """The safetensors name of ``dtype`` (``TypeError`` naming ``what`` if it has none)."""
    name = DTYPE_TO_ST.get(dtype)
    if name is None:
        raise TypeError(f"{what}: dtype {dtype} cannot be stored (asyncckpt stores {sorted(map(str, DTYPE_TO_ST))})")
    return name


def encode(metadata: Metadata, locations: Mapping[str, BytesLocation]) -> bytes:
    """``dcp.json`` for ``metadata``; ``locations`` places every bytes entry.

    Raises ``TypeError`` for what JSON cannot carry faithfully: a ``planner_data`` other than
    ``DefaultSavePlanner``'s key mappings, a dtype asyncckpt does not store, a layout other
    than strided.
    """
    tensors: dict[str, Any] = {}
    blobs: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            p = md.properties
            if p.layout != torch.strided:
                raise TypeError(f"{fqn!r}: layout {p.layout} cannot be stored (strided tensors only)")
            tensors[fqn] = {
                "dtype": dtype_name(p.dtype, repr(fqn)),
                "size": list(md.size),
                "requires_grad": bool(p.requires_grad),
                "memory_format": _MEMORY_NAMES.get(p.memory_format, "contiguous_format"),
                "pin_memory": bool(p.pin_memory),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks],
            }
        elif isinstance(md, BytesStorageMetadata):
            if fqn not in locations:
                raise ValueError(f"no rank wrote the bytes of {fqn!r}")
            blobs[fqn] = list(locations[fqn])
        else:
            raise TypeError(f"{fqn!r}: unknown storage metadata {type(md).__name__}")
    doc: dict[str, Any] = {
        "format": FORMAT,
        "version": metadata.version,
        "tensors": tensors,
        "bytes": blobs,
        "mappings": encode_mappings(metadata.planner_data),
        "storage_meta": _encode_storage_meta(metadata.storage_meta),
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def encode_mappings(planner_data: Any) -> dict[str, list[str | int]] | None:
    if planner_data is None:
        return None
    if isinstance(planner_data, Mapping) and all(
        isinstance(k, str)
        and isinstance(v, (tuple, list))
        and all(isinstance(e, (str, int)) and not isinstance(e, bool) for e in v)
        for k, v in planner_data.items()
    ):
        return {k: list(v) for k, v in planner_data.items()}
    raise TypeError(
        f"the planner's planner_data ({type(planner_data).__name__}) cannot be stored without pickle: asyncckpt "
        "stores DefaultSavePlanner's key mappings (flat key -> key path) or nothing"
    )


def _encode_storage_meta(sm: StorageMeta | None) -> dict[str, Any] | None:
    if sm is None:
        return None
    return {
        "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
        "save_id": sm.save_id,
        "modules": [str(m) for m in sm.modules],
    }


def _uints(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def decode(raw: bytes, file_sizes: Mapping[str, int]) -> tuple[Metadata, dict[str, BytesLocation]]:
    """``Metadata`` and the bytes entries' locations from ``dcp.json``; ``ValueError`` on any
    defect (the caller names the file). Every bytes entry must lie inside a file of
    ``file_sizes`` (the manifest's)."""
    if len(raw) > MAX_BYTES or json_items(raw) > MAX_ITEMS:
        raise ValueError("too large")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not {FORMAT}")
    tensors, blobs, mappings = doc.get("tensors"), doc.get("bytes"), doc.get("mappings")
    if not isinstance(tensors, dict) or not isinstance(blobs, dict) or set(tensors) & set(blobs):
        raise ValueError("malformed entries")
    sdm: dict[str, Any] = {}
    for fqn, t in tensors.items():
        if not (isinstance(t, dict) and t.get("dtype") in ST_TO_DTYPE and _uints(t.get("size"))):
            raise ValueError(f"malformed tensor entry {fqn!r}")
        chunks = t.get("chunks")
        if not isinstance(chunks, list) or t.get("memory_format") not in _MEMORY_FORMATS:
            raise ValueError(f"malformed tensor entry {fqn!r}")
        cs = []
        for c in chunks:
            if not (isinstance(c, list) and len(c) == 2 and _uints(c[0]) and _uints(c[1])):
                raise ValueError(f"malformed chunk of {fqn!r}")
            if len(c[0]) != len(t["size"]) or len(c[1]) != len(t["size"]):
                raise ValueError(f"chunk of {fqn!r} has another rank than the tensor")
            if any(o + s > n for o, s, n in zip(c[0], c[1], t["size"], strict=True)):
                raise ValueError(f"chunk of {fqn!r} lies outside the tensor")
            cs.append(ChunkStorageMetadata(offsets=torch.Size(c[0]), sizes=torch.Size(c[1])))
        if not all(isinstance(t.get(k), bool) for k in ("requires_grad", "pin_memory")):
            raise ValueError(f"malformed tensor entry {fqn!r}")
        props = TensorProperties(
            dtype=ST_TO_DTYPE[t["dtype"]],
            layout=torch.strided,
            requires_grad=t["requires_grad"],
            memory_format=_MEMORY_FORMATS[t["memory_format"]],
            pin_memory=t["pin_memory"],
        )
        sdm[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(t["size"]), chunks=cs)
    locations: dict[str, BytesLocation] = {}
    for fqn, loc in blobs.items():
        if not (isinstance(loc, list) and len(loc) == 4 and isinstance(loc[0], str) and _uints(loc[1:])):
            raise ValueError(f"malformed bytes entry {fqn!r}")
        file, begin, n, crc = loc
        size = file_sizes.get(file)
        if size is None or begin + n > size or crc >= 2**32:
            raise ValueError(f"bytes entry {fqn!r} lies outside the files listed")
        locations[fqn] = (file, begin, n, crc)
        sdm[fqn] = BytesStorageMetadata()
    planner_data = None
    if mappings is not None:
        if not isinstance(mappings, dict) or not all(
            isinstance(v, list) and all(isinstance(e, (str, int)) and not isinstance(e, bool) for e in v)
            for v in mappings.values()
        ):
            raise ValueError("malformed mappings")
        planner_data = {k: tuple(v) for k, v in mappings.items()}
    version = doc.get("version")
    if version is not None and not isinstance(version, str):
        raise ValueError("malformed version")
    return (
        Metadata(
            state_dict_metadata=sdm,
            planner_data=planner_data,
            storage_meta=_decode_storage_meta(doc.get("storage_meta")),
            version=version,
        ),
        locations,
    )


def _decode_storage_meta(d: Any) -> StorageMeta | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ValueError("malformed storage_meta")
    cid, sid, modules = d.get("checkpoint_id"), d.get("save_id"), d.get("modules", [])
    if not (cid is None or isinstance(cid, str)) or not (sid is None or isinstance(sid, str)):
        raise ValueError("malformed storage_meta")
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise ValueError("malformed storage_meta")
    return StorageMeta(checkpoint_id=cid, save_id=sid, modules=modules)


def chunk_nbytes(sizes: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(sizes) * dtype.itemsize
