"""The structure tree's vocabulary: how a nested training state is written as (JSON tree,
named tensors), and the tables its encoder (``_structure_encode.flatten``) and decoder
(``_structure_decode.unflatten``) share.

The tree is plain JSON in which every object is a one-key tagged node, so decoding is
unambiguous and needs no pickle (and never imports or calls anything named by the file):

    {"$dict": [[key, node], ...]}          key is a str or an int (optimizer state uses ints)
    {"$tuple": [node, ...]}                lists stay JSON arrays
    {"$tensor": "model.layer1.weight"}
    {"$dtensor": "model.layer1.weight"}    a DTensor: its chunks are in the step's global index
    {"$float": "nan" | "inf" | "-inf"}
    {"$bytes": "<base64>"}
    {"$odict": [[[key, node], ...], meta]} OrderedDict; meta: null or the node of ``_metadata``
    {"$defaultdict": [factory, [[key, node], ...]]}  factory: a builtin type name or null
    {"$param": [tensor_node, requires_grad]}         nn.Parameter
    {"$ndarray": [tensor_name, dtype, shape]}        numpy array stored as tensor data
    {"$np": [dtype, value_node]}           numpy scalar (np.float32(1.5) etc.)
    {"$complex": [re_node, im_node]}
    {"$set": [node, ...]} / {"$frozenset": [node, ...]}   elements in a deterministic order
    {"$bytearray": "<base64>"}
    {"$size": [int, ...]} / {"$dtype": "float32"} / {"$device": "cuda:0"}
    {"$generator": [device, tensor_node]}  torch.Generator: its device and get_state()
    {"$path": [class_name, str]}           PurePosixPath, PureWindowsPath, PosixPath
    {"$date": "2024-01-31"} / {"$timedelta": [days, seconds, microseconds]}
    {"$datetime": [naive_iso, fold, tz]}   tz: null, ["fixed", [d, s, us], name|null], ["zone", key]

ints, finite floats, bools, str and None are JSON scalars (JSON keeps int/float/bool apart).
Types are matched exactly: a subclass of a supported type (IntEnum, namedtuple, a dict
subclass) is refused with a hint rather than silently saved as its base type. Tensor names are
the dotted key paths, keys taken verbatim so module weights keep their usual names
(``model.layer1.weight``, not an escaped ``model.layer1\\.weight``). Where two paths spell the
same name (``{"a.b": x, "a": {"b": y}}`` or ``{0: x, "0": y}``) the later one gets a ``~N``
suffix; the tree, which holds the real keys, maps every name back exactly. Tensors that are
views of the same storage with the same offset, shape and strides (tied weights) are stored
once, under the first path's name, which every later ``$tensor`` node repeats; they come back
as one tensor, shared again.
Objects with ``state_dict()`` are replaced by their state dict at save time; a module state
dict (an OrderedDict carrying ``_metadata``) is stored without the ``_orig_mod.`` prefix of a
``torch.compile`` wrapper, and without any prefix the caller names in ``strip_prefixes``
(``_state_prefixes``).
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch

#: numpy dtypes stored as tensor data, by name; complex128 (which torch cannot store in
#: safetensors here) travels as its float64 pairs.
NP_STORAGE: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.float64,
}

#: default_factory values a defaultdict may have (named by the file, never resolved by import).
FACTORIES: dict[str, type] = {
    t.__name__: t for t in (list, dict, set, frozenset, tuple, int, float, complex, str, bytes, bool)
}

#: torch.dtype by name (from the module's own namespace: a lookup never triggers an import).
TORCH_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}

#: The pathlib classes a ``$path`` node may name.
PATH_TYPES: dict[str, type[pathlib.PurePath]] = {
    "PurePosixPath": pathlib.PurePosixPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
    "PosixPath": pathlib.PosixPath,
}


def spent_closure(*args: Any, **kwargs: Any) -> Any:
    """What a walker's recursive closures are rebound to once the walk ended: their cells no
    longer reach each other, so the closures and all they captured die with the call instead
    of waiting for the cyclic collector (which may be paused, or run on the caller's path)."""
    raise AssertionError("a walker's closure called after its walk ended")
