"""The caller's targets of a load (``into=``): what a load refuses before it reads anything
(:func:`check_fit`) and which targets it reads straight into (:func:`plan_targets`), walked as
``_restore.restore_into`` walks them, so a tensor is read into exactly when the restore would
copy into it.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from .._errors import CheckpointCorruptError
from ..format._header import TensorSlot
from ..format._safetensors import PLAIN_TENSORS, ST_TO_DTYPE
from ..format._structure_decode import StandInSites, UnknownTensorError, ValueStandIn, fill_in, unflatten
from ..format._structure_names import distinct_names
from ._restore import ABSENT, SCALARS, MissingKeyError, is_leaf, match_module


class Unfit:
    """Mixed into an error :func:`check_fit` raised: no target of ``into=`` was written."""


class UnfitValueError(Unfit, ValueError):
    """A shape or kind mismatch found before anything was read (a ``ValueError``)."""


class UnfitKeyError(Unfit, MissingKeyError):
    """A key of ``into=`` the checkpoint lacks, found before anything was read."""


def unflatten_named(
    tree: Any, tensors: Mapping[str, Any], shard_path: str, consume: bool = False, sites: StandInSites | None = None
) -> tuple[Any, list[str]]:
    """``unflatten(tree, tensors, consume=consume, sites=sites)`` and the names the tree references (tied
    tensors more than once), in one walk. ``CheckpointCorruptError`` naming ``shard_path`` unless the tree
    references exactly the tensors of ``tensors`` (a name the shard lacks, or a tensor of the
    shard no node names); a malformed node raises ``ValueError`` as ``unflatten`` does."""
    named: list[str] = []
    try:
        state = unflatten(tree, tensors, named, consume, sites)
    except UnknownTensorError:
        raise CheckpointCorruptError("structure and shard disagree on tensor names", shard_path) from None
    # every name is one of tensors' (else UnknownTensorError): the sets are equal iff as large;
    # as many names all distinct by hash need no set of them (~1 us a name at 300k, issue 32)
    if not (len(named) == len(tensors) and distinct_names(named)) and len(set(named)) != len(tensors):
        raise CheckpointCorruptError("structure and shard disagree on tensor names", shard_path)
    return state, named


# ---------------------------------------------------------------------- reading into targets
class Skeleton(NamedTuple):
    """The state :func:`plan_targets` rebuilt over the slots, when :func:`fill_in` can make it
    the loaded state (its slots all values of its mappings, ``sites``): one decode of the tree."""

    state: Any
    sites: StandInSites

    def filled(self, tensors: Mapping[str, torch.Tensor]) -> Any:
        """The loaded state: each slot replaced by the tensor of its name (every name's)."""
        fill_in(self.sites, tensors)
        return self.state


class Plan(NamedTuple):
    """:func:`plan_targets`' ``targets`` by name, ``skeleton`` (or ``None``), and whether every target is ``plain``."""

    targets: dict[str, torch.Tensor]
    skeleton: Skeleton | None
    plain: bool


def plan_targets(
    into: Any, tree: Any, slots: Sequence[TensorSlot], prefixes: tuple[str, ...], tree_path: str, shard_path: str,
    held: list[Any] | None = None) -> Plan:  # fmt: skip
    """The tensors of ``into`` that saved tensors can be read straight into, by saved name, and the
    skeleton that :meth:`Skeleton.filled` turns into the loaded state once the tensors exist (``None``
    when a stand-in sits outside its mappings: the tree is decoded again): a :class:`Plan`.

    The state is first rebuilt as a skeleton, each saved tensor's slot standing in for it
    (``unflatten``'s stand-ins: every node checked, nothing allocated per tensor), and walked
    against ``into`` as :func:`restore_into` will walk it (modules through their state dict,
    after the wrapper prefixes are matched; optimizers through the tensors of their state),
    so a tensor is read into exactly when ``restore_into`` would have copied the saved one into it.
    Only plain tensors and parameters of the saved dtype and shape qualify, on the CPU or CUDA; a
    target whose memory overlaps another's (tied weights) and a saved tensor the structure names
    twice keep the fresh-tensor path, as does everything else (``restore_into`` then copies or
    raises exactly as before). Nothing is written here; a mismatch :func:`check_fit` finds is raised
    here, before any target is. ``held``: the caller's reference to ``tree`` (a list holding it),
    emptied once the skeleton is the state."""
    slot_of = dict(zip(map(operator.itemgetter(0), slots), slots, strict=True))  # {s.name: s} at C speed
    sites = StandInSites()
    try:
        skeleton, names = unflatten_named(tree, slot_of, shard_path, sites=sites)
    except (ValueError, TypeError, RecursionError, OverflowError) as e:
        raise CheckpointCorruptError(f"malformed structure ({e})", tree_path) from None
    if held is not None and not sites.elsewhere:
        held.clear()  # the tree dies now, not after the plan's per-target lists (~80 B a tensor at the peak)
    del tree
    found: dict[str, torch.Tensor] = {}
    # a mismatch restore_into would meet is raised here, before any target is written
    _fit_and_pair(into, skeleton, prefixes, found)
    kept = None if sites.elsewhere else Skeleton(skeleton, sites)
    del skeleton, sites
    # a name may repeat (tied tensors are stored once): those keep the fresh-tensor path
    counts = collections.Counter(names) if len(names) != len(slots) else None
    del names
    usable: dict[str, torch.Tensor] = {}
    spans: list[int] = []  # (device, begin, end, file offset) of each usable target, read while it is in cache
    plain = True
    for name, t in found.items():
        if counts is not None and counts[name] != 1:
            continue
        s = slot_of[name]
        dtype = ST_TO_DTYPE[s.dtype]
        span = _plain_span(t, dtype, s.shape)
        if span is None:  # not plain: it fits or not as _fits says
            if not _fits(t, dtype, s.shape):
                continue
            span, plain = (t.get_device(), *_span(t)), False
        usable[name] = t
        spans += (*span, s.begin)
    del found
    return Plan(_without_overlaps(usable, spans), kept, plain)


def _fit_and_pair(target: Any, skeleton: Any, prefixes: tuple[str, ...], out: dict[str, torch.Tensor]) -> None:
    """:func:`check_fit` then :func:`_pair`, in one walk of the common containers: a plain
    dict's plain tensors are checked and paired on one visit (the two walks cost ~10 % of a
    100 k-tensor load); any other node takes the two functions as they are."""
    if type(target) is not dict or not isinstance(skeleton, Mapping):
        check_fit(target, skeleton)
        _pair(target, skeleton, prefixes, out)
        return
    _fit_and_pair_dict(target, skeleton, prefixes, out, "")


def _fit_and_pair_dict(
    target: dict[Any, Any], skeleton: Mapping[Any, Any], prefixes: tuple[str, ...], out: dict[str, torch.Tensor],
    path: str,
) -> None:  # fmt: skip
    for key, value in target.items():
        got = skeleton.get(key, ABSENT)
        if type(value) in PLAIN_TENSORS and type(got) is TensorSlot and value.shape == got.shape:
            out.setdefault(got.name, value)
            continue
        sub = f"{path}.{key}" if path else str(key)
        if got is ABSENT:
            raise UnfitKeyError(f"{sub} is not in the checkpoint")
        if type(value) is dict and isinstance(got, Mapping):
            _fit_and_pair_dict(value, got, prefixes, out, sub)
            continue
        if not is_leaf(value):
            check_fit(value, got, sub)
        if type(value) in PLAIN_TENSORS:
            if type(got) is TensorSlot:
                out.setdefault(got.name, value)
        else:
            _pair(value, got, prefixes, out)


def check_fit(target: Any, skeleton: Any, path: str = "") -> None:
    """Raise what :func:`restore_into` of the state ``skeleton`` stands for into ``target``
    would raise for its containers and tensors, without touching either: ``MissingKeyError``
    for a key of a dict of ``target`` the checkpoint lacks, ``ValueError`` for a tensor of
    another shape or a container of another kind or length (both :class:`Unfit`). Run
    before the first byte is read, so such a load leaves every target as it was (not only
    the tensors before the mismatch). ``skeleton`` may also be an indexed step's state, its
    tensors not read yet (``_load_global``): compared by shape alike. What the skeleton
    cannot tell (a saved array or generator: its stand-in) and what is not ours to judge (a
    module's or an object's ``load_state_dict``) is left to ``restore_into``."""
    if type(target) is dict and isinstance(skeleton, Mapping):  # the common container: its tensors inline
        for key, value in target.items():
            got = skeleton.get(key, ABSENT)
            if type(value) in PLAIN_TENSORS and type(got) is TensorSlot and value.shape == got.shape:
                continue  # (a path spelled only for a node that is not this plain case)
            sub = f"{path}.{key}" if path else str(key)
            if got is ABSENT:
                raise UnfitKeyError(f"{sub} is not in the checkpoint")
            if not is_leaf(value):
                check_fit(value, got, sub)
        return
    where = path or "<root>"
    if isinstance(target, torch.Tensor):
        if type(skeleton) is TensorSlot or isinstance(skeleton, torch.Tensor):  # (a tensor: an indexed step's)
            if tuple(target.shape) != tuple(skeleton.shape):
                shape, want = tuple(skeleton.shape), tuple(target.shape)
                raise UnfitValueError(f"{where}: shape {shape} in checkpoint, {want} in target")
        else:
            raise UnfitValueError(f"{where}: checkpoint holds {_kind(skeleton)}, target is a tensor")
        return
    if isinstance(target, np.ndarray):
        saved = _array_of(skeleton)
        if saved != (target.dtype, target.shape):
            got = _kind(skeleton) if saved is None else f"{saved[0]}{list(saved[1])}"
            raise UnfitValueError(
                f"{where}: checkpoint holds {got}, target is an array {target.dtype}{list(target.shape)}"
            )
        return
    if isinstance(target, torch.Generator):
        if not (isinstance(skeleton, torch.Generator) or _stands_for(skeleton, torch.Generator)):
            raise UnfitValueError(f"{where}: checkpoint holds {_kind(skeleton)}, target is a torch.Generator")
        return
    if isinstance(target, torch.nn.Module) or callable(getattr(target, "load_state_dict", None)):
        return
    if isinstance(target, Mapping):
        if not isinstance(skeleton, Mapping):
            raise UnfitValueError(f"{where}: checkpoint holds {_kind(skeleton)}, target is a mapping")
        for key, value in target.items():
            sub = f"{path}.{key}" if path else str(key)
            if key not in skeleton:
                raise UnfitKeyError(f"{sub} is not in the checkpoint")
            if not (is_leaf(value) and isinstance(target, MutableMapping)):
                check_fit(value, skeleton[key], sub)
        return
    if isinstance(target, (list, tuple)):
        if not isinstance(skeleton, (list, tuple)) or len(skeleton) != len(target):
            raise UnfitValueError(f"{where}: sequence length or type differs from the checkpoint")
        for i, (t, v) in enumerate(zip(target, skeleton, strict=True)):
            if not (is_leaf(t) and isinstance(target, MutableSequence)):
                check_fit(t, v, f"{path}.{i}" if path else str(i))


def _kind(skeleton: Any) -> str:
    """The type a skeleton's node stands for, as ``restore_into`` names the loaded value's."""
    if type(skeleton) is ValueStandIn:
        return skeleton.kind.__name__
    return "Tensor" if type(skeleton) is TensorSlot else type(skeleton).__name__


def _stands_for(skeleton: Any, kind: type) -> bool:
    return type(skeleton) is ValueStandIn and skeleton.kind is kind


def _array_of(skeleton: Any) -> tuple[np.dtype[Any], tuple[int, ...]] | None:
    """The dtype and shape of the array ``skeleton`` holds or stands for (else ``None``)."""
    if isinstance(skeleton, np.ndarray):
        return skeleton.dtype, skeleton.shape
    if _stands_for(skeleton, np.ndarray):
        return skeleton.dtype, skeleton.shape
    return None


def _pair(target: Any, loaded: Any, prefixes: tuple[str, ...], out: dict[str, torch.Tensor]) -> None:
    """Collect (saved name -> target tensor) the way :func:`restore_into` pairs them;
    ``loaded`` is the skeleton (a saved tensor's slot where the tensor will be)."""
    if type(target) in SCALARS:
        return  # (an optimizer's param_groups: a list of ints a parameter)
    if type(target) is dict:  # the common container (no load_state_dict): its tensors inline
        if isinstance(loaded, Mapping):
            for key, sub in target.items():
                if key in loaded:
                    got = loaded[key]
                    if type(sub) in PLAIN_TENSORS:
                        if type(got) is TensorSlot:
                            out.setdefault(got.name, sub)
                    else:
                        _pair(sub, got, prefixes, out)
        return
    if type(loaded) is TensorSlot:  # a saved tensor: only a tensor target takes it
        if isinstance(target, torch.Tensor):
            out.setdefault(loaded.name, target)
        return
    if isinstance(target, (torch.Tensor, np.ndarray, torch.Generator)):
        return
    if isinstance(target, torch.nn.Module):
        if isinstance(loaded, Mapping):
            module, state = match_module(target, loaded, prefixes)
            own = module.state_dict()
            for key, value in state.items():
                if key in own:
                    _pair(own[key], value, prefixes, out)
        return
    if isinstance(target, torch.optim.Optimizer):
        # load_state_dict keeps the given state tensors when they already have the
        # parameter's dtype and device: reading into the current ones restores them in place
        if isinstance(loaded, Mapping) and isinstance(loaded.get("state"), Mapping):
            _pair(target.state_dict().get("state"), loaded["state"], prefixes, out)
        return
    if callable(getattr(target, "load_state_dict", None)):
        return  # whatever it does with the loaded tensors is its own business: fresh ones
    if isinstance(target, Mapping):
        if isinstance(loaded, Mapping):
            for key in target:
                if key in loaded:
                    _pair(target[key], loaded[key], prefixes, out)
        return
    if isinstance(target, (list, tuple)) and isinstance(loaded, (list, tuple)) and len(target) == len(loaded):
        for t, v in zip(target, loaded, strict=True):
            _pair(t, v, prefixes, out)


def _fits(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether ``t`` can take the saved bytes as they are: a plain strided tensor on the CPU
    (or CUDA, through a bounce buffer) of the saved dtype and shape."""
    if not (
        type(t) in PLAIN_TENSORS
        and t.layout is torch.strided
        and t.dtype == dtype
        and t.shape == shape
        and (t.is_cpu or (t.is_cuda and torch.cuda.is_available()))
        and not t.is_conj()
        and not t.is_neg()
        and not t.is_inference()
    ):
        return False
    strides = t.stride()
    # no expand()ed dims (a stride of 0 over more than one element)
    return 0 not in strides or all(st != 0 or n <= 1 for n, st in zip(t.shape, strides, strict=True))


def _plain_span(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """``(t.get_device(), *_span(t))`` of a plain target that :func:`_fits` (contiguous, on the
    CPU, not empty: no expanded dim), each figure read once (~0.1 us a tensor each); else ``None``."""
    if (
        type(t) in PLAIN_TENSORS
        and t.dtype == dtype
        and t.is_cpu
        and t.layout is torch.strided
        and t.shape == shape
        and not t.is_conj()
        and not t.is_neg()
        and not t.is_inference()
        and t.is_contiguous()
    ):
        nbytes = t.nbytes
        if nbytes:
            begin = t.data_ptr()
            return -1, begin, begin + nbytes  # (get_device() of a CPU tensor: -1)
    return None


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range of the memory ``t`` can touch (the first element's address: torch has
    no negative strides)."""
    begin = t.data_ptr()
    if t.is_contiguous():  # the common target: one attribute per figure
        return begin, begin + t.nbytes  # (empty: begin == end, never an overlap)
    numel = t.numel()
    if numel == 0:
        return 0, 0
    extent = 1 + sum((int(n) - 1) * abs(int(st)) for n, st in zip(t.shape, t.stride(), strict=True))
    return begin, begin + extent * t.element_size()


def _without_overlaps(targets: dict[str, torch.Tensor], spans: list[int]) -> dict[str, torch.Tensor]:
    """``targets`` less every target whose memory overlaps another kept one (tied weights, views):
    in the order of (device, address, end, file offset) the first stays. ``spans``: each target's
    ``get_device()``, :func:`_span` and saved offset, flat, in ``targets``' order (sorted by numpy)."""
    n = len(targets)
    table = np.array(spans, dtype=np.int64).reshape(n, 4)
    facts, offset = table[:, :3], table[:, 3]
    taken = np.flatnonzero(facts[:, 1] < facts[:, 2])  # (an empty span overlaps nothing)
    f = facts[taken]
    order = taken[np.lexsort((offset[taken], f[:, 2], f[:, 1], f[:, 0]))]
    dev, begin, end = facts[order, 0], facts[order, 1], facts[order, 2]
    reach = np.maximum.accumulate(end) if len(end) else end
    if not ((dev[1:] == dev[:-1]) & (begin[1:] < reach[:-1])).any():
        return targets  # (the common case: no two overlap)
    dropped: set[int] = set()
    last, reach_dev = None, -1  # per device: the end of the memory kept so far
    for i, d, b, e in zip(order.tolist(), dev.tolist(), begin.tolist(), end.tolist(), strict=True):
        if d != last:
            last, reach_dev = d, -1
        if b < reach_dev:
            dropped.add(i)
        else:
            reach_dev = e
    return {name: t for i, (name, t) in enumerate(targets.items()) if i not in dropped}
