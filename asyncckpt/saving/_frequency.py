"""The tiers' save frequencies: which tiers one save goes to, decided by rank 0 alone.

``memory_every``, ``disk_every`` and ``mirror_every`` take an ``int`` (every n-th save, the first
always) or a ``datetime.timedelta`` (a save goes to the tier when at least that much time passed
since the ``save()`` call of the last save that went there; the first always). Theory of
operation (docs/design/tiers.md, "Frequencies"):

1. rank 0 decides at its ``save()`` call, with its own clock (:class:`TierClock`): the disks or
   the memory tier only (``disk_every``), the memory write beside a disk save (``memory_every``),
   the upload of a disk commit (``mirror_every`` by time; by count it is decided as the commits
   settle, every rank counting the same verdicts);
2. the decision (:class:`Tiers`) travels in the save's start word, which every rank waits for
   anyway (``ranks._coordination.Coordinator.begin``): no extra round trip. Every other rank
   builds its save with a provisional route and takes rank 0's at the start
   (:class:`Routes`: the backend, the root, retention, the memory write), before it writes a
   byte, so no rank writes a tier part the others skip. A rank that never hears the start word
   fails the save (as before), so its route never counts;
3. a save that does not commit gives its time-based tiers back on rank 0 (:meth:`TierClock.failed`):
   the next save goes there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..roots._backend import Backend
    from ._memtier import MemoryCopies
    from ._savejob import SaveJob

#: A tier's frequency: every n-th save, or a minimum time between two saves that go there.
Every = int | timedelta


def check_every(name: str, every: object, tier: object, node_local: bool, *, shared: bool = False) -> Every:
    """A tier's save frequency (module docstring), checked: ``TypeError``/``ValueError`` naming
    ``name`` at the call; ``tier`` is the tier's option (``None``: no such tier, so no frequency
    for it). ``shared``: the frequency applies to any local root (``mirror_every``), not only to
    node-local ones."""
    if every is None:
        return 1
    if isinstance(every, timedelta):
        if every <= timedelta(0):
            raise ValueError(f"{name} must be a positive timedelta, not {every!r}")
    elif not isinstance(every, int) or isinstance(every, bool):
        raise TypeError(f"{name} must be an int (every n-th save) or a datetime.timedelta (the least time "
                        f"between two saves that go there), not {type(every).__name__}")  # fmt: skip
    elif every < 1:
        raise ValueError(f"{name} must be at least 1, not {every!r}")
    if tier is None:
        raise ValueError(f"{name} applies to its tier ({name.split('_')[0]}=...), which is not set")
    if not node_local and not shared:
        raise ValueError(f"{name} applies to node-local roots (node_local=True) for now")
    return every


def every_save(every: Every) -> bool:
    """Whether a tier of frequency ``every`` takes every save."""
    return isinstance(every, int) and every == 1


def check_disk_every(every: object, memory: str | None, memory_every: Every, node_local: bool) -> Every:
    """``disk_every``: every n-th ``save()`` of the job, or a save at least that long after the
    last disk save (the first always), goes to the node disks, every other one to the memory tier
    only. ``TypeError``/``ValueError`` at the call: it needs the memory tier, which must take
    every save."""
    n = check_every("disk_every", every, True, node_local)
    if every is not None and memory is None:
        raise ValueError("disk_every keeps the saves between two disk saves in the memory tier: it needs memory=...")
    if not every_save(n) and not every_save(memory_every):
        raise ValueError(f"disk_every={n!r} needs memory_every=1: a save not due for the disks goes to the memory "
                         "tier, so every save must be due for it")  # fmt: skip
    return n


def due(nth: int, every: int) -> bool:
    """Whether the ``nth`` save or commit of the job (1 for the first) goes to a tier of frequency ``every``."""
    return (nth - 1) % every == 0


@dataclass
class Tiers:
    """Where one save goes: ``disk`` (the disks, else the memory tier only), ``memory`` (a
    disk save's memory write), ``mirror`` (a disk commit's upload; ``None``: ``mirror_every``
    counts the commits as they settle). ``t``: rank 0's clock at the call; ``clocked``: the
    time-based tiers this save restarted the clock of (rank 0 only)."""

    disk: bool = True
    memory: bool = False
    mirror: bool | None = None
    t: float = 0.0
    clocked: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        """The decision as the start word carries it."""
        return {"disk": self.disk, "memory": self.memory, "mirror": self.mirror}

    @classmethod
    def from_json(cls, d: Any) -> Tiers:
        """Rank 0's decision, as read from the start word."""
        return cls(bool(d["disk"]), bool(d["memory"]), None if d["mirror"] is None else bool(d["mirror"]))


class TierClock:
    """The decision of :func:`decide` (module docstring): rank 0's clocks of the time-based tiers.
    ``split``: the saves not due for the disks commit into the memory tier (``disk_every``);
    ``memory``: there is a memory tier."""

    def __init__(self, memory_every: Every, disk_every: Every, mirror_every: Every, *, split: bool,
                 memory: bool) -> None:  # fmt: skip
        self.every = {"memory": memory_every, "disk": disk_every, "mirror": mirror_every}
        self.split, self.memory = split, memory
        #: a choice to make (more than one tier, or a clock): the other ranks take rank 0's at each
        #: save's start (its clock, its SIGTERM), not their own count
        self.tiered = split or memory or any(type(e) is not int for e in self.every.values())
        self._last: dict[str, float] = {}

    def _due(self, tier: str, seq: int, t: float, clocked: list[str], provisional: bool) -> bool:
        """Whether the ``seq``-th save, called at ``t``, goes to ``tier``; a time-based tier that
        takes it restarts its clock (named in ``clocked``)."""
        every = self.every[tier]
        if isinstance(every, int):
            return due(seq, every)
        if provisional:  # not rank 0: its clock does not count (rank 0's word replaces this)
            return True
        last = self._last.get(tier)
        if last is not None and t - last < every.total_seconds():
            return False
        self._last[tier] = t
        clocked.append(tier)
        return True

    def decide(self, seq: int, t: float | None = None, *, provisional: bool = False, final: bool = False) -> Tiers:
        """The tiers of the ``seq``-th save of the job (1 for the first), whose ``save()`` rank 0
        called at time ``t`` (seconds of a monotonic clock, ``time.perf_counter()`` in ``save()``;
        ``time.monotonic()`` by default). ``provisional``: another rank's route until rank 0's word
        arrives (time-based tiers are taken as due). ``final``: a save made while the SIGTERM
        handler runs goes to every tier, whatever the frequencies (the node's memory and disk may
        go with a preempted node: its last step must reach the disks, and through them the store)."""
        t = time.monotonic() if t is None else t
        clocked: list[str] = []
        if final:
            for tier, every in self.every.items():
                if not isinstance(every, int):
                    self._last[tier] = t
                    clocked.append(tier)
            timed_mirror = not isinstance(self.every["mirror"], int)
            return Tiers(True, self.memory, True if timed_mirror else None, t, tuple(clocked))
        disk = not self.split or self._due("disk", seq, t, clocked, provisional)
        memory = self.memory and (not disk or self._due("memory", seq, t, clocked, provisional))
        mirror = None
        if not isinstance(self.every["mirror"], int):  # by time: decided now, for a disk commit only
            mirror = disk and self._due("mirror", seq, t, clocked, provisional)
        return Tiers(disk, memory, mirror, t, tuple(clocked))

    def failed(self, tiers: Tiers) -> None:
        """A save that did not commit: the tiers whose clock it restarted take the next save."""
        for tier in tiers.clocked:
            if self._last.get(tier) == tiers.t:
                del self._last[tier]


class Routes:
    """How a save follows its :class:`Tiers` on this rank: the disks' backend and root (with
    their retention), or the memory tier's, and the memory write. ``keep_last``: the disks'
    retention in the save (``None``: the mirror retires)."""

    def __init__(self, disk: Backend | None, memory_backend: Backend | None, root: str, memory_root: str | None,
                 memory: MemoryCopies | None, keep_last: int | None) -> None:  # fmt: skip
        self.disk, self.memory_backend = disk, memory_backend
        self.root, self.memory_root = root, memory_root
        self.memory, self.keep_last = memory, keep_last

    def apply(self, job: SaveJob, tiers: Tiers) -> Backend | None:
        """Set ``job``'s route to ``tiers`` (before the save writes anything); return its backend."""
        to_disk = tiers.disk or self.memory_backend is None
        job.tiers = tiers if to_disk == tiers.disk else replace(tiers, disk=to_disk)  # (the route taken)
        job.root = self.root if to_disk else str(self.memory_root)
        job.keep_last = self.keep_last if to_disk else None
        job.memory = None
        if self.memory is not None and (not to_disk or tiers.memory):
            job.memory = self.memory.writer(job.step, in_save=not to_disk)
        return self.disk if to_disk or self.memory_backend is None else self.memory_backend

    def follow(self, job: SaveJob, word: Any) -> Backend | None:
        """Another rank, at the save's start: take rank 0's decision ``word`` (the start word's)."""
        return self.apply(job, Tiers.from_json(word))
