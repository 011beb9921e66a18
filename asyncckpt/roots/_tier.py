"""Tier mode as one root (``Checkpointer(root, mirror="s3://...")``): a local root (``near``)
and the store it is mirrored to (``far``), read as one :class:`~asyncckpt.roots._root.Root`,
so a load has no tier case of its own (``loading._resume`` reads it as it reads any root).

The steps are the union of both tiers': the newest resumable step is the newer of the two
tiers' newest (the store's of this job's run only: ``far_newest``, the mirror's rule), and a
step is read from the local root when it is resumable there, else from the store. A bad
mark goes to the tier whose copy was read. Everything that writes (ownership, attempts,
retention, leftovers) is the local root's: the store is written by the mirror alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from .._errors import CheckpointCorruptError, CheckpointNotFoundError, CheckpointReadError
from ..format._manifest import Manifest
from ._root import Attempt, Capabilities, Claim, Leftover, Listed, Root, StepReader


class TierRoot:
    """``near`` and ``far`` read as one root (module docstring). ``far_newest(skip)``: the
    store's newest step of this run not in ``skip`` (``None``: none)."""

    def __init__(self, near: Root, far: Root, far_newest: Callable[[frozenset[int]], int | None]) -> None:
        self.near, self.far, self._far_newest = near, far, far_newest
        self.url: str = near.url
        self.caps: Capabilities = near.caps
        self._lock = threading.Lock()
        self._served: dict[tuple[int, str], Root] = {}  # which tier a reader of (step, attempt) read

    def __repr__(self) -> str:
        return f"TierRoot({self.near!r}, {self.far!r})"

    def _tier_of(self, step: int) -> Root:
        """The local root when ``step`` is resumable there, else the store. An I/O fault of the
        local root is raised: the store never stands in for a copy that could not be read."""
        try:
            self.near.open_step(step)
        except CheckpointReadError:
            raise
        except (CheckpointNotFoundError, CheckpointCorruptError):
            return self.far
        return self.near

    # -------------------------------------------------------------- reading: the union
    def list_steps(self) -> list[Listed]:
        rows = self.near.list_steps()
        here = {r.step for r in rows}
        rows += [r for r in self.far.list_steps() if r.step not in here]
        return sorted(rows, key=lambda r: r.step)

    def newest_resumable(
        self, passed: list[tuple[int, CheckpointCorruptError]] | None = None, skip: frozenset[int] = frozenset()
    ) -> int | None:
        near = self.near.newest_resumable(passed, skip)
        far = self._far_newest(skip)
        return far if far is not None and (near is None or far > near) else near

    def resumable(self, newest: bool = False) -> list[Manifest]:
        if newest:
            near = self.near.resumable(newest=True)
            far = self._far_newest(frozenset())
            if far is not None and (not near or far > near[0].step):
                return [self.far.open_step(far)]
            return near
        found = {m.step: m for m in self.far.resumable()}
        found.update((m.step, m) for m in self.near.resumable())  # a step on both: the local copy's
        return [found[s] for s in sorted(found)]

    def open_step(self, step: int) -> Manifest:
        return self._tier_of(step).open_step(step)

    def open_reader(self, step: int) -> StepReader:
        tier = self._tier_of(step)
        reader = tier.open_reader(step)
        with self._lock:
            self._served[(step, reader.manifest.attempt)] = tier
        return reader

    def read(self, step: int, name: str, offset: int = 0, length: int | None = None) -> bytes:
        with self.open_reader(step) as reader:
            return reader.read(name, offset, length)

    def locate(self, step: int, attempt: str | None = None, name: str | None = None) -> str:
        return self._served_by(step, attempt).locate(step, attempt, name)

    def _served_by(self, step: int, attempt: str | None) -> Root:
        with self._lock:
            return self._served.get((step, attempt or ""), self.near)

    def mark_bad(self, step: int, attempt: str, path: str, reason: str) -> bool:
        return self._served_by(step, attempt).mark_bad(step, attempt, path, reason)

    def clear_bad(self, step: int, attempt: str) -> bool:
        return self._served_by(step, attempt).clear_bad(step, attempt)

    # -------------------------------------------------------------- writing: the local root's
    def claim(self, role: str) -> Claim:
        return self.near.claim(role)

    def begin(self, step: int, *, attempt: str | None = None, deadline_s: float | None = None) -> Attempt:
        return self.near.begin(step, attempt=attempt, deadline_s=deadline_s)

    def leftovers(self) -> list[Leftover]:
        return self.near.leftovers()

    def remove(self, leftovers: Sequence[Leftover]) -> None:
        self.near.remove(leftovers)

    def retire(self, keep_last: int, *, by_commit_order: bool = False, dry_run: bool = False) -> list[int]:
        return self.near.retire(keep_last, by_commit_order=by_commit_order, dry_run=dry_run)

    def remove_bad(self, entry: Listed) -> None:
        self.near.remove_bad(entry)

    def close(self) -> None:
        self.near.close()
        self.far.close()
