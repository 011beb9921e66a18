"""Turn a nested training state into (JSON tree, named tensors) and back.

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
``torch.compile`` wrapper, and without any prefix the caller names in ``strip_prefixes``.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import datetime
import enum
import json
import math
import pathlib
import zoneinfo
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import orjson
import torch

from ._bounds import MAX_DEPTH, recursion_room
from ._safetensors import DTYPE_TO_ST, PLAIN_TENSORS

#: The wrapper prefix ``torch.compile`` puts before every key of a module state dict.
COMPILE_PREFIX = "_orig_mod."

#: numpy dtypes stored as tensor data, by name; complex128 (which torch cannot store in
#: safetensors here) travels as its float64 pairs.
_NP_STORAGE: dict[str, torch.dtype] = {
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
_FACTORIES: dict[str, type] = {
    t.__name__: t for t in (list, dict, set, frozenset, tuple, int, float, complex, str, bytes, bool)
}

#: torch.dtype by name (from the module's own namespace: a lookup never triggers an import).
_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}

_PATHS: dict[str, type[pathlib.PurePath]] = {
    "PurePosixPath": pathlib.PurePosixPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
    "PosixPath": pathlib.PosixPath,
}


class TensorRef(NamedTuple):
    """One tensor of a flattened state: its unique name and the live source tensor (a
    tuple: one is made per tensor per save, ~4x cheaper than a frozen dataclass)."""

    name: str
    tensor: torch.Tensor


def _describe(path: tuple[str, ...]) -> str:
    return ".".join(path) if path else "<root>"


def _check_int_digits(value: int, path: tuple[str, ...], what: str = "int") -> None:
    """An int the JSON writer could not turn into digits (``sys.set_int_max_str_digits``) is
    refused here, naming its key path, instead of failing in the writer without one."""
    try:
        str(value)
    except ValueError:
        raise ValueError(
            f"{what} at {_describe(path)!r} has more digits than this interpreter converts to text "
            "(sys.get_int_max_str_digits()); save it as bytes (value.to_bytes(...)) instead"
        ) from None


def _too_deep(path: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"state is nested too deep at {_describe(path)!r}: a checkpoint holds at most {MAX_DEPTH} levels "
        "(a Parameter, numpy scalar or Generator holds its value one level further down)"
    )


#: The containers whose values sit one level below them (flatten's depth rule).
_NESTING = (dict, list, tuple, set, frozenset, collections.OrderedDict, collections.defaultdict)
#: The values json.loads makes of JSON scalars.
_JSON_SCALARS = (int, float, str, bool, type(None))
#: Types of the values that are their own JSON node (ints: of up to 2,000 bits, see enc).
_PLAIN_KINDS = frozenset({int, str, bool, type(None)})
_SMALL_INT = 1 << 2_000


def _plain_list(obj: list[Any]) -> bool:
    """Whether every value of ``obj`` is its own node (str, bool, None, ints of up to 2,000
    bits), decided at C speed, so a list of millions of them is copied rather than walked."""
    kinds = set(map(type, obj))
    if not kinds <= _PLAIN_KINDS:
        return False
    if int not in kinds:
        return True
    # ints mixed with other kinds cannot be ordered: those lists take the walk
    return kinds == {int} and -_SMALL_INT < min(obj) and max(obj) < _SMALL_INT


def _containers(node: list[Any]) -> bool:
    """Whether the JSON array ``node`` holds arrays or objects (C speed: the walks over a tree
    skip the millions of scalars of a long list)."""
    return not set(map(type, node)).isdisjoint((list, dict))


def _check_utf8(name: str) -> None:
    """A tensor's name goes into the shard's UTF-8 header: a key holding a lone surrogate
    (``"\\ud800"``, from ``surrogateescape``-decoded bytes) is refused here, naming the key path,
    instead of failing in the header's encoder."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"tensor at {name!r}: its key path is not valid UTF-8 (a lone surrogate), and tensor "
            "names are stored as UTF-8; rename the key (other values may hold such strings)"
        ) from None


def _check_tensor(t: torch.Tensor, path: tuple[str, ...]) -> None:
    # the common case in one expression (this runs once per tensor per save); quantized
    # dtypes are not in DTYPE_TO_ST, so they fall through to the messages below
    plain = type(t) in PLAIN_TENSORS and t.dtype in DTYPE_TO_ST and t.layout is torch.strided
    if plain and not t.is_meta and not t.is_nested:
        return
    where = _describe(path)
    if type(t) not in PLAIN_TENSORS:
        raise TypeError(f"unsupported tensor subclass {type(t).__name__} at {where!r}")
    if t.layout != torch.strided:
        raise TypeError(f"unsupported tensor layout {t.layout} at {where!r} (only dense tensors)")
    if t.is_meta:
        raise TypeError(f"meta tensor at {where!r} has no data to save")
    if t.is_quantized or t.is_nested:
        raise TypeError(f"quantized or nested tensor at {where!r} is not supported")
    if t.dtype not in DTYPE_TO_ST:
        raise TypeError(f"unsupported dtype {t.dtype} at {where!r}")


def _tie_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors the same values: storage, offset, shape, strides, dtype, device
    (FSDP2-style padded storages hold distinct tensors at other offsets). None for tensors
    without data, whose storages may all sit at address 0."""
    if t.numel() == 0:
        return None
    # the first element's address stands for storage + offset (cheaper than untyped_storage());
    # a conj or neg view reads other values from the same memory
    return (t.data_ptr(), t.device, t.shape, t.stride(), t.dtype, t.is_conj(), t.is_neg())


def _dtensor_tie_key(dt: Any) -> tuple[Any, ...] | None:
    """What makes two DTensors the same values on every rank: the same mesh, placements and
    global shape over the same local storage view. FSDP2 hands out a fresh DTensor per
    ``state_dict()`` key, so identity alone misses GPT-2's tied ``lm_head``/``wte``; its empty
    local shards are views of a padded storage and still compare. A local tensor over no
    storage at all (address 0 is shared by every such tensor) ties nothing: the index merge
    accepts that rank's empty entry for a name the other ranks tied."""
    local = dt._local_tensor
    storage = local.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return (
        id(dt.device_mesh), tuple(str(p) for p in dt.placements), tuple(dt.shape),
        storage.data_ptr(), local.storage_offset(), tuple(local.shape), local.stride(), local.dtype, local.device,
    )  # fmt: skip


def _enc_float(x: float) -> Any:
    if math.isfinite(x):
        return float(x)
    return {"$float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}


def _array_source(a: np.ndarray[Any, Any], where: str) -> torch.Tensor:
    """A CPU tensor over ``a``'s data (a view when ``a`` is contiguous and writable)."""
    name = a.dtype.name
    if name not in _NP_STORAGE or not a.dtype.isnative:
        hint = "x.tolist()" if a.dtype.kind in "OUSV" else "x.astype(<a numeric dtype>)"
        raise TypeError(
            f"unsupported numpy array dtype {a.dtype.str} ({a.dtype.name}) at {where!r}: arrays of "
            f"{', '.join(_NP_STORAGE)} in native byte order are saved; convert it, e.g. {hint}"
        )
    # torch.from_numpy needs contiguous, writable memory: copy (once, here) when it is not
    if not a.flags.c_contiguous or not a.flags.writeable:
        a = np.array(a, order="C", copy=True)
    if name == "complex128":
        a = a.reshape(-1).view(np.float64)
    return torch.from_numpy(a)


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _refusal(obj: Any, where: str) -> TypeError:
    """The ``TypeError`` for an unsupported object, with a hint how to convert it."""
    hint = (
        "save tensors, numpy arrays and scalars, numbers, str, None, bytes, dict/OrderedDict/list/"
        "tuple/set, torch.Size/dtype/device/Generator, pathlib paths, datetime values, or objects "
        "with state_dict()/load_state_dict()"
    )
    if isinstance(obj, enum.Enum):
        hint = "save x.value (or x.name) and rebuild the enum member after loading"
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        hint = "save dataclasses.asdict(x) and rebuild the dataclass after loading"
    elif type(obj).__name__ == "Namespace" or type(obj).__name__ == "SimpleNamespace":
        hint = "save vars(x) (a dict) and rebuild the namespace after loading"
    elif isinstance(obj, tuple) and hasattr(obj, "_asdict"):
        hint = "save x._asdict() (or tuple(x)) and rebuild the namedtuple after loading"
    elif isinstance(obj, np.random.Generator):
        hint = "save x.bit_generator.state (a dict) and restore it with x.bit_generator.state = saved"
    elif isinstance(obj, np.random.RandomState):
        hint = "save x.get_state() and restore it with x.set_state(saved)"
    elif isinstance(obj, np.ndarray):
        hint = "save np.asarray(x) (a plain ndarray)"
    elif isinstance(obj, datetime.time):
        hint = "save x.isoformat() and rebuild it with datetime.time.fromisoformat()"
    elif isinstance(obj, np.generic):
        hint = "save x.item() or convert it to a supported numpy dtype"
    elif isinstance(obj, Mapping):
        hint = "save dict(x) (only dict, OrderedDict and defaultdict of builtin types are kept as such)"
    else:
        for base in (bool, int, float, complex, str, bytes, list, tuple, set, frozenset):
            if isinstance(obj, base):
                hint = f"save {base.__name__}(x): subclasses of {base.__name__} are not saved as such"
                break
    return TypeError(f"unsupported object of type {_type_name(obj)} at {where!r}: {hint}")


def check_strip_prefixes(value: Sequence[str]) -> tuple[str, ...]:
    """``strip_prefixes`` checked: a sequence of non-empty str, each ending in ``.``."""
    if isinstance(value, str) or not all(isinstance(p, str) and len(p) > 1 and p.endswith(".") for p in value):
        raise ValueError(
            f"strip_prefixes must be a sequence of key prefixes ending in '.', e.g. ('module.',), not {value!r}"
        )
    return tuple(value)


def strip_state_dict_prefixes(sd: Mapping[str, Any], prefixes: Iterable[str]) -> tuple[dict[str, Any], Any]:
    """The keys and ``_metadata`` of a module state dict with wrapper prefixes removed.

    A prefix is removed only when every key starts with it (repeatedly, so a compiled DDP
    module loses both); ``_orig_mod.`` always, the others when named. Returns the renamed
    items and the renamed metadata (``None`` when there is none).
    """
    wanted = (COMPILE_PREFIX, *prefixes)
    items = dict(sd)
    meta = getattr(sd, "_metadata", None)
    changed = True
    while changed and items:
        changed = False
        for p in wanted:
            if p and all(isinstance(k, str) and k.startswith(p) for k in items):
                items = {k[len(p) :]: v for k, v in items.items()}
                meta = _strip_meta(meta, p)
                changed = True
    return items, meta


def _strip_meta(meta: Any, prefix: str) -> Any:
    """Module-prefix metadata of the wrapped module: ``"p"`` becomes ``""``, ``"p.x"`` ``"x"``."""
    if not isinstance(meta, Mapping):
        return meta
    head = prefix[:-1] if prefix.endswith(".") else prefix
    out: collections.OrderedDict[str, Any] = collections.OrderedDict()
    for k, v in meta.items():
        if k == head:
            out[""] = v
        elif isinstance(k, str) and k.startswith(prefix):
            out[k[len(prefix) :]] = v
    return out


def _spent(*args: Any, **kwargs: Any) -> Any:
    """What a walker's recursive closures are rebound to once the walk ended: their cells no
    longer reach each other, so the closures and all they captured die with the call instead
    of waiting for the cyclic collector (which may be paused, or run on the caller's path)."""
    raise AssertionError("a walker's closure called after its walk ended")


def flatten(
    state: Any,
    strip_prefixes: Iterable[str] = (),
    dtensors: list[tuple[str, Any, Any]] | None = None,
    tied_out: list[int] | None = None,
    dtensor_aliases: dict[str, str] | None = None,
) -> tuple[Any, list[TensorRef]]:
    """Encode ``state`` as a JSON tree plus its tensors, in deterministic order.

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
    weights) is appended to it. A DTensor tied to an earlier one (:func:`_dtensor_tie_key`)
    becomes a node naming the earlier one, and ``dtensor_aliases`` (when given) maps the name
    it would have had to the earlier name: the index records it, so that every rank's tree
    resolves to one stored tensor even where a rank could not see the tie.
    """
    prefixes = tuple(strip_prefixes)
    n_tied = 0
    tensors: list[TensorRef] = []
    # "__metadata__" is the safetensors header's own entry: a tensor saved under that key path
    # is named "__metadata__~2" (the tree maps the key to whatever name its tensor got)
    used: set[str] = {"__metadata__"}
    active: set[int] = set()
    # tied tensors (GPT-2's lm_head.weight and wte.weight): one name per storage view. The
    # tensors named so far by their first element's address: the first one as (tensor, name),
    # turned into {full key: name} once the address repeats (the full key costs ~1 us a
    # tensor: computed only where an address repeats, and once per tensor)
    at_ptr: dict[int, Any] = {}
    dties: dict[Any, str] = {}  # the same for DTensors: by object and by local storage view

    def unique(path: tuple[str, ...]) -> str:
        base = ".".join(path) if path else "_"
        if not base.isascii():
            _check_utf8(base)
        name, n = base, 1
        while name in used:
            n += 1
            name = f"{base}~{n}"
        used.add(name)
        return name

    sharding: list[Any] = []  # the _sharding module, imported at the first tensor subclass met

    def tensor_node(t: torch.Tensor, path: tuple[str, ...]) -> Any:
        nonlocal n_tied
        if dtensors is not None and type(t) not in PLAIN_TENSORS:
            if not sharding:
                from . import _sharding as imported  # only when a state may hold DTensors

                sharding.append(imported)
            _sharding = sharding[0]
            if _sharding.is_dtensor(t):
                # named first either way: a rank that cannot see the tie names it the same
                name = unique(path)
                key = _dtensor_tie_key(t)
                earlier = dties.get(id(t)) or (dties.get(key) if key is not None else None)
                if earlier is not None:
                    n_tied += 1
                    if dtensor_aliases is not None:
                        dtensor_aliases[name] = earlier
                    return {"$dtensor": earlier}
                info = _sharding.describe(_describe(path), t)
                if info.dtype not in DTYPE_TO_ST:
                    raise TypeError(f"unsupported dtype {info.dtype} at {_describe(path)!r}")
                dtensors.append((name, info, t))  # (keeps t alive: its id is not reused in the walk)
                dties[id(t)] = name
                if key is not None:
                    dties[key] = name
                if info.writer:
                    tensors.append(TensorRef(name, info.local.detach()))
                return {"$dtensor": name}
        _check_tensor(t, path)
        ptr = t.data_ptr()
        seen = at_ptr.get(ptr)
        tied = None
        if seen is not None:
            if type(seen) is tuple:  # the address repeats: from here on, by full key
                first, first_name = seen
                key = _tie_key(first)
                seen = at_ptr[ptr] = {} if key is None else {key: first_name}
            tied = _tie_key(t)
            if tied is not None and tied in seen:
                n_tied += 1
                return {"$tensor": seen[tied]}  # the same storage view and dtype: stored once
        name = unique(path)
        # detached only where autograd would track the copy (state_dict() values are not)
        tensors.append(TensorRef(name, t.detach() if t.requires_grad else t))
        if seen is None:
            at_ptr[ptr] = (t, name)
        elif tied is not None:
            seen[tied] = name
        return {"$tensor": name}

    def items_of(obj: Mapping[Any, Any], path: tuple[str, ...]) -> list[Any]:
        items = []
        for k, v in obj.items():
            tk = type(k)  # (a bool key's type is bool: refused too)
            if tk is not str and tk is not int:
                raise TypeError(
                    f"unsupported dict key {k!r} ({tk.__name__}) at {_describe(path)!r}: keys must be str or int"
                )
            if tk is int and k.bit_length() > 2_000:  # (see enc: str() has a digit limit)
                _check_int_digits(k, path, "dict key")
            sub = (*path, k if tk is str else str(k))
            # a plain tensor straight to its node: the common value of a state dict
            items.append([k, tensor_node(v, sub) if type(v) is torch.Tensor else enc(v, sub)])
        return items

    def elements(obj: Iterable[Any], path: tuple[str, ...]) -> list[Any]:
        # sets: elements sorted by their encoding, so equal sets give equal trees
        before = len(tensors)
        out = sorted((enc(v, (*path, "*")) for v in obj), key=repr)
        if len(tensors) != before:
            raise TypeError(f"set at {_describe(path)!r} holds tensors or arrays: save a list instead")
        return out

    def enc(obj: Any, path: tuple[str, ...]) -> Any:
        t = type(obj)
        if obj is None or t is bool or t is str:
            return obj
        if t is int:
            if obj.bit_length() > 2_000:  # ~600 digits: below the least str() limit Python allows (640)
                _check_int_digits(obj, path)
            return obj
        if t is float:
            return _enc_float(obj)
        if t is torch.nn.Parameter:
            if len(path) >= MAX_DEPTH:
                raise _too_deep(path)
            return {"$param": [tensor_node(obj, path), bool(obj.requires_grad)]}
        if isinstance(obj, torch.Tensor):
            return tensor_node(obj, path)
        if t is np.ndarray:
            src = _array_source(obj, _describe(path))
            name = unique(path)
            tensors.append(TensorRef(name, src))
            return {"$ndarray": [name, obj.dtype.name, list(obj.shape)]}
        if isinstance(obj, np.generic) and obj.dtype.name in _NP_STORAGE and obj.dtype.isnative:
            if len(path) >= MAX_DEPTH:
                raise _too_deep(path)
            return {"$np": [obj.dtype.name, enc(obj.item(), path)]}
        if t is bytes:
            return {"$bytes": base64.b64encode(obj).decode("ascii")}
        if t is bytearray:
            return {"$bytearray": base64.b64encode(bytes(obj)).decode("ascii")}
        if t is complex:
            return {"$complex": [_enc_float(obj.real), _enc_float(obj.imag)]}
        if t is torch.Size:
            return {"$size": [int(d) for d in obj]}
        if t is torch.dtype:
            return {"$dtype": str(obj).removeprefix("torch.")}
        if t is torch.device:
            return {"$device": str(obj)}
        if t is torch.Generator:
            if len(path) >= MAX_DEPTH:
                raise _too_deep(path)
            return {"$generator": [str(obj.device), tensor_node(obj.get_state(), path)]}
        if t in _PATHS.values():
            return {"$path": [t.__name__, str(obj)]}
        if t is datetime.datetime:
            return {"$datetime": [obj.replace(tzinfo=None, fold=0).isoformat(), obj.fold, _enc_tz(obj, path)]}
        if t is datetime.date:
            return {"$date": obj.isoformat()}
        if t is datetime.timedelta:
            return {"$timedelta": [obj.days, obj.seconds, obj.microseconds]}
        # the depth rule unflatten() applies: every node at most MAX_DEPTH levels below the
        # root, so a container at MAX_DEPTH may only be empty (an OrderedDict's _metadata is a
        # value below it too)
        if len(path) >= MAX_DEPTH and t in _NESTING and (obj or getattr(obj, "_metadata", None) is not None):
            raise _too_deep(path)
        if id(obj) in active:
            raise ValueError(f"reference cycle in state at {_describe(path)!r}")
        active.add(id(obj))
        try:
            if t is dict:
                return {"$dict": items_of(obj, path)}
            if t is collections.OrderedDict:
                return enc_odict(obj, path)
            if t is collections.defaultdict:
                factory = obj.default_factory
                if factory is not None and _FACTORIES.get(getattr(factory, "__name__", "")) is not factory:
                    raise TypeError(
                        f"defaultdict at {_describe(path)!r} has default_factory {factory!r}: only builtin "
                        f"types ({', '.join(_FACTORIES)}) or None are saved; save dict(x) instead"
                    )
                return {"$defaultdict": [None if factory is None else factory.__name__, items_of(obj, path)]}
            if t is list:
                if _plain_list(obj):  # a sampler's permutation of 9M ints: 0.9 s, not 3.3
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
        raise _refusal(obj, _describe(path))

    def enc_odict(obj: collections.OrderedDict[Any, Any], path: tuple[str, ...]) -> Any:
        extra = set(vars(obj)) - {"_metadata"}
        if extra:
            raise TypeError(
                f"OrderedDict at {_describe(path)!r} carries attributes {sorted(extra)}: only _metadata "
                "is saved; save collections.OrderedDict(x) instead"
            )
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
        enc = items_of = elements = enc_odict = _spent
    if tied_out is not None:
        tied_out.append(n_tied)
    return tree, tensors


def tree_json(tree: Any) -> bytes:
    """The compact JSON of a :func:`flatten` tree. orjson writes it ~10x faster than the
    standard library (7 ms -> 0.7 ms for 10,000 tensors, time save() blocks); an integer
    beyond 64 bits, which orjson refuses, falls back to the standard library. The tree holds
    no NaN or infinity (:func:`_enc_float` spells them out), so either output is strict JSON."""
    try:
        return orjson.dumps(tree)
    except orjson.JSONEncodeError:  # (orjson also stops at 255 levels of JSON)
        with recursion_room():
            return json.dumps(tree, separators=(",", ":"), allow_nan=False).encode()


def _enc_tz(dt: datetime.datetime, path: tuple[str, ...]) -> Any:
    tz = dt.tzinfo
    if tz is None:
        return None
    if type(tz) is datetime.timezone:
        off = tz.utcoffset(None)
        own = tz.tzname(None)
        name = own if own != datetime.timezone(off).tzname(None) else None
        return ["fixed", [off.days, off.seconds, off.microseconds], name]
    if type(tz) is zoneinfo.ZoneInfo and tz.key is not None:
        return ["zone", tz.key]
    raise TypeError(
        f"datetime at {_describe(path)!r} has tzinfo {type(tz).__name__}: fixed offsets "
        "(datetime.timezone) and zoneinfo.ZoneInfo zones are saved; save "
        "x.astimezone(datetime.timezone.utc) instead"
    )


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
    if not isinstance(dtype, str) or dtype not in _NP_STORAGE:
        raise ValueError(f"malformed $ndarray dtype {dtype!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise ValueError("malformed $ndarray shape")
    want = math.prod(shape) * (2 if dtype == "complex128" else 1)
    if t.dtype != _NP_STORAGE[dtype] or t.numel() != want:
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
        if len(val) != 2 or not (val[0] is None or val[0] in _FACTORIES):
            raise ValueError("malformed $defaultdict")
        factory: Callable[[], Any] | None = None if val[0] is None else _FACTORIES[val[0]]
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
        if len(val) != 2 or val[0] not in _NP_STORAGE:
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
        dt = _TORCH_DTYPES.get(val) if isinstance(val, str) else None
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
        if len(val) != 2 or val[0] not in _PATHS or not isinstance(val[1], str):
            raise ValueError("malformed $path")
        return _PATHS[val[0]](val[1])

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
        dec = _spent
        _DECODERS = {}


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
