"""The restore of a loaded state into the caller's targets (``into=``): :func:`restore_into`,
and the walk rules it shares with the load's plan of which targets are read straight into
(``_targets.plan_targets``), so a tensor is read into exactly when the restore would copy into it.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import numpy as np
import torch

from .._errors import CheckpointError
from ..format._state_prefixes import COMPILE_PREFIX, strip_state_dict_prefixes

#: A key's absence from a mapping (``.get(key, ABSENT)``), told apart from a ``None`` value.
ABSENT = object()


class MissingKeyError(CheckpointError, KeyError):
    """A key of ``into=`` that the checkpoint lacks (also a ``KeyError``; a plain message)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def restore_into(target: Any, loaded: Any, path: str = "", strip_prefixes: Sequence[str] = ()) -> None:
    """Restore ``loaded`` into ``target`` in place.

    Objects with ``load_state_dict`` get it called; tensors get ``copy_``, numpy arrays
    ``np.copyto``, ``torch.Generator`` objects ``set_state``; dicts and lists are walked, and
    other values in mutable containers are replaced. A module loads keys saved without
    wrapper prefixes: a ``torch.compile`` wrapper (``_orig_mod.``) and any of
    ``strip_prefixes`` (e.g. DDP's ``"module."``) are matched on both sides, so a checkpoint
    of a compiled or wrapped model loads into a plain one and the other way round. Raises
    :class:`MissingKeyError` (a ``CheckpointError``, also a ``KeyError``) when ``target``
    holds a key the checkpoint lacks, ``ValueError`` on a type or
    shape mismatch (the load raised those of :func:`check_fit` before any target was
    written, with a global index or without; any other leaves the targets partly overwritten: tensors read
    in place by :func:`plan_targets` already hold the checkpoint's bytes). A target that already is the
    loaded tensor (read in place) is left as it is.
    """
    where = path or "<root>"
    if target is loaded:
        return  # read in place (plan_targets): already holds the checkpoint's bytes
    if type(target) is dict and type(loaded) is dict:  # the common container, as the Mapping case below
        for key in list(target):
            value = target[key]
            got = loaded.get(key, ABSENT)
            if got is value and isinstance(value, torch.Tensor):
                continue  # read in place (no key path to spell, no isinstance chain: ~1/3 of a 300k restore)
            sub = f"{path}.{key}" if path else str(key)
            if got is ABSENT:
                raise MissingKeyError(f"{sub} is not in the checkpoint")
            if type(value) is not dict and is_leaf(value):
                target[key] = got
            else:
                restore_into(value, got, sub, strip_prefixes)
        return
    if isinstance(target, torch.Tensor):
        if not isinstance(loaded, torch.Tensor):
            raise ValueError(f"{where}: checkpoint holds {type(loaded).__name__}, target is a tensor")
        if target.shape != loaded.shape:
            raise ValueError(f"{where}: shape {tuple(loaded.shape)} in checkpoint, {tuple(target.shape)} in target")
        with torch.no_grad():
            target.copy_(loaded)
        return
    if isinstance(target, np.ndarray):
        if not isinstance(loaded, np.ndarray) or loaded.shape != target.shape or loaded.dtype != target.dtype:
            got = f"{loaded.dtype}{list(loaded.shape)}" if isinstance(loaded, np.ndarray) else type(loaded).__name__
            raise ValueError(f"{where}: checkpoint holds {got}, target is an array {target.dtype}{list(target.shape)}")
        np.copyto(target, loaded)
        return
    if isinstance(target, torch.Generator):
        if not isinstance(loaded, torch.Generator):
            raise ValueError(f"{where}: checkpoint holds {type(loaded).__name__}, target is a torch.Generator")
        target.set_state(loaded.get_state())
        return
    if isinstance(target, torch.nn.Module) and isinstance(loaded, Mapping):
        module, state = match_module(target, loaded, tuple(strip_prefixes))
        module.load_state_dict(state)
        return
    load_state_dict = getattr(target, "load_state_dict", None)
    if callable(load_state_dict):
        load_state_dict(loaded)
        return
    if isinstance(target, Mapping):
        if not isinstance(loaded, Mapping):
            raise ValueError(f"{where}: checkpoint holds {type(loaded).__name__}, target is a mapping")
        for key in list(target):
            value = target[key]
            if key in loaded and value is loaded[key] and isinstance(value, torch.Tensor):
                continue  # read in place (the common case: no key path to spell)
            sub = f"{path}.{key}" if path else str(key)
            if key not in loaded:
                raise MissingKeyError(f"{sub} is not in the checkpoint")
            if is_leaf(value) and isinstance(target, MutableMapping):
                target[key] = loaded[key]
            else:
                restore_into(value, loaded[key], sub, strip_prefixes)
        return
    if isinstance(target, (list, tuple)):
        if not isinstance(loaded, (list, tuple)) or len(loaded) != len(target):
            raise ValueError(f"{where}: sequence length or type differs from the checkpoint")
        for i, (t, v) in enumerate(zip(target, loaded, strict=True)):
            sub = f"{path}.{i}" if path else str(i)
            if is_leaf(t) and isinstance(target, MutableSequence):
                target[i] = v
            else:
                restore_into(t, v, sub, strip_prefixes)
        return
    # a plain value at the top level or inside a tuple: nothing to restore in place


#: Plain values, leaves without a look at their type's ABCs (a list of a parameter's ints).
SCALARS = frozenset({int, float, str, bool, type(None)})


def is_leaf(v: Any) -> bool:
    """A value restored by replacing it, not in place."""
    if type(v) in SCALARS:
        return True
    if isinstance(v, (torch.Tensor, np.ndarray, torch.Generator, Mapping, list, tuple)):
        return False
    return not callable(getattr(v, "load_state_dict", None))


def match_module(
    target: torch.nn.Module, loaded: Mapping[Any, Any], prefixes: tuple[str, ...]
) -> tuple[torch.nn.Module, Mapping[Any, Any]]:
    """The module that takes ``loaded`` and the state renamed for it.

    A wrapper whose keys all carry one of the prefixes (``_orig_mod.`` of ``torch.compile``
    always, the named ones such as ``module.`` of DDP) hands over to the module it wraps; the
    checkpoint's keys and ``_metadata`` lose the same prefixes (old checkpoints may have them).
    """
    wanted = (COMPILE_PREFIX, *prefixes)
    unwrapped = True
    while unwrapped:
        unwrapped = False
        for p in wanted:
            if _is_wrapper(target, p[:-1]):
                target, unwrapped = getattr(target, p[:-1]), True
                break
    if not all(isinstance(k, str) for k in loaded):
        return target, loaded
    items, meta = strip_state_dict_prefixes(loaded, wanted)
    state: collections.OrderedDict[str, Any] = collections.OrderedDict(items)
    if meta is not None:
        state._metadata = meta  # type: ignore[attr-defined]
    return target, state


def _is_wrapper(m: torch.nn.Module, attr: str) -> bool:
    """Whether every key of ``m``'s state dict is ``attr.`` + a key of its child ``attr``.

    Decided from the module's structure, without calling ``state_dict()`` (which may be
    expensive or collective for some wrappers).
    """
    children = [name for name, _ in m.named_children()]
    return (
        children == [attr]
        and next(m.parameters(recurse=False), None) is None
        and next(m.buffers(recurse=False), None) is None
        and type(m).get_extra_state is torch.nn.Module.get_extra_state
    )
