"""The encoder's DTensor nodes: one ``{"$dtensor": name}`` node per distinct DTensor of a walk,
described by ``_sharding`` (its box, and whether this rank writes it); a DTensor tied to an
earlier one names that one, and its own name is recorded as an alias for the index."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._safetensors import DTYPE_TO_ST
from ._structure_refusals import describe_path


def dtensor_tie_key(dt: Any) -> tuple[Any, ...] | None:
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


class DTensorNodes:
    """The DTensors one walk met. ``found`` receives ``(name, ShardInfo, dtensor)`` for each
    distinct one; ``aliases`` (when given) maps the name a tied one would have had to the
    earlier name; :attr:`n_tied` counts the tied ones."""

    __slots__ = ("_sharding", "_ties", "aliases", "found", "n_tied")

    def __init__(self, found: list[tuple[str, Any, Any]], aliases: dict[str, str] | None) -> None:
        self.found = found
        self.aliases = aliases
        self.n_tied = 0
        self._ties: dict[Any, str] = {}  # the names so far, by object and by local storage view
        self._sharding: Any = None  # the _sharding module, imported at the first tensor subclass met

    def node(
        self,
        t: torch.Tensor,
        path: tuple[str, ...],
        unique: Callable[[tuple[str, ...]], str],
        add: Callable[[str, torch.Tensor], None],
    ) -> Any:
        """The node of ``t`` (a tensor subclass at key path ``path``) if it is a DTensor, else
        None. Its name comes from ``unique``; its local shard goes to ``add`` only on the rank
        that writes its box. Raises ``TypeError`` naming the key for an unsupported placement
        (``_sharding.describe``) or dtype."""
        if self._sharding is None:
            from . import _sharding  # only when a state may hold DTensors

            self._sharding = _sharding
        sharding = self._sharding
        if not sharding.is_dtensor(t):
            return None
        # named first either way: a rank that cannot see the tie names it the same
        name = unique(path)
        key = dtensor_tie_key(t)
        ties = self._ties
        earlier = ties.get(id(t)) or (ties.get(key) if key is not None else None)
        if earlier is not None:
            self.n_tied += 1
            if self.aliases is not None:
                self.aliases[name] = earlier
            return {"$dtensor": earlier}
        info = sharding.describe(describe_path(path), t)
        if info.dtype not in DTYPE_TO_ST:
            raise TypeError(f"unsupported dtype {info.dtype} at {describe_path(path)!r}")
        self.found.append((name, info, t))  # (keeps t alive: its id is not reused in the walk)
        ties[id(t)] = name
        if key is not None:
            ties[key] = name
        if info.writer:
            add(name, info.local.detach())
        return {"$dtensor": name}
