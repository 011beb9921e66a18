"""What the writer of an object-store root knows of it, so the look after each commit costs
a number of requests that does not grow with the run.

Only the holder of the root's lease (``_lease``) writes under ``step_N/``: a Checkpointer's
rank 0, a tier mirror, ``push`` and ``gc`` (readers write bad marks only, under
``.asyncckpt/bad/``). So the writer can keep, between two looks at its root:

* a **floor**: a step name below which (lexically, as the store sorts keys) no step prefix
  holds an object. A look lists the marks (one LIST of ``.asyncckpt/bad/``) and then every
  key above the floor (one flat LIST with ``start-after``, paginated: one request per 1,000
  keys), so neither the steps retired long ago nor the empty "directories" a store may keep
  of them (SeaweedFS does) are listed or even walked by the store. The floor is the lowest
  step name the last look found holding objects, or that the writer has written since
  (:meth:`StoreView.pin` before a step's first key, :meth:`StoreView.unpin` after its save
  ended), and it rises as the writer removes whole steps (:meth:`StoreView.removed`);
* the **manifests** it read (or created: :meth:`StoreView.learn`), by ETag, and the **marks**
  it read, by ETag: a listing that shows them unchanged costs no GET.

The first look lists everything (what a job taking over the root must see: leftovers of a
crashed writer anywhere). Objects that a foreign writer puts below the floor while the lease
is ours (a zombie's request landing late) are found by the next job's first look.

What the look observed goes through the same adapter as every other look at a store root
(``_steps.observe_listed``): the step rule itself stays in ``_stepstates``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from ...format._layout import parse_step_dir, step_dir_name
from ...format._stepstates import Mark
from .._badmarks import STORE_PREFIX, store_marks
from ._client import ObjectStore
from ._steps import ManifestCache, StepPrefix, by_step, learn_manifest, observe_listed


@dataclass
class Look:
    """One look at the root: every step prefix above the floor that holds an object, oldest
    first, and the steps a save of the writer was busy with meanwhile (``busy``: pinned when
    the look began or ended, or whose save ended during it: none of their objects is a
    leftover)."""

    steps: list[StepPrefix] = field(default_factory=list)
    busy: set[int] = field(default_factory=set)

    def step(self, step: int) -> StepPrefix | None:
        return next((p for p in self.steps if p.step == step), None)


class StoreView:
    """The writer's knowledge of one root (module docstring). Used on one event loop; looks
    are not run concurrently (the caller's retention lock)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.manifests: ManifestCache = {}
        self._marks: dict[str, tuple[str, Mark | None]] = {}
        self._occupied: set[str] | None = None  # None: never looked: the next look lists everything
        self._floor: str | None = None
        self._pinned: Counter[str] = Counter()
        self._during: set[str] = set()  # step names unpinned during the look in progress
        self.looks = 0

    @property
    def floor(self) -> str | None:
        """The step name the next look lists from (``None``: from the start)."""
        if self._occupied is None:
            return None
        names = self._occupied | set(self._pinned)
        return min(names) if names else self._floor

    def seed(self, steps: Iterable[int]) -> None:
        """What a look at everything just found (``steps``: every step prefix holding an
        object), so the first look lists only from the lowest of them."""
        self._occupied = {step_dir_name(s) for s in steps}
        self._floor = min(self._occupied, default=None)

    def pin(self, step: int) -> None:
        """A save of ``step`` is about to write under its prefix."""
        self._pinned[step_dir_name(step)] += 1

    def unpin(self, step: int) -> None:
        """That save ended (committed, or its attempt removed): its prefix may hold objects."""
        name = step_dir_name(step)
        self._pinned[name] -= 1
        if self._pinned[name] <= 0:
            del self._pinned[name]
        self._during.add(name)
        if self._occupied is not None:
            self._occupied.add(name)

    def removed(self, step: int) -> None:
        """Every object of ``step``'s prefix was removed by the writer."""
        name = step_dir_name(step)
        self.manifests.pop(step, None)
        if self._occupied is not None and name not in self._pinned:
            self._occupied.discard(name)

    def learn(self, step: int, e_tag: str | None, raw: bytes) -> None:
        """The writer created ``step``'s manifest (``raw``, ETag ``e_tag`` as read back)."""
        learn_manifest(self.manifests, step, e_tag, raw, self.store.object_url(f"{step_dir_name(step)}/manifest.json"))

    def _busy(self) -> set[int]:
        return {s for n in set(self._pinned) | self._during if (s := parse_step_dir(n)) is not None}

    async def look(self, deadline: float) -> Look:
        """List the marks and every key above the floor, and observe each step prefix found
        (one GET per manifest or mark not seen before with its ETag)."""
        start = self.floor
        self._during = set()
        busy = self._busy()
        if start is None:
            listed = await self.store.list("", deadline)
            marks = [o for o in listed if o.key.startswith(STORE_PREFIX)]
        else:
            marks = await self.store.list(STORE_PREFIX, deadline)
            listed = await self.store.list("", deadline, start_after=_before(start))
        known = await store_marks(self.store, deadline, listed=marks, cache=self._marks)
        grouped = by_step(listed)  # (a store that ignores start-after shows more: still right)
        steps = [await observe_listed(self.store, s, grouped[s], deadline, known, self.manifests)
                 for s in sorted(grouped)]
        names = {step_dir_name(s) for s in grouped}
        for s in [s for s in self.manifests if s not in grouped and (start is None or step_dir_name(s) >= start)]:
            del self.manifests[s]  # gone from the store: forget it
        self._occupied = names | self._during
        self._floor = start if start is not None else (min(names) if names else None)
        self.looks += 1
        return Look(steps, busy | self._busy())


def _before(name: str) -> str:
    """A string below ``name`` and below every key of its prefix, and above every lower step
    name but (at most) one: what to list after. Not ``name`` itself: SeaweedFS skips the whole
    "directory" ``name/`` after ``start-after=name`` (S3 would list its keys: they sort after)."""
    last = name[-1]
    return name[:-1] + chr(ord(last) - 1) if "0" < last <= "9" else name[:-1]
