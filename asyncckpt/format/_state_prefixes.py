"""Module state-dict key prefixes that wrappers add (``torch.compile``'s ``_orig_mod.``, DDP's
``module.``): the check of a caller's ``strip_prefixes`` and their removal from keys and
``_metadata``."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

#: The wrapper prefix ``torch.compile`` puts before every key of a module state dict.
COMPILE_PREFIX = "_orig_mod."


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
