"""The key tree one rank saved, as the command line shows it (``asyncckpt info``): each key
with its kind (a tensor with dtype, shape and bytes, a DTensor, a value, a container), from
the structure file's tree and the shard's tensor slots. Pure: no I/O, no torch, no unpickling.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._errors import CheckpointCorruptError
from ._bounds import MAX_DEPTH, recursion_room
from ._gcpause import paused_gc
from ._header import TORCH_NAME, TensorSlot

#: Tags this module decodes itself; any other ``$tag`` node is shown as stored.
_CORE_TAGS = frozenset({"$dict", "$tuple", "$tensor", "$float", "$bytes"})

#: Tags of single values (see asyncckpt.format._structure_nodes), shown as their tag and JSON.
_VALUE_TAGS = frozenset(
    "$np $complex $bytearray $size $dtype $device $generator $path $date $timedelta $datetime".split()
)


@dataclass(frozen=True)
class Entry:
    """One node of a rank's key tree: its key path and what is stored there.

    ``kind`` is ``tensor`` (``dtype``/``shape``/``nbytes`` set), ``value`` (a JSON scalar in
    ``value``), ``bytes`` (``nbytes`` set), ``generator`` (a ``torch.Generator``: its device
    in ``value``, its state tensor's ``dtype``/``shape``/``nbytes``), ``dict``/``list``/``tuple``
    (``length`` set), or the tag of another stored type (``odict``, ``ndarray``, ...; its raw ``value``).
    ``scalars`` is true for a container whose children are all plain values (an RNG state,
    a list of numbers) so a display may abbreviate it.
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
    scalars: bool = False

    def as_json(self) -> dict[str, Any]:
        """The entry as a JSON-ready dict (non-finite floats become strings)."""
        out: dict[str, Any] = {"path": list(self.path), "kind": self.kind}
        if self.kind == "tensor":
            out.update(dtype=self.dtype, shape=list(self.shape or ()), nbytes=self.nbytes)
        elif self.kind == "bytes":
            out["nbytes"] = self.nbytes
        elif self.kind == "generator":
            out.update(device=self.value, state={"dtype": self.dtype, "shape": list(self.shape or ()),
                                                 "nbytes": self.nbytes})
        elif self.kind == "value":
            v = self.value
            out["type"] = type(v).__name__
            out["value"] = repr(v) if isinstance(v, float) and not math.isfinite(v) else v
        elif self.length is not None:
            out["length"] = self.length
        else:
            out["value"] = self.value
        return out


def _key_label(key: Any) -> str:
    if isinstance(key, str) and key and key.isprintable() and key == key.strip():
        return key
    return repr(key)


def _is_scalar_node(node: Any) -> bool:
    return node is None or isinstance(node, (bool, int, float, str))


#: The types json.loads gives JSON scalars (what :func:`_is_scalar_node` accepts).
_SCALAR_TYPES = frozenset({type(None), bool, int, float, str})
_third = operator.itemgetter(2)


def _tensor_refs(node: Any) -> Iterator[str]:
    """Names of the ``{"$tensor": name}`` nodes anywhere under ``node`` (iterative)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, list):
            stack.extend(n)
        elif isinstance(n, dict):
            if len(n) == 1 and isinstance(n.get("$tensor"), str):
                yield n["$tensor"]
            else:
                stack.extend(n.values())


def outline_entries(
    tree: Any, slots: dict[str, TensorSlot], path_for_errors: str, dtensors: list[str] | None = None
) -> tuple[list[Entry], list[str]]:
    """Entries, and the tensors the tree names that ``slots`` lacks. With ``dtensors`` (a
    list, filled here) the ``$dtensor`` nodes' names are collected in it (their chunk, if this
    rank wrote one, is in its shard); without, a ``$dtensor`` node is shown as stored."""
    out: list[Entry] = []
    missing: list[str] = []

    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(what, path_for_errors)

    def walk(node: Any, path: tuple[str | int, ...], label: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise bad(f"structure nested deeper than {MAX_DEPTH} levels")
        if _is_scalar_node(node):
            out.append(Entry(path, depth, label, "value", value=node))
            return
        children: list[tuple[str | int, str, Any]]
        if isinstance(node, list):
            kind, children = "list", [(i, f"[{i}]", v) for i, v in enumerate(node)]
        elif isinstance(node, dict) and len(node) == 1:
            ((tag, val),) = node.items()
            if tag == "$dict" and isinstance(val, list):
                kind, children = "dict", []
                for item in val:
                    ok = isinstance(item, list) and len(item) == 2
                    if not ok or isinstance(item[0], bool) or not isinstance(item[0], (str, int)):
                        raise bad("malformed $dict item in the structure")
                    children.append((item[0], _key_label(item[0]), item[1]))
            elif tag == "$tuple" and isinstance(val, list):
                kind, children = "tuple", [(i, f"[{i}]", v) for i, v in enumerate(val)]
            elif tag in ("$odict", "$defaultdict") and isinstance(val, list) and len(val) == 2:
                # shown as the dict they hold (see asyncckpt.format._structure_nodes for the node shapes)
                walk({"$dict": val[0] if tag == "$odict" else val[1]}, path, label, depth)
                return
            elif tag in ("$set", "$frozenset") and isinstance(val, list):
                kind, children = tag[1:], [(i, f"[{i}]", v) for i, v in enumerate(val)]
            elif tag == "$param" and isinstance(val, list) and len(val) == 2:
                walk(val[0], path, label, depth)
                return
            elif (
                tag == "$ndarray"
                and isinstance(val, list)
                and len(val) == 3
                and isinstance(val[0], str)
                and isinstance(val[1], str)
                and isinstance(val[2], list)
            ):
                s = slots.get(val[0])
                if s is None:
                    missing.append(val[0])
                    return
                out.append(Entry(path, depth, label, "tensor", f"numpy.{val[1]}", tuple(val[2]), s.end - s.begin))
                return
            elif (
                tag == "$generator"
                and isinstance(val, list)
                and len(val) == 2
                and isinstance(val[0], str)
                and isinstance(val[1], dict)
                and list(val[1]) == ["$tensor"]
                and isinstance(val[1]["$tensor"], str)
            ):
                # a torch.Generator: its device, and its state (a tensor of the shard)
                name = val[1]["$tensor"]
                s = slots.get(name)
                if s is None:
                    missing.append(name)
                    return
                out.append(Entry(path, depth, label, "generator", TORCH_NAME[s.dtype], s.shape, s.end - s.begin,
                                 value=val[0]))
                return
            elif tag in _VALUE_TAGS:
                # numpy scalars, complex, torch.Size/dtype/device, paths, datetimes (and a
                # $generator of another shape); the tensors they refer to are in the shard
                for ref in _tensor_refs(val):
                    if ref not in slots:
                        missing.append(ref)
                out.append(Entry(path, depth, label, "value", value=f"{tag[1:]}({json.dumps(val)[:200]})"))
                return
            elif tag == "$tensor" and isinstance(val, str):
                s = slots.get(val)
                if s is None:
                    missing.append(val)
                    return
                out.append(Entry(path, depth, label, "tensor", TORCH_NAME[s.dtype], s.shape, s.end - s.begin))
                return
            elif tag == "$dtensor" and isinstance(val, str) and dtensors is not None:
                dtensors.append(val)
                out.append(Entry(path, depth, label, "dtensor", value=val))
                return
            elif tag == "$float" and val in ("nan", "inf", "-inf"):
                out.append(Entry(path, depth, label, "value", value=float(val)))
                return
            elif tag == "$bytes" and isinstance(val, str):
                try:
                    n = len(base64.b64decode(val.encode("ascii"), validate=True))
                except (ValueError, binascii.Error):
                    raise bad("malformed $bytes in the structure") from None
                out.append(Entry(path, depth, label, "bytes", nbytes=n))
                return
            elif isinstance(tag, str) and tag.startswith("$") and tag not in _CORE_TAGS:
                # another stored type (OrderedDict, numpy, datetime, ...): shown as stored; the
                # tensors it refers to still have to be in the shard
                missing.extend(r for r in _tensor_refs(val) if r not in slots)
                out.append(Entry(path, depth, label, tag[1:], value=val))
                return
            else:
                raise bad(f"malformed {tag!r} node in the structure at {'.'.join(map(str, path)) or '<root>'}")
        else:
            raise bad(f"malformed node in the structure at {'.'.join(map(str, path)) or '<root>'}")
        scalars = bool(children) and set(map(type, map(_third, children))) <= _SCALAR_TYPES
        if depth >= 0:
            out.append(Entry(path, depth, label, kind, length=len(children), scalars=scalars))
        if scalars and depth < MAX_DEPTH:
            # plain values (a sampler's permutation of 9M ints): their lines without a walk each
            d = depth + 1
            out.extend([Entry((*path, key), d, lbl, "value", None, None, None, v) for key, lbl, v in children])
            return
        for key, child_label, child in children:
            walk(child, (*path, key), child_label, depth + 1)

    is_root_dict = isinstance(tree, dict) and len(tree) == 1 and "$dict" in tree
    with paused_gc(), recursion_room():  # one Entry per value: GC would traverse them all, repeatedly
        walk(tree, (), "<root>", -1 if is_root_dict else 0)
    return out, missing


def outline(tree: Any, slots: dict[str, TensorSlot]) -> list[Entry]:
    """Walk a structure tree depth-first into :class:`Entry` lines, in saved order.

    A dict at the top level is shown by its keys (no line for the root itself). Raises
    ``CheckpointCorruptError`` on a malformed node or a tensor the shard lacks.
    """
    entries, missing = outline_entries(tree, slots, "<structure>")
    if missing:
        raise CheckpointCorruptError(f"structure names tensor(s) the shard lacks: {', '.join(missing[:5])}")
    return entries
