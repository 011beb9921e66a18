"""The encoder's leaf nodes: the tagged node of each value that holds no other value and no
tensor data (floats, bytes, complex numbers, ``torch.Size``/``dtype``/``device``, paths, datetime
values), by exact type; whether a list holds only values that are their own node; and a numpy
array's data as the tensor its ``$ndarray`` node names."""

from __future__ import annotations

import base64
import datetime
import math
import zoneinfo
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ._structure_nodes import NP_STORAGE, PATH_TYPES
from ._structure_refusals import describe_path

#: Types of the values that are their own JSON node (ints: of up to 2,000 bits, see the walk).
_PLAIN_KINDS = frozenset({int, str, bool, type(None)})
_SMALL_INT = 1 << 2_000


def plain_list(obj: list[Any]) -> bool:
    """Whether every value of ``obj`` is its own node (str, bool, None, ints of up to 2,000
    bits), decided at C speed, so a list of millions of them is copied rather than walked."""
    kinds = set(map(type, obj))
    if not kinds <= _PLAIN_KINDS:
        return False
    if int not in kinds:
        return True
    # ints mixed with other kinds cannot be ordered: those lists take the walk
    return kinds == {int} and -_SMALL_INT < min(obj) and max(obj) < _SMALL_INT


def enc_float(x: float) -> Any:
    """``x`` itself where finite, else its ``$float`` node (the tree stays strict JSON)."""
    if math.isfinite(x):
        return float(x)
    return {"$float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}


def array_source(a: np.ndarray[Any, Any], where: str) -> torch.Tensor:
    """A CPU tensor over ``a``'s data (a view when ``a`` is contiguous and writable)."""
    name = a.dtype.name
    if name not in NP_STORAGE or not a.dtype.isnative:
        hint = "x.tolist()" if a.dtype.kind in "OUSV" else "x.astype(<a numeric dtype>)"
        raise TypeError(
            f"unsupported numpy array dtype {a.dtype.str} ({a.dtype.name}) at {where!r}: arrays of "
            f"{', '.join(NP_STORAGE)} in native byte order are saved; convert it, e.g. {hint}"
        )
    # torch.from_numpy needs contiguous, writable memory: copy (once, here) when it is not
    if not a.flags.c_contiguous or not a.flags.writeable:
        a = np.array(a, order="C", copy=True)
    if name == "complex128":
        a = a.reshape(-1).view(np.float64)
    return torch.from_numpy(a)


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
        f"datetime at {describe_path(path)!r} has tzinfo {type(tz).__name__}: fixed offsets "
        "(datetime.timezone) and zoneinfo.ZoneInfo zones are saved; save "
        "x.astimezone(datetime.timezone.utc) instead"
    )


def _enc_datetime(obj: datetime.datetime, path: tuple[str, ...]) -> Any:
    return {"$datetime": [obj.replace(tzinfo=None, fold=0).isoformat(), obj.fold, _enc_tz(obj, path)]}


def _enc_path(obj: Any, path: tuple[str, ...]) -> Any:
    return {"$path": [type(obj).__name__, str(obj)]}


#: The node of a leaf value by its exact type (a subclass is not a key: it is refused), given
#: the value and its key path.
LEAF_NODES: dict[type, Callable[[Any, tuple[str, ...]], Any]] = {
    bytes: lambda obj, path: {"$bytes": base64.b64encode(obj).decode("ascii")},
    bytearray: lambda obj, path: {"$bytearray": base64.b64encode(bytes(obj)).decode("ascii")},
    complex: lambda obj, path: {"$complex": [enc_float(obj.real), enc_float(obj.imag)]},
    torch.Size: lambda obj, path: {"$size": [int(d) for d in obj]},
    torch.dtype: lambda obj, path: {"$dtype": str(obj).removeprefix("torch.")},
    torch.device: lambda obj, path: {"$device": str(obj)},
    **dict.fromkeys(PATH_TYPES.values(), _enc_path),
    datetime.datetime: _enc_datetime,
    datetime.date: lambda obj, path: {"$date": obj.isoformat()},
    datetime.timedelta: lambda obj, path: {"$timedelta": [obj.days, obj.seconds, obj.microseconds]},
}
