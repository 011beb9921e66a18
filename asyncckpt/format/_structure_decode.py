"""Decode a structure tree (the tagged JSON nodes of :mod:`~asyncckpt.format._structure_nodes`)
and its loaded tensors back into the state it was made from: :func:`unflatten`, which checks
every node and never imports or calls anything the file names."""

from __future__ import annotations

import base64
import collections
import datetime
import math
import zoneinfo
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ._bounds import MAX_DEPTH, recursion_room
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


def _array_from(t: torch.Tensor, dtype: Any, shape: Any) -> Any:
    """The ndarray a ``$ndarray`` node names, checked against its tensor."""
    if not isinstance(dtype, str) or dtype not in NP_STORAGE:
        raise ValueError(f"malformed $ndarray dtype {dtype!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise ValueError("malformed $ndarray shape")
    want = math.prod(shape) * (2 if dtype == "complex128" else 1)
    if t.dtype != NP_STORAGE[dtype] or t.numel() != want:
        raise ValueError(f"$ndarray of {dtype}{shape} disagrees with its tensor ({t.dtype}, {t.numel()} elements)")
    if t.is_meta:  # a structure check (verify) with placeholder tensors: nothing to convert
        return t
    a = t.contiguous().numpy()
    if dtype == "complex128":
        a = a.reshape(-1).view(np.complex128)
    return a.reshape(shape)


def _dec_float(v: Any) -> float:
    if type(v) in (int, float):
        return float(v)
    if isinstance(v, dict) and len(v) == 1 and v.get("$float") in ("nan", "inf", "-inf"):
        return float(v["$float"])
    raise ValueError("malformed float")


class UnknownTensorError(ValueError):
    """A tree node names a tensor that the mapping given to :func:`unflatten` lacks."""


def unflatten(tree: Any, tensors: Mapping[str, torch.Tensor], named: list[str] | None = None) -> Any:
    """Rebuild the state encoded by :func:`flatten` from its tree and loaded tensors.

    Raises ``ValueError`` on any malformed node (the loader turns it into
    ``CheckpointCorruptError``); :class:`UnknownTensorError`, a ``ValueError``, for a node
    naming a tensor ``tensors`` lacks; and ``RuntimeError`` for a ``torch.Generator`` whose
    device this machine cannot create. With ``named``, every name the tree references as
    :func:`tensor_names` lists it (``$tensor`` and ``$ndarray`` nodes, not ``$dtensor``) is
    appended to it as it is decoded: a caller that compares the names with a shard's needs
    no second walk of the tree.
    """
    note = named.append if named is not None else None

    def tensor(val: Any) -> torch.Tensor:
        t = tensors.get(val) if type(val) is str else None
        if t is None:
            raise UnknownTensorError(f"tree names a tensor the shard lacks: {val!r}")
        return t

    def items(val: Any, depth: int) -> list[tuple[Any, Any]]:
        if type(val) is not list:
            raise ValueError("malformed mapping items")
        out = []
        inner = depth + 1
        for item in val:
            if not (type(item) is list and len(item) == 2):
                raise ValueError("malformed mapping item")
            k, v = item
            tk = type(k)  # (json makes no subclasses; a bool key is refused)
            if tk is not str and tk is not int:
                raise ValueError("malformed mapping key")
            # the common value of a state dict, a plain tensor node, without dec's dispatch
            if type(v) is dict and len(v) == 1 and type(name := v.get("$tensor")) is str and inner <= MAX_DEPTH:
                out.append((k, tensor(name)))
                if note is not None:
                    note(name)
            else:
                out.append((k, dec(v, inner)))
        return out

    def listed(val: Any, what: str) -> list[Any]:
        if not isinstance(val, list):
            raise ValueError(f"malformed {what}")
        return val

    def dec(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"tree nested deeper than {MAX_DEPTH} levels")
        if node is None or isinstance(node, (bool, int, float, str)):
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
        return dict(items(val, depth))

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
        out: collections.OrderedDict[Any, Any] = collections.OrderedDict(items(val[0], depth))
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
        return collections.defaultdict(factory, items(val[1], depth))

    def d_param(val: Any, depth: int) -> Any:
        val = listed(val, "$param")
        if len(val) != 2 or not isinstance(val[1], bool):
            raise ValueError("malformed $param")
        t = dec(val[0], depth + 1)
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
        if type(state) is not torch.Tensor or state.dtype != torch.uint8:
            raise ValueError("malformed $generator state")
        if state.is_meta:
            return state
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
