"""Turn a nested training state into (JSON tree, named tensors) and back.

The tree is plain JSON in which every object is a one-key tagged node, so decoding is
unambiguous and needs no pickle:

    {"$dict": [[key, node], ...]}   key is a str or an int (optimizer state uses ints)
    {"$tuple": [node, ...]}         lists stay JSON arrays
    {"$tensor": "model.layer1.weight"}
    {"$float": "nan" | "inf" | "-inf"}
    {"$bytes": "<base64>"}

ints, finite floats, bools, str and None are JSON scalars (JSON keeps int/float/bool apart).
Tensor names are the dotted key paths, keys taken verbatim so module weights keep their usual
names (``model.layer1.weight``, not an escaped ``model.layer1\\.weight``). Where two paths
spell the same name (``{"a.b": x, "a": {"b": y}}`` or ``{0: x, "0": y}``) the later one gets a
``~N`` suffix; the tree, which holds the real keys, maps every name back exactly.
Objects with ``state_dict()`` are replaced by their state dict at save time.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._format import DTYPE_TO_ST

#: Decoding refuses trees deeper than this (hostile files must not exhaust the stack).
MAX_DEPTH = 200


@dataclass(frozen=True)
class TensorRef:
    """One tensor of a flattened state: its unique name and the live source tensor."""

    name: str
    tensor: torch.Tensor


def _describe(path: tuple[str, ...]) -> str:
    return ".".join(path) if path else "<root>"


def _check_tensor(t: torch.Tensor, path: tuple[str, ...]) -> None:
    where = _describe(path)
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"unsupported tensor subclass {type(t).__name__} at {where!r}")
    if t.layout != torch.strided:
        raise TypeError(f"unsupported tensor layout {t.layout} at {where!r} (only dense tensors)")
    if t.is_meta:
        raise TypeError(f"meta tensor at {where!r} has no data to save")
    if t.is_quantized or t.is_nested:
        raise TypeError(f"quantized or nested tensor at {where!r} is not supported")
    if t.dtype not in DTYPE_TO_ST:
        raise TypeError(f"unsupported dtype {t.dtype} at {where!r}")


def flatten(state: Any) -> tuple[Any, list[TensorRef]]:
    """Encode ``state`` as a JSON tree plus its tensors, in deterministic order.

    Raises ``TypeError`` naming the key path of the first unsupported object, and
    ``ValueError`` for a reference cycle. Calls ``state_dict()`` on stateful objects.
    """
    tensors: list[TensorRef] = []
    used: set[str] = set()
    active: set[int] = set()

    def unique(path: tuple[str, ...]) -> str:
        base = ".".join(path) if path else "_"
        name, n = base, 1
        while name in used:
            n += 1
            name = f"{base}~{n}"
        used.add(name)
        return name

    def enc(obj: Any, path: tuple[str, ...]) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            if math.isfinite(obj):
                return float(obj)
            return {"$float": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
        if isinstance(obj, torch.Tensor):
            _check_tensor(obj, path)
            name = unique(path)
            tensors.append(TensorRef(name, obj.detach()))
            return {"$tensor": name}
        if isinstance(obj, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(obj)).decode("ascii")}
        if len(path) > MAX_DEPTH:
            raise ValueError(f"state is nested deeper than {MAX_DEPTH} levels at {_describe(path)!r}")
        if id(obj) in active:
            raise ValueError(f"reference cycle in state at {_describe(path)!r}")
        active.add(id(obj))
        try:
            if isinstance(obj, Mapping):
                items = []
                for k, v in obj.items():
                    if isinstance(k, bool) or not isinstance(k, (str, int)):
                        raise TypeError(
                            f"unsupported dict key {k!r} ({type(k).__name__}) at "
                            f"{_describe(path)!r}: keys must be str or int"
                        )
                    comp = k if isinstance(k, str) else str(int(k))
                    items.append([k if isinstance(k, str) else int(k), enc(v, (*path, comp))])
                return {"$dict": items}
            if isinstance(obj, list):
                return [enc(v, (*path, str(i))) for i, v in enumerate(obj)]
            if isinstance(obj, tuple):
                return {"$tuple": [enc(v, (*path, str(i))) for i, v in enumerate(obj)]}
            state_dict = getattr(obj, "state_dict", None)
            if callable(state_dict) and callable(getattr(obj, "load_state_dict", None)):
                return enc(state_dict(), path)
        finally:
            active.discard(id(obj))
        raise TypeError(
            f"unsupported object of type {type(obj).__module__}.{type(obj).__qualname__} at "
            f"{_describe(path)!r}: save tensors, numbers, str, None, bytes, dict/list/tuple, or "
            "objects with state_dict()/load_state_dict()"
        )

    tree = enc(state, ())
    return tree, tensors


def unflatten(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild the state encoded by :func:`flatten` from its tree and loaded tensors.

    Raises ``ValueError`` on any malformed node (the loader turns it into
    ``CheckpointCorruptError``).
    """

    def dec(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"tree nested deeper than {MAX_DEPTH} levels")
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [dec(v, depth + 1) for v in node]
        if not isinstance(node, dict) or len(node) != 1:
            raise ValueError(f"malformed node {type(node).__name__}")
        ((tag, val),) = node.items()
        if tag == "$dict":
            if not isinstance(val, list):
                raise ValueError("malformed $dict")
            out: dict[Any, Any] = {}
            for item in val:
                if not (isinstance(item, list) and len(item) == 2):
                    raise ValueError("malformed $dict item")
                k, v = item
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise ValueError("malformed $dict key")
                out[k] = dec(v, depth + 1)
            return out
        if tag == "$tuple":
            if not isinstance(val, list):
                raise ValueError("malformed $tuple")
            return tuple(dec(v, depth + 1) for v in val)
        if tag == "$tensor":
            if not isinstance(val, str) or val not in tensors:
                raise ValueError(f"tree names a tensor the shard lacks: {val!r}")
            return tensors[val]
        if tag == "$float":
            if val not in ("nan", "inf", "-inf"):
                raise ValueError("malformed $float")
            return float(val)
        if tag == "$bytes":
            if not isinstance(val, str):
                raise ValueError("malformed $bytes")
            return base64.b64decode(val.encode("ascii"), validate=True)
        raise ValueError(f"unknown tag {tag!r}")

    return dec(tree, 0)


def tensor_names(tree: Any) -> list[str]:
    """All tensor names referenced by ``tree`` (used to cross-check a shard header)."""
    out: list[str] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict) and len(node) == 1:
            ((tag, val),) = node.items()
            if tag == "$tensor" and isinstance(val, str):
                out.append(val)
            elif tag == "$dict" and isinstance(val, list):
                stack.extend(item[1] for item in val if isinstance(item, list) and len(item) == 2)
            elif tag == "$tuple" and isinstance(val, list):
                stack.extend(val)
    return out
