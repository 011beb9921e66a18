"""The tensor names a structure tree references (to cross-check a shard's header or the
global index), the renaming of tied DTensors' aliases in a tree read back, and what the
encoder's walk gathers of the tensors it names (:class:`TensorFacts`, :func:`distinct_names`)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

#: The safetensors header's own entry: never a tensor's name.
_HEADER_ENTRY = "__metadata__"


class TensorFacts:
    """What ``flatten_parts`` read of each tensor it returned, while the tensor was in the
    CPU's cache: the dtypes and shapes, parallel to the tensors, and whether every one is on
    the CPU (issue 32: a pass of its own over 300,000 tensors costs ~0.3 us a tensor a figure).
    ``expect``: the shapes the last plan had, in the walk's order; a shape equal to its
    counterpart there is recorded as that object (~80 bytes a tensor less than a ``torch.Size``)."""

    __slots__ = ("all_cpu", "dtypes", "expect", "shapes")

    def __init__(self, expect: Sequence[tuple[int, ...]] = ()) -> None:
        self.dtypes: list[torch.dtype] = []
        self.shapes: list[tuple[int, ...]] = []
        self.all_cpu = True
        self.expect = expect


def distinct_names(names: list[str]) -> bool:
    """Whether no two of ``names`` are equal and none is ``"__metadata__"``. Decided by their
    hashes, sorted at C speed; two different names of equal hash (~1e-9 for 300,000 names)
    read as a repeat: False, never a wrong True."""
    hashes = np.fromiter(itertools.chain(map(hash, names), (hash(_HEADER_ENTRY),)), dtype=np.int64,
                         count=len(names) + 1)  # fmt: skip
    hashes.sort()
    return not bool((hashes[1:] == hashes[:-1]).any())


def _containers(node: list[Any]) -> bool:
    """Whether the JSON array ``node`` holds arrays or objects (C speed: the walks over a tree
    skip the millions of scalars of a long list)."""
    return not set(map(type, node)).isdisjoint((list, dict))


def _references(tree: Any, wanted: str) -> list[str]:
    """The names ``tree`` references under tag ``wanted`` (``$tensor`` also counts ndarrays,
    whose data is a tensor of the shard), in one walk that never parses a leaf twice."""
    out: list[str] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            if _containers(node):
                stack.extend(node)
        elif isinstance(node, dict) and len(node) == 1:
            ((tag, val),) = node.items()
            if tag in ("$tensor", "$dtensor"):
                if tag == wanted and isinstance(val, str):
                    out.append(val)
            elif tag == "$ndarray":
                if wanted == "$tensor" and isinstance(val, list) and val and isinstance(val[0], str):
                    out.append(val[0])
            else:
                # every other node's value may hold nodes ($dict items, $param, $generator, ...)
                stack.append(val)
    return out


def resolve_dtensor_aliases(tree: Any, aliases: Mapping[str, str]) -> Any:
    """Rename, in place, every ``{"$dtensor": alias}`` node of ``tree`` (a tree read back,
    owned by the caller) to the name the index stores it under (``flatten``'s
    ``dtensor_aliases``); returns ``tree``."""
    if not aliases:
        return tree
    stack = [tree]
    while stack:  # iterative: a tree may be MAX_DEPTH containers deep
        node = stack.pop()
        if isinstance(node, list):
            if _containers(node):
                stack.extend(node)
        elif isinstance(node, dict) and len(node) == 1:
            ((tag, val),) = node.items()
            if tag == "$dtensor":
                if isinstance(val, str) and val in aliases:
                    node[tag] = aliases[val]
            elif tag != "$tensor":
                stack.append(val)
    return tree


def tensor_names(tree: Any) -> list[str]:
    """All tensor names referenced by ``tree`` (used to cross-check a shard header)."""
    return _references(tree, "$tensor")


def dtensor_names(tree: Any) -> list[str]:
    """All ``{"$dtensor": name}`` names referenced by ``tree``."""
    return _references(tree, "$dtensor")
