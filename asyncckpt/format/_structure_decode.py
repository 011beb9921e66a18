"""Decode a structure tree (the tagged JSON nodes of :mod:`~asyncckpt.format._structure_nodes`)
and its loaded tensors back into the state it was made from: :func:`unflatten`, which checks
every node and never imports or calls anything the file names."""

from __future__ import annotations

import base64
import collections
import datetime
import functools
import math
import zoneinfo
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from ._bounds import MAX_DEPTH, recursion_room
from ._header import TensorSlot
from ._safetensors import ST_TO_DTYPE
from ._structure_nodes import FACTORIES, NP_STORAGE, PATH_TYPES, TORCH_DTYPES, spent_closure

#: The values json.loads makes of JSON scalars.
_JSON_SCALARS = (int, float, str, bool, type(None))


def _dec_tz(node: Any) -> datetime.tzinfo | None:
    if node is None:
        return None
    if isinstance(node, list) and len(node) == 3 and node[0] == "fixed":
        off = node[1]
        if not (isinstance(off, list) and len(off) == 3 and all(type(x) is int for x in off)):
            raise ValueError("malformed tz offset")
        delta = datetime.timedelta(days=off[0], seconds=off[1], microseconds=off[2])
        if node[2] is None:
            return datetime.timezone(delta)
        if not isinstance(node[2], str):
            raise ValueError("malformed tz name")
        return datetime.timezone(delta, node[2])
    if isinstance(node, list) and len(node) == 2 and node[0] == "zone" and isinstance(node[1], str):
        try:
            return zoneinfo.ZoneInfo(node[1])
        except (zoneinfo.ZoneInfoNotFoundError, ValueError) as e:
            raise ValueError(f"unknown time zone {node[1]!r} ({e})") from None
    raise ValueError("malformed tz")


class ValueStandIn(NamedTuple):
    """A skeleton's stand-in for a value the state rebuilds from a saved tensor but that is no
    tensor itself: a numpy array (``kind`` ``np.ndarray``, with its ``dtype`` and ``shape``)
    or a ``torch.Generator`` (``dtype`` and ``shape`` ``None``); ``tensor`` is the tensor's own
    stand-in. The load reads no target in place of such a tensor (the loaded state holds the
    value, not the tensor, and only the value meets the target): so no caller's object ever
    reaches a node that inspects its tensor, and a node's failure is the file's alone."""

    kind: type
    tensor: Any
    dtype: np.dtype[Any] | None = None
    shape: tuple[int, ...] | None = None


def _array_from(t: torch.Tensor | TensorSlot, dtype: Any, shape: Any) -> Any:
    """The ndarray a ``$ndarray`` node names, checked against its tensor (or, for its
    stand-in, a :class:`ValueStandIn`)."""
    if not isinstance(dtype, str) or dtype not in NP_STORAGE:
        raise ValueError(f"malformed $ndarray dtype {dtype!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise ValueError("malformed $ndarray shape")
    want = math.prod(shape) * (2 if dtype == "complex128" else 1)
    if type(t) is TensorSlot:
        have_dtype, have = ST_TO_DTYPE[t.dtype], math.prod(t.shape)
    else:
        assert isinstance(t, torch.Tensor)
        have_dtype, have = t.dtype, t.numel()
    if have_dtype != NP_STORAGE[dtype] or have != want:
        raise ValueError(f"$ndarray of {dtype}{shape} disagrees with its tensor ({have_dtype}, {have} elements)")
    if not isinstance(t, torch.Tensor) or t.is_meta:  # a structure check with stand-ins: nothing to convert
        return ValueStandIn(np.ndarray, t, np.dtype(dtype), tuple(shape))
    a = t.contiguous().numpy()
    if dtype == "complex128":
        a = a.reshape(-1).view(np.complex128)
    return a.reshape(shape)


def _dec_float(v: Any) -> float:
    if type(v) in (int, float):
        return float(v)
    if isinstance(v, dict) and len(v) == 1 and v.get("$float") in ("nan", "inf", "-inf"):
        return float(v["$float"])
    if type(v) is tuple and len(v) == 2 and v[0] == "$float" and v[1] in ("nan", "inf", "-inf"):
        return float(v[1])  # (compact_node's)
    raise ValueError("malformed float")


def compact_node(node: dict[str, Any]) -> Any:
    """``json.loads``' ``object_hook`` for a tree only :func:`unflatten` reads: a tag node
    ``{tag: val}`` becomes the tuple ``(tag, val)``, 56 bytes instead of a dict's 232, and a
    ``{"$tensor": name}`` node the 1-tuple ``(name,)`` (JSON makes no tuples: in a tree a
    tuple is one of these); anything else stays as it is (and is refused as before)."""
    if len(node) == 1:
        ((tag, val),) = node.items()
        return (val,) if tag == "$tensor" and type(val) is str else (tag, val)
    return node


def resolving_node(tensors: Mapping[str, torch.Tensor], resolved: list[torch.Tensor]) -> Callable[[Any], Any]:
    """:func:`compact_node` that also puts in place of a ``{"$tensor": name}`` node whose name
    ``tensors`` holds that tensor itself (appended to ``resolved``): the tree then holds no
    name of its own for it (for the load that rebuilds the state straight from the parse)."""

    def hook(node: dict[str, Any]) -> Any:
        if len(node) == 1:
            ((tag, val),) = node.items()
            if tag == "$tensor" and type(val) is str:
                t = tensors.get(val)
                if t is None:
                    return (val,)
                resolved.append(t)
                return t
            return (tag, val)
        return node

    return hook


class UnknownTensorError(ValueError):
    """A tree node names a tensor that the mapping given to :func:`unflatten` lacks."""


class StandInSites:
    """Where the stand-ins of a skeleton :func:`unflatten` built sit (its ``sites``
    argument): ``maps``, each mapping of the skeleton that holds a stand-in as one of its own
    values, and ``elsewhere``, whether any stand-in sits anywhere else (in a list or a tuple,
    or taken by a ``$param``, ``$ndarray``, ``$generator`` or ``$dtensor`` node). When
    ``elsewhere`` is false, :func:`fill_in` makes the skeleton the state itself."""

    __slots__ = ("elsewhere", "maps")

    def __init__(self) -> None:
        self.maps: list[dict[Any, Any]] = []
        self.elsewhere = False


def fill_in(sites: StandInSites, tensors: Mapping[str, Any]) -> None:
    """Put in place of each :class:`TensorSlot` stand-in among the values of ``sites.maps``
    the tensor of ``tensors`` of its name (``KeyError`` for a name it lacks). On a skeleton
    whose stand-ins sit in those maps only (not ``sites.elsewhere``: refused with
    ``ValueError``), the skeleton then is exactly the state :func:`unflatten` builds of the
    same tree over ``tensors``: every other node's value depends on the tree alone. One pass
    over the maps' values: no second decode of the tree (issue 32)."""
    if sites.elsewhere:
        raise ValueError("stand-ins outside the skeleton's mappings: decode the tree over the tensors")
    for m in sites.maps:
        # (a value replaced under an existing key: the mapping's size and order stay)
        for k, v in m.items():
            if type(v) is TensorSlot:
                m[k] = tensors[v.name]


def unflatten(
    tree: Any,
    tensors: Mapping[str, Any],
    named: list[str] | None = None,
    consume: bool = False,
    sites: StandInSites | None = None,
) -> Any:
    """Rebuild the state encoded by :func:`flatten` from its tree and loaded tensors.

    ``tensors`` maps a name to its tensor, or to a *stand-in* for it: its shard slot
    (:class:`~asyncckpt.format._header.TensorSlot`, checked as a tensor of its dtype and
    shape would be), or a ``meta`` tensor. The state rebuilt over stand-ins is a skeleton
    holding the stand-ins where the tensors would be (a ``Parameter``: the stand-in itself;
    an ndarray or a generator: a :class:`ValueStandIn`), each node checked as for the real load.
    A tree parsed with :func:`compact_node` or :func:`resolving_node` is read as the same
    tree (the tensors the latter put in place as they are).
    ``consume``: the tree's containers are emptied as they are decoded, so its memory goes as
    the state's comes (the tree is of no use afterwards; an error leaves it partly emptied).

    Raises ``ValueError`` on any malformed node (the loader turns it into
    ``CheckpointCorruptError``); :class:`UnknownTensorError`, a ``ValueError``, for a node
    naming a tensor ``tensors`` lacks; and ``RuntimeError`` for a ``torch.Generator`` whose
    device this machine cannot create. With ``named``, every name the tree references as
    :func:`tensor_names` lists it (``$tensor`` and ``$ndarray`` nodes, not ``$dtensor``) is
    appended to it as it is decoded: a caller that compares the names with a shard's needs
    no second walk of the tree. ``sites`` (fresh): filled with where the result's tensors sit
    (:class:`StandInSites`), for :func:`fill_in`.
    """
    note = named.append if named is not None else None
    held = sites.maps.append if sites is not None else None
    # one str object per distinct key: the state's many dicts of the same keys (an optimizer's
    # "exp_avg" per parameter) share them instead of each holding the copy JSON made
    same_key = dict[str, str]().setdefault

    def tensor(val: Any) -> Any:
        t = tensors.get(val) if type(val) is str else None
        if t is None:
            raise UnknownTensorError(f"tree names a tensor the shard lacks: {val!r}")
        if sites is not None:  # (the inline paths of items do not come here: a tensor elsewhere)
            sites.elsewhere = True
        return t

    def items(val: Any, depth: int, make: Callable[[list[tuple[Any, Any]]], Any] = dict) -> Any:
        """``make`` of the decoded items of ``val`` (noted in ``sites`` if one is a tensor)."""
        if type(val) is not list:
            raise ValueError("malformed mapping items")
        out = []
        has_tensor = False
        inner = depth + 1
        shallow = inner <= MAX_DEPTH  # (a tensor node one level down is not too deep)
        get = tensors.get
        if consume:  # taken from the end, in order: each item is freed once decoded
            val.reverse()
            pop = val.pop
            it: Any = (pop() for _ in range(len(val)))
        else:
            it = val
        for item in it:
            if not (type(item) is list and len(item) == 2):
                raise ValueError("malformed mapping item")
            k, v = item
            tk = type(k)  # (json makes no subclasses; a bool key is refused)
            if tk is str:
                k = same_key(k, k)
            elif tk is not int:
                raise ValueError("malformed mapping key")
            # the common value of a state dict, a plain tensor node, without dec's dispatch
            tv = type(v)
            if tv is tuple and len(v) == 1 and shallow:  # (compact_node's)
                name = v[0]
                t = get(name) if type(name) is str else None  # (tensor(name), inline)
                out.append((k, t if t is not None else tensor(name)))
                has_tensor = True
                if note is not None:
                    note(name)
            elif tv is torch.Tensor and shallow:  # (resolving_node's)
                out.append((k, v))
            elif tv is dict and len(v) == 1 and type(name := v.get("$tensor")) is str and shallow:
                t = get(name)
                out.append((k, t if t is not None else tensor(name)))
                has_tensor = True
                if note is not None:
                    note(name)
            else:
                out.append((k, dec(v, inner)))
        made = make(out)
        if has_tensor and held is not None:
            held(made)
        return made

    def listed(val: Any, what: str) -> list[Any]:
        if not isinstance(val, list):
            raise ValueError(f"malformed {what}")
        return val

    def dec(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"tree nested deeper than {MAX_DEPTH} levels")
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if type(node) is tuple:  # compact_node's (tag, val) and (name,)
            if len(node) == 2:
                tag, val = node
            elif len(node) == 1:
                tag, val = "$tensor", node[0]
            else:
                raise ValueError(f"malformed node of {len(node)} values")
            decode = _DECODERS.get(tag)
            if decode is None:
                raise ValueError(f"unknown tag {tag!r}")
            return decode(val, depth)
        if type(node) is torch.Tensor:  # resolving_node's
            return node
        if isinstance(node, list):
            if node and depth >= MAX_DEPTH:
                raise ValueError(f"tree nested deeper than {MAX_DEPTH} levels")
            # JSON scalars are their own values: a list of 9M ints is not decoded value by value
            return [v if type(v) in _JSON_SCALARS else dec(v, depth + 1) for v in node]
        if not isinstance(node, dict) or len(node) != 1:
            raise ValueError(f"malformed node {type(node).__name__}")
        ((tag, val),) = node.items()
        decode = _DECODERS.get(tag)
        if decode is None:
            raise ValueError(f"unknown tag {tag!r}")
        return decode(val, depth)

    def d_dict(val: Any, depth: int) -> Any:
        return items(val, depth)

    def d_tuple(val: Any, depth: int) -> Any:
        return tuple(dec(v, depth + 1) for v in listed(val, "$tuple"))

    def d_tensor(val: Any, depth: int) -> Any:
        t = tensor(val)
        if note is not None:
            note(val)
        return t

    def d_dtensor(val: Any, depth: int) -> Any:
        return tensor(val)

    def d_float(val: Any, depth: int) -> Any:
        if val not in ("nan", "inf", "-inf"):
            raise ValueError("malformed $float")
        return float(val)

    def d_bytes(val: Any, depth: int) -> Any:
        if not isinstance(val, str):
            raise ValueError("malformed $bytes")
        return base64.b64decode(val.encode("ascii"), validate=True)

    def d_bytearray(val: Any, depth: int) -> Any:
        return bytearray(d_bytes(val, depth))

    def d_odict(val: Any, depth: int) -> Any:
        val = listed(val, "$odict")
        if len(val) != 2:
            raise ValueError("malformed $odict")
        out: collections.OrderedDict[Any, Any] = items(val[0], depth, collections.OrderedDict)
        if val[1] is not None:
            meta = dec(val[1], depth + 1)
            if not isinstance(meta, dict):
                raise ValueError("malformed $odict metadata")
            out._metadata = meta  # type: ignore[attr-defined]
        return out

    def d_defaultdict(val: Any, depth: int) -> Any:
        val = listed(val, "$defaultdict")
        if len(val) != 2 or not (val[0] is None or val[0] in FACTORIES):
            raise ValueError("malformed $defaultdict")
        factory: Callable[[], Any] | None = None if val[0] is None else FACTORIES[val[0]]
        return items(val[1], depth, functools.partial(collections.defaultdict, factory))

    def d_param(val: Any, depth: int) -> Any:
        val = listed(val, "$param")
        if len(val) != 2 or not isinstance(val[1], bool):
            raise ValueError("malformed $param")
        t = dec(val[0], depth + 1)
        if type(t) is TensorSlot:
            return t  # a stand-in's skeleton
        if isinstance(t, torch.nn.Parameter):
            return t  # a load(into=) target read in place: the caller's own Parameter
        if type(t) is not torch.Tensor:
            raise ValueError("malformed $param tensor")
        if t.is_meta:
            return t
        return torch.nn.Parameter(t, requires_grad=val[1])

    def d_ndarray(val: Any, depth: int) -> Any:
        val = listed(val, "$ndarray")
        if len(val) != 3:
            raise ValueError("malformed $ndarray")
        t = tensor(val[0])
        if note is not None:
            note(val[0])
        return _array_from(t, val[1], val[2])

    def d_np(val: Any, depth: int) -> Any:
        val = listed(val, "$np")
        if len(val) != 2 or val[0] not in NP_STORAGE:
            raise ValueError("malformed $np")
        v = dec(val[1], depth + 1)
        if type(v) not in (bool, int, float, complex):
            raise ValueError("malformed $np value")
        try:
            return np.dtype(val[0]).type(v)
        except (OverflowError, TypeError) as e:
            raise ValueError(f"malformed $np value ({e})") from None

    def d_complex(val: Any, depth: int) -> Any:
        val = listed(val, "$complex")
        if len(val) != 2:
            raise ValueError("malformed $complex")
        return complex(_dec_float(val[0]), _dec_float(val[1]))

    def d_set(val: Any, depth: int) -> Any:
        try:
            return {dec(v, depth + 1) for v in listed(val, "$set")}
        except TypeError as e:
            raise ValueError(f"malformed $set element ({e})") from None

    def d_frozenset(val: Any, depth: int) -> Any:
        return frozenset(d_set(val, depth))

    def d_size(val: Any, depth: int) -> Any:
        if not all(type(d) is int and d >= 0 for d in listed(val, "$size")):
            raise ValueError("malformed $size")
        return torch.Size(val)

    def d_dtype(val: Any, depth: int) -> Any:
        dt = TORCH_DTYPES.get(val) if isinstance(val, str) else None
        if dt is None:
            raise ValueError(f"malformed $dtype {val!r}")
        return dt

    def d_device(val: Any, depth: int) -> Any:
        if not isinstance(val, str) or len(val) > 64:
            raise ValueError("malformed $device")
        try:
            return torch.device(val)
        except RuntimeError as e:
            raise ValueError(f"malformed $device ({e})") from None

    def d_generator(val: Any, depth: int) -> Any:
        val = listed(val, "$generator")
        if len(val) != 2:
            raise ValueError("malformed $generator")
        device = d_device(val[0], depth)
        state = dec(val[1], depth + 1)
        if type(state) is TensorSlot:
            if state.dtype != "U8":
                raise ValueError("malformed $generator state")
            return ValueStandIn(torch.Generator, state)  # a stand-in's skeleton
        if type(state) is not torch.Tensor or state.dtype != torch.uint8:
            raise ValueError("malformed $generator state")
        if state.is_meta:
            return ValueStandIn(torch.Generator, state)
        try:
            g = torch.Generator(device=device)
        except RuntimeError as e:
            raise RuntimeError(f"checkpoint holds a torch.Generator on {device}, which this machine lacks: {e}") from e
        try:
            g.set_state(state)
        except RuntimeError as e:
            raise ValueError(f"malformed $generator state ({e})") from None
        return g

    def d_path(val: Any, depth: int) -> Any:
        val = listed(val, "$path")
        if len(val) != 2 or val[0] not in PATH_TYPES or not isinstance(val[1], str):
            raise ValueError("malformed $path")
        return PATH_TYPES[val[0]](val[1])

    def d_date(val: Any, depth: int) -> Any:
        if not isinstance(val, str):
            raise ValueError("malformed $date")
        return datetime.date.fromisoformat(val)

    def d_timedelta(val: Any, depth: int) -> Any:
        val = listed(val, "$timedelta")
        if len(val) != 3 or not all(type(x) is int for x in val):
            raise ValueError("malformed $timedelta")
        try:
            return datetime.timedelta(days=val[0], seconds=val[1], microseconds=val[2])
        except OverflowError as e:
            raise ValueError(f"malformed $timedelta ({e})") from None

    def d_datetime(val: Any, depth: int) -> Any:
        val = listed(val, "$datetime")
        if len(val) != 3 or not isinstance(val[0], str) or val[1] not in (0, 1) or isinstance(val[1], bool):
            raise ValueError("malformed $datetime")
        naive = datetime.datetime.fromisoformat(val[0])
        if naive.tzinfo is not None:
            raise ValueError("malformed $datetime")
        return naive.replace(tzinfo=_dec_tz(val[2]), fold=val[1])

    _DECODERS: dict[str, Callable[[Any, int], Any]] = {
        "$dict": d_dict,
        "$tuple": d_tuple,
        "$tensor": d_tensor,
        "$dtensor": d_dtensor,
        "$float": d_float,
        "$bytes": d_bytes,
        "$bytearray": d_bytearray,
        "$odict": d_odict,
        "$defaultdict": d_defaultdict,
        "$param": d_param,
        "$ndarray": d_ndarray,
        "$np": d_np,
        "$complex": d_complex,
        "$set": d_set,
        "$frozenset": d_frozenset,
        "$size": d_size,
        "$dtype": d_dtype,
        "$device": d_device,
        "$generator": d_generator,
        "$path": d_path,
        "$date": d_date,
        "$timedelta": d_timedelta,
        "$datetime": d_datetime,
    }

    try:
        with recursion_room():
            return dec(tree, 0)
    finally:
        # the decoders reach each other through dec and _DECODERS: a reference cycle that
        # would keep ``tensors`` alive until a collection ran (see flatten)
        dec = spent_closure
        _DECODERS = {}
