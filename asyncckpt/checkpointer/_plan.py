"""Planning a save's shard: the layout of the flattened tensors (kept while the structure
stays the same), the file a dedupe round is expected to leave this rank, and replica spreading."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from ..format._header import round_up
from ..format._safetensors import ST_TO_DTYPE, ShardLayout, plan_order, plan_split_layout
from ..format._structure_encode import TensorRef
from ..format._structure_names import TensorFacts
from ..saving import _dedupe

_META = {"format": "pt", "writer": "asyncckpt"}
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_IS_CPU = operator.attrgetter("is_cpu")


class Planner:
    """The layout cache of one Checkpointer (used by ``save()`` and ``reserve()``, one at a
    time: ``save()``'s caller thread)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        # the structure the layout was planned for, in flatten's order: names, dtypes, shapes
        # (the layout's own name strings and shape tuples: ~24 bytes a tensor of its own)
        self.layout_key: tuple[list[str], list[Any], list[tuple[int, ...]]] | None = None
        self.layout: ShardLayout | None = None
        self.perm: Sequence[int] = []
        self.layouts_planned = 0  # StagingStatistics.layouts_planned
        # with dedupe: the last round's plan, and the arena laid out for it (see expected_file)
        self.plan_hint = _dedupe.PlanHint()
        self.split_key: tuple[Any, frozenset[str]] | None = None
        self.split: tuple[ShardLayout, ShardLayout, list[int]] | None = None

    def plan(self, refs: Sequence[Any]) -> tuple[ShardLayout, Sequence[int], bool]:
        """The shard layout for these tensors, the permutation from ``refs`` to its slots, and
        whether every tensor is on the CPU. The layout (and the arena's copy plan, which
        hangs on the layout object) is reused while names, dtypes and shapes stay exactly
        the same; any difference in one of them, or in their order, plans anew."""
        names = [r.name for r in refs]
        tensors = [r.tensor for r in refs]
        return self.plan_parts(names, tensors)

    @property
    def shapes(self) -> Sequence[tuple[int, ...]]:
        """The shapes of the structure planned last, in flatten's order (``TensorFacts.expect``)."""
        return self.layout_key[2] if self.layout_key is not None else ()

    def plan_parts(
        self, names: list[str], tensors: list[Any], facts: TensorFacts | None = None
    ) -> tuple[ShardLayout, Sequence[int], bool]:
        """:meth:`plan` of ``flatten_parts``' parallel lists of names and tensors. The
        structure is compared list by list, each list made and compared at C speed.
        ``facts``: the walk's dtypes and shapes of ``tensors`` (the same tensors, in order),
        compared as they are instead of being read from the tensors again."""
        key = self.layout_key
        if facts is not None:
            all_cpu = facts.all_cpu
            same = key is not None and key[0] == names and key[1] == facts.dtypes and key[2] == facts.shapes
        else:
            all_cpu = all(map(_IS_CPU, tensors))
            # each attribute compared as it is read (no list of torch.Size: ~80 bytes a tensor)
            same = (
                key is not None and key[0] == names and len(key[1]) == len(tensors)
                and all(map(operator.is_, map(_DTYPE, tensors), key[1]))
                and all(map(operator.eq, map(_SHAPE, tensors), key[2]))
            )  # fmt: skip
        if not same or self.layout is None:
            dtypes = list(map(_DTYPE, tensors)) if facts is None else facts.dtypes
            shapes = list(map(_SHAPE, tensors)) if facts is None else facts.shapes
            layout, perm = plan_order(list(zip(names, dtypes, shapes, strict=True)), _META)
            # the key keeps the layout's own strings and tuples, in flatten's order
            at = [0] * len(perm)
            for j, i in enumerate(perm):
                at[i] = j
            slots = layout.slots
            self.layout_key = ([slots[j].name for j in at], dtypes, [slots[j].shape for j in at])
            self.layout, self.perm = layout, perm
            self.layouts_planned += 1
        return self.layout, self.perm, all_cpu

    def expected_file(
        self, layout: ShardLayout, perm: Sequence[int], dtensors: list[dict[str, Any]] | None
    ) -> tuple[ShardLayout, ShardLayout | None, Sequence[int]]:
        """With dedupe on many ranks: the arena's layout, the file this rank writes before its
        dedupe round ends (``SaveJob.file``; None: the round decides first) and the permutation
        from the flattened tensors to the arena's slots.

        A rank whose plain tensors are too few to pay for an image without them (FSDP2: step
        counters next to its shard) writes its staged file whole, whatever the round decides.
        Otherwise, once a round planned this structure, the next save expects the same plan:
        the slots it gave this rank are laid out first, and that prefix of the arena is the
        file (no copy to drop the others). The first save of a structure waits for the round.
        """
        if not _dedupe.may_pay_for_an_image(layout.slots, dtensors):
            return layout, layout, perm
        writers = self.plan_hint.writers_for(layout)
        if writers is None:
            return layout, None, perm
        keep = _dedupe.kept(layout.slots, writers, self.rank)
        if len(keep) == len(layout.slots):
            return layout, layout, perm
        key = (layout, frozenset(s.name for s in keep))
        if key != self.split_key:
            names = key[1]
            specs = [(s.name, ST_TO_DTYPE[s.dtype], s.shape) for s in layout.slots]
            staging, file = plan_split_layout(
                [x for x in specs if x[0] in names], [x for x in specs if x[0] not in names],
                _META,
            )  # fmt: skip
            if round_up(staging.file_size) > round_up(layout.file_size):
                # alignment padding would need a larger arena than the structure's (what
                # reserve() allocated): let the round decide first instead
                self.split = None
            else:
                at = {s.name: i for i, s in enumerate(layout.slots)}
                self.split = (staging, file, [perm[at[s.name]] for s in staging.slots])
            self.split_key = key
        if self.split is None:
            return layout, None, perm
        return self.split


def spread_replica_writes(
    found: list[tuple[str, Any, Any]], refs: list[TensorRef]
) -> tuple[list[tuple[str, Any, Any]], list[TensorRef]]:
    """``flatten``'s DTensors and tensors with each replicated box written by the replica
    ``_sharding.spread_writers`` picks instead of the lowest one (HSDP: spread over the
    replica dim); the tensors to stage follow: this rank's local shards it now writes."""
    from ..format import _sharding

    infos = _sharding.spread_writers([info for _, info, _ in found])
    before = {name for name, info, _ in found if info.writer}
    spread = [(name, info, dt) for (name, _, dt), info in zip(found, infos, strict=True)]
    after = {name: info for name, info, _ in spread if info.writer}
    if before == after.keys():
        return spread, refs
    kept = [r for r in refs if r.name not in before or r.name in after]
    added = [TensorRef(name, info.local.detach()) for name, info in after.items() if name not in before]
    return spread, kept + added
