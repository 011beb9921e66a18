"""Rank coordination for one save: agree on the attempt, collect results, share the verdict.

Every method is awaited on the writer thread's loop, by every rank, in the same order:

1. :meth:`Coordinator.begin` - the leader (rank 0) prepares the attempt directory and
   publishes ``(attempt, error)``; the others wait for it.
2. :meth:`Coordinator.report` - each rank publishes what it wrote (or why it failed); the
   leader receives every rank's report, or learns which ranks did not answer in time.
3. :meth:`Coordinator.decide` - the leader publishes the verdict (committed or failed);
   the others wait for it.

Failures travel as values, never as exceptions across ranks, so no rank leaves the
protocol early and nobody waits without a deadline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ._errors import RankFailure


@dataclass
class Report:
    """One rank's outcome of the write phase."""

    rank: int
    files: list[dict[str, Any]] = field(default_factory=list)
    nbytes: int = 0
    failure: RankFailure | None = None


@dataclass
class Verdict:
    """The leader's decision, identical on every rank."""

    committed: bool
    failures: dict[int, RankFailure] = field(default_factory=dict)
    missing: tuple[int, ...] = ()
    nbytes: int = 0
    created: float = 0.0


@dataclass
class Start:
    """What the leader published at the start of an attempt."""

    attempt: str
    failure: RankFailure | None = None


class Coordinator(Protocol):
    """How the ranks of one Checkpointer talk during a save (see the module docstring)."""

    rank: int
    world_size: int

    async def begin(self, step: int, seq: int, start: Start | None, deadline: float) -> Start:
        """Leader passes its ``start``; others pass ``None`` and receive the leader's."""
        ...

    async def report(self, step: int, seq: int, attempt: str, mine: Report, deadline: float) -> dict[int, Report]:
        """Publish ``mine``; the leader gets every answering rank's report, others ``{}``."""
        ...

    async def decide(self, step: int, seq: int, attempt: str, verdict: Verdict | None, deadline: float) -> Verdict:
        """Leader passes the verdict; others pass ``None`` and receive it."""
        ...

    async def close(self, deadline: float) -> None:
        """Collective: return only once every rank has read the last verdict."""
        ...


class LocalCoordinator:
    """The single-process case: rank 0 of 1, nothing to exchange."""

    rank = 0
    world_size = 1

    async def begin(self, step: int, seq: int, start: Start | None, deadline: float) -> Start:
        assert start is not None
        return start

    async def report(self, step: int, seq: int, attempt: str, mine: Report, deadline: float) -> dict[int, Report]:
        return {0: mine}

    async def decide(self, step: int, seq: int, attempt: str, verdict: Verdict | None, deadline: float) -> Verdict:
        assert verdict is not None
        return verdict

    async def close(self, deadline: float) -> None:
        return None
