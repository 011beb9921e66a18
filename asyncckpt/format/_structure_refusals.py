"""What :func:`~asyncckpt.format._structure_encode.flatten` refuses to encode, each refusal an
error naming the key path and saying how to convert the value: unsupported objects, tensors,
keys that are not UTF-8, ints too long for text, nesting too deep, a defaultdict's or an
OrderedDict's extras that would not come back."""

from __future__ import annotations

import dataclasses
import datetime
import enum
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ._bounds import MAX_DEPTH
from ._safetensors import DTYPE_TO_ST, PLAIN_TENSORS
from ._structure_nodes import FACTORIES


def describe_path(path: tuple[str, ...]) -> str:
    return ".".join(path) if path else "<root>"


def check_int_digits(value: int, path: tuple[str, ...], what: str = "int") -> None:
    """An int the JSON writer could not turn into digits (``sys.set_int_max_str_digits``) is
    refused here, naming its key path, instead of failing in the writer without one."""
    try:
        str(value)
    except ValueError:
        raise ValueError(
            f"{what} at {describe_path(path)!r} has more digits than this interpreter converts to text "
            "(sys.get_int_max_str_digits()); save it as bytes (value.to_bytes(...)) instead"
        ) from None


def too_deep(path: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"state is nested too deep at {describe_path(path)!r}: a checkpoint holds at most {MAX_DEPTH} levels "
        "(a Parameter, numpy scalar or Generator holds its value one level further down)"
    )


def check_utf8(name: str) -> None:
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


def check_default_factory(factory: Any, path: tuple[str, ...]) -> None:
    """A defaultdict's ``default_factory`` is saved by name: only None or a builtin type
    (``FACTORIES``) is, anything else refused here."""
    if factory is not None and FACTORIES.get(getattr(factory, "__name__", "")) is not factory:
        raise TypeError(
            f"defaultdict at {describe_path(path)!r} has default_factory {factory!r}: only builtin "
            f"types ({', '.join(FACTORIES)}) or None are saved; save dict(x) instead"
        )


def check_odict_attributes(obj: Any, path: tuple[str, ...]) -> None:
    """An OrderedDict's attributes are not saved but for ``_metadata`` (a module state dict's):
    one carrying any other is refused here."""
    extra = set(vars(obj)) - {"_metadata"}
    if extra:
        raise TypeError(
            f"OrderedDict at {describe_path(path)!r} carries attributes {sorted(extra)}: only _metadata "
            "is saved; save collections.OrderedDict(x) instead"
        )


def check_tensor(t: torch.Tensor, path: tuple[str, ...]) -> None:
    # the common case in one expression (this runs once per tensor per save); quantized
    # dtypes are not in DTYPE_TO_ST, so they fall through to the messages below
    plain = type(t) in PLAIN_TENSORS and t.dtype in DTYPE_TO_ST and t.layout is torch.strided
    if plain and not t.is_meta and not t.is_nested:
        return
    where = describe_path(path)
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


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def refusal(obj: Any, where: str) -> TypeError:
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
