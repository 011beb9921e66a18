"""Encode a nested training state as the structure tree (the tagged JSON nodes of
:mod:`~asyncckpt.format._structure_nodes`) plus its named tensors: :func:`flatten` and
:func:`flatten_parts`, one walk over the state that names each tensor once (tied ones too).
The walk's parts: ``_structure_leaves`` (leaf nodes), ``_structure_dtensors`` (DTensor nodes),
``_structure_refusals``; the tree's JSON text: ``_structure_json.tree_json``."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from ._bounds import MAX_DEPTH, recursion_room
from ._safetensors import DTYPE_TO_ST, PLAIN_TENSORS
from ._state_prefixes import strip_state_dict_prefixes
from ._structure_dtensors import DTensorNodes
from ._structure_json import FRAGMENT, FRAGMENT_INT
from ._structure_leaves import LEAF_NODES, array_source, enc_float, plain_list
from ._structure_names import TensorFacts, distinct_names
from ._structure_nodes import NP_STORAGE, spent_closure
from ._structure_refusals import (
    check_default_factory,
    check_int_digits,
    check_odict_attributes,
    check_tensor,
    check_utf8,
    describe_path,
    refusal,
    too_deep,
)


class TensorRef(NamedTuple):
    """One tensor of a flattened state: its unique name and the live source tensor (a
    tuple: one is made per tensor per save, ~4x cheaper than a frozen dataclass)."""

    name: str
    tensor: torch.Tensor


#: The containers whose values sit one level below them (flatten's depth rule).
_NESTING = (dict, list, tuple, set, frozenset, collections.OrderedDict, collections.defaultdict)
_STRIDED = torch.strided
_TENSOR = torch.Tensor


def _tie_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors the same values: storage, offset, shape, strides, dtype, device
    (FSDP2-style padded storages hold distinct tensors at other offsets). None for tensors
    without data, whose storages may all sit at address 0."""
    if t.numel() == 0:
        return None
    # the first element's address stands for storage + offset (cheaper than untyped_storage());
    # a conj or neg view reads other values from the same memory
    return (t.data_ptr(), t.device, t.shape, t.stride(), t.dtype, t.is_conj(), t.is_neg())


def flatten(state: Any, strip_prefixes: Iterable[str] = (), dtensors: list[tuple[str, Any, Any]] | None = None,
            tied_out: list[int] | None = None, dtensor_aliases: dict[str, str] | None = None,
            ) -> tuple[Any, list[TensorRef]]:  # fmt: skip
    """:func:`flatten_parts` with its names and tensors paired as :class:`TensorRef`."""
    tree, names, tensors = flatten_parts(state, strip_prefixes, dtensors, tied_out, dtensor_aliases)
    return tree, list(map(TensorRef, names, tensors))


def flatten_parts(
    state: Any,
    strip_prefixes: Iterable[str] = (),
    dtensors: list[tuple[str, Any, Any]] | None = None,
    tied_out: list[int] | None = None,
    dtensor_aliases: dict[str, str] | None = None,
    compact: bool = False,
    facts: TensorFacts | None = None,
) -> tuple[Any, list[str], list[torch.Tensor]]:
    """Encode ``state`` as a JSON tree plus its tensors, in deterministic order: the tree,
    the tensors' unique names and the tensors (two parallel lists: no object per tensor).

    DTensors are refused unless ``dtensors`` is a list: then each one becomes a
    ``{"$dtensor": name}`` node, ``(name, ShardInfo, dtensor)`` is appended to ``dtensors``
    (``_sharding.describe``: unsupported placements raise ``TypeError`` naming the key), and
    its local shard is among the returned tensors only on the rank that writes its box.

    Every value comes back from :func:`unflatten` as the type it was saved as, or is refused:
    raises ``TypeError`` naming the key path of the first unsupported object and how to
    convert it, and ``ValueError`` for a reference cycle or too deep a nesting. Calls
    ``state_dict()`` on stateful objects. Module state dicts lose the ``torch.compile``
    prefix and any of ``strip_prefixes`` that every key carries (e.g. DDP's ``"module."``).
    With ``tied_out``, the number of tensor nodes that reference an earlier tensor (tied
    weights) is appended to it. A DTensor tied to an earlier one (``dtensor_tie_key``)
    becomes a node naming the earlier one, and ``dtensor_aliases`` (when given) maps the name
    it would have had to the earlier name: the index records it, so that every rank's tree
    resolves to one stored tensor even where a rank could not see the tie.

    ``compact``: a dict entry holding a plain tensor may be one ``orjson.Fragment`` of its
    JSON (``["key",{"$tensor":"name"}]``, ~110 bytes a tensor less than a pair and a dict;
    issue 32) where key and name need no escape: a tree only ``tree_json`` reads.
    ``facts``: filled with the dtype and shape of every returned tensor and whether all are
    on the CPU (:class:`TensorFacts`), read as the walk meets each tensor.

    The names of plain tensors in dicts are checked for repeats after the walk, by hash (issue
    32: a set of 300,000 names cost ~1 us a tensor); where one repeats (keys ``"a.b"`` and ``"a"``
    then ``"b"``, ``1`` and ``"1"``) the state is walked again, each name checked as it is made
    (``state_dict()`` called again), to the same names as always.
    """
    prefixes = tuple(strip_prefixes)
    for strict in (False, True):
        found: list[tuple[str, Any, Any]] | None = None if dtensors is None else []
        aliases: dict[str, str] | None = None if dtensor_aliases is None else {}
        got = facts if facts is not None else TensorFacts()
        got.dtypes, got.shapes, got.all_cpu = [], [], True
        tree, names, tensors, n_tied = _walk(state, prefixes, found, aliases, compact, got, strict)
        if strict or distinct_names(names):
            break
    if dtensors is not None:
        dtensors += found or []
    if dtensor_aliases is not None:
        dtensor_aliases.update(aliases or {})
    if tied_out is not None:
        tied_out.append(n_tied)
    return tree, names, tensors


def _walk(state: Any, prefixes: tuple[str, ...], dtensors: list[tuple[str, Any, Any]] | None,
          dtensor_aliases: dict[str, str] | None, compact: bool, seen_facts: TensorFacts,
          strict: bool) -> tuple[Any, list[str], list[torch.Tensor], int]:  # fmt: skip
    """:func:`flatten_parts`' walk: the tree, names, tensors and the count of tied nodes.
    ``strict``: each name checked against the earlier ones as it is made; else a plain
    tensor's in a dict is not (the caller checks them all after the walk)."""
    fragment = FRAGMENT if compact else None
    n_tied = 0
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    add_name, add_tensor = names.append, tensors.append
    add_dtype, add_shape = seen_facts.dtypes.append, seen_facts.shapes.append
    expect = iter(seen_facts.expect)  # (an equal shape is kept as the last plan's object: no Size a tensor)

    def add(name: str, t: torch.Tensor) -> None:  # a tensor of the general path (the common one: items_of)
        add_name(name)
        add_tensor(t)
        add_dtype(t.dtype)
        add_shape(exp if (exp := next(expect, None)) == (shape := t.shape) else shape)
        if not t.is_cpu:
            seen_facts.all_cpu = False

    # "__metadata__" is the safetensors header's own entry: a tensor saved under that key path
    # is named "__metadata__~2" (the tree maps the key to whatever name its tensor got)
    used: set[str] = {"__metadata__"}
    active: set[int] = set()
    # tied tensors (GPT-2's lm_head.weight and wte.weight): one name per storage view. The
    # tensors named so far by their first element's address: the first one by its name,
    # turned into {full key: name} once the address repeats (the full key costs ~1 us a
    # tensor: computed only where an address repeats, and once per tensor)
    at_ptr: dict[int, Any] = {}
    # a name's index in the lists, made at the first repeated address and extended as needed
    indexed: dict[str, int] = {}

    def index_of(name: str) -> int:
        if name not in indexed:
            for i in range(len(indexed), len(names)):
                indexed[names[i]] = i
        return indexed[name]

    # the DTensors (their nodes, ties and aliases): only where the caller takes them
    dnodes = DTensorNodes(dtensors, dtensor_aliases) if dtensors is not None else None

    def unique(path: tuple[str, ...]) -> str:
        base = ".".join(path) if path else "_"
        if not base.isascii():
            check_utf8(base)
        name, n = base, 1
        while name in used:
            n += 1
            name = f"{base}~{n}"
        used.add(name)
        return name

    def tensor_node(t: torch.Tensor, path: tuple[str, ...]) -> Any:
        nonlocal n_tied
        if dnodes is not None and type(t) not in PLAIN_TENSORS:
            node = dnodes.node(t, path, unique, add)
            if node is not None:
                return node
        check_tensor(t, path)
        ptr = t.data_ptr()
        seen = at_ptr.get(ptr)
        tied = None
        if seen is not None:
            if type(seen) is str:  # the address repeats: from here on, by full key
                key = _tie_key(tensors[index_of(seen)])
                seen = at_ptr[ptr] = {} if key is None else {key: seen}
            tied = _tie_key(t)
            if tied is not None and tied in seen:
                n_tied += 1
                return {"$tensor": seen[tied]}  # the same storage view and dtype: stored once
        name = unique(path)
        if seen is None:
            at_ptr[ptr] = name
        # detached only where autograd would track the copy (state_dict() values are not)
        add(name, t.detach() if t.requires_grad else t)
        if seen is not None and tied is not None:
            seen[tied] = name
        return {"$tensor": name}

    def items_of(obj: Mapping[Any, Any], path: tuple[str, ...]) -> list[Any]:
        items: list[Any] = []
        append = items.append
        prefix = ".".join(path) + "." if path else ""  # (the name of a value below: prefix + key)
        for k, v in obj.items():
            tk = type(k)  # (a bool key's type is bool: refused too)
            if tk is str:
                key = k
            elif tk is int:
                if k.bit_length() > 2_000:  # (see enc: str() has a digit limit)
                    check_int_digits(k, path, "dict key")
                key = str(k)
            else:
                raise TypeError(
                    f"unsupported dict key {k!r} ({tk.__name__}) at {describe_path(path)!r}: keys must be str or int"
                )
            if type(v) is not _TENSOR:
                append([k, enc(v, (*path, key))])
                continue
            # a plain tensor, the common value of a state dict: tensor_node's common case
            # inline (issue 32: ~1 us a tensor less). A meta tensor's address is 0, as is an
            # empty one's: both take tensor_node, as does a tie or a name to make unique
            dtype = v.dtype
            if dtype in DTYPE_TO_ST and v.layout is _STRIDED and not v.is_nested:
                ptr = v.data_ptr()
                if ptr and ptr not in at_ptr:
                    name = prefix + key
                    if name.isascii() and (not strict or name not in used):
                        if strict:
                            used.add(name)
                        at_ptr[ptr] = name
                        add_name(name)
                        # detached only where autograd would track the copy (state_dict() values are not)
                        add_tensor(v.detach() if v.requires_grad else v)
                        add_dtype(dtype)  # (TensorFacts: read while v is in cache)
                        add_shape(exp if (exp := next(expect, None)) == (shape := v.shape) else shape)
                        if not v.is_cpu:
                            seen_facts.all_cpu = False
                        # the entry as its JSON text where orjson would write it as it is: printable
                        # ASCII without quote or backslash (and a key within orjson's ints)
                        if fragment is not None and name.isprintable() and '"' not in name and "\\" not in name:
                            if tk is str:
                                append(fragment(f'["{k}",{{"$tensor":"{name}"}}]'))
                                continue
                            if -FRAGMENT_INT <= k < FRAGMENT_INT:
                                append(fragment(f'[{k},{{"$tensor":"{name}"}}]'))
                                continue
                        # (a pair: 16 bytes less than a list, the same JSON; neither is ever a set's
                        # element, whose encodings sort by repr: a set holding a tensor is refused)
                        append((k, {"$tensor": name}))
                        continue
            append([k, tensor_node(v, (*path, key))])
        return items

    def elements(obj: Iterable[Any], path: tuple[str, ...]) -> list[Any]:
        # sets: elements sorted by their encoding, so equal sets give equal trees
        before = len(tensors)
        out = sorted((enc(v, (*path, "*")) for v in obj), key=repr)
        if len(tensors) != before:
            raise TypeError(f"set at {describe_path(path)!r} holds tensors or arrays: save a list instead")
        return out

    def enc(obj: Any, path: tuple[str, ...]) -> Any:
        t = type(obj)
        if t is dict and len(path) < MAX_DEPTH:  # (the common container first: what the general path does)
            if id(obj) in active:
                raise ValueError(f"reference cycle in state at {describe_path(path)!r}")
            active.add(id(obj))
            try:
                return {"$dict": items_of(obj, path)}
            finally:
                active.discard(id(obj))
        if obj is None or t is bool or t is str:
            return obj
        if t is int:
            if obj.bit_length() > 2_000:  # ~600 digits: below the least str() limit Python allows (640)
                check_int_digits(obj, path)
            return obj
        if t is float:
            return enc_float(obj)
        if t is torch.nn.Parameter:
            if len(path) >= MAX_DEPTH:
                raise too_deep(path)
            return {"$param": [tensor_node(obj, path), bool(obj.requires_grad)]}
        if isinstance(obj, torch.Tensor):
            return tensor_node(obj, path)
        if t is np.ndarray:
            src = array_source(obj, describe_path(path))
            name = unique(path)
            add(name, src)
            return {"$ndarray": [name, obj.dtype.name, list(obj.shape)]}
        if isinstance(obj, np.generic) and obj.dtype.name in NP_STORAGE and obj.dtype.isnative:
            if len(path) >= MAX_DEPTH:
                raise too_deep(path)
            return {"$np": [obj.dtype.name, enc(obj.item(), path)]}
        leaf = LEAF_NODES.get(t)  # (bytes, complex, torch.Size/dtype/device, paths, datetime values)
        if leaf is not None:
            return leaf(obj, path)
        if t is torch.Generator:
            if len(path) >= MAX_DEPTH:
                raise too_deep(path)
            return {"$generator": [str(obj.device), tensor_node(obj.get_state(), path)]}
        # the depth rule unflatten() applies: every node at most MAX_DEPTH levels below the
        # root, so a container at MAX_DEPTH may only be empty (an OrderedDict's _metadata is a
        # value below it too)
        if len(path) >= MAX_DEPTH and t in _NESTING and (obj or getattr(obj, "_metadata", None) is not None):
            raise too_deep(path)
        if id(obj) in active:
            raise ValueError(f"reference cycle in state at {describe_path(path)!r}")
        active.add(id(obj))
        try:
            if t is dict:
                return {"$dict": items_of(obj, path)}
            if t is collections.OrderedDict:
                return enc_odict(obj, path)
            if t is collections.defaultdict:
                factory = obj.default_factory
                check_default_factory(factory, path)
                return {"$defaultdict": [None if factory is None else factory.__name__, items_of(obj, path)]}
            if t is list:
                if plain_list(obj):  # a sampler's permutation of 9M ints: 0.9 s, not 3.3
                    return list(obj)
                return [enc(v, (*path, str(i))) for i, v in enumerate(obj)]
            if t is tuple:
                return {"$tuple": [enc(v, (*path, str(i))) for i, v in enumerate(obj)]}
            if t is set:
                return {"$set": elements(obj, path)}
            if t is frozenset:
                return {"$frozenset": elements(obj, path)}
            state_dict = getattr(obj, "state_dict", None)
            if callable(state_dict) and callable(getattr(obj, "load_state_dict", None)):
                return enc(state_dict(), path)
        finally:
            active.discard(id(obj))
        raise refusal(obj, describe_path(path))

    def enc_odict(obj: collections.OrderedDict[Any, Any], path: tuple[str, ...]) -> Any:
        check_odict_attributes(obj, path)
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            obj, meta = strip_state_dict_prefixes(obj, prefixes)  # type: ignore[assignment]
            meta_node = enc(meta, (*path, "_metadata"))
        else:
            meta_node = None
        return {"$odict": [items_of(obj, path), meta_node]}

    try:
        with recursion_room():
            tree = enc(state, ())
    finally:
        # the walkers call each other through their closures: a reference cycle that would
        # keep every name, address and TensorRef of the walk alive until a collection ran
        enc = items_of = elements = enc_odict = spent_closure
    return tree, names, tensors, n_tied + (dnodes.n_tied if dnodes is not None else 0)
