"""Loading from the node-local tier: each rank reads its own part from its node's disk.

Collective (store only, every wait bounded): the ranks agree on the newest step complete for
every rank with one attempt (``roots._nodeparts.agree_parts``), each reads and verifies its own
files of that step on its node, and they agree on the outcome, so either every rank returns
the same step or every rank raises (its own error where it failed, ``CheckpointError`` naming
the failed ranks elsewhere). A rank whose node lacks its part
reads it from the persistent tier (``store``). No fallback to an older step yet: a corrupt part raises.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Mapping
from typing import Any

from .._errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, CheckpointReadError
from ..format._layout import step_dir_name
from ..format._manifest import MANIFEST
from ..ranks._agree import agree
from ..ranks._distributed import DistContext
from ..roots._nodeparts import agree_parts, read_part
from ..roots._registry import open_root
from ..threads._deadline import CallTimeout, Deadline, call_by
from ._load import load_rank
from ._resume import load_step

log = logging.getLogger("asyncckpt")


def load_part(
    dist: DistContext, key: str, root: str, step: int | None, verify: bool, by: Deadline,
    store: tuple[str, Mapping[str, str] | None, list[list[Any]] | None] | None = None,
) -> tuple[int, Any]:  # fmt: skip
    """This rank's state of the agreed step (``step``: that one, else the newest) and its number.
    ``store``: the persistent tier's URL, storage options and (rank 0) its resumable steps; a
    rank whose node lacks its part of the agreed step reads it from there.

    One deadline, ``by``, for the whole call: the agreement on the step, the reads (a read
    from the store or from this node's disk ends :func:`outcome_reserve` before it, so the
    ranks can still agree on the outcome: a local read that has not returned by then raises
    ``CheckpointReadError`` naming the rank and file) and the agreement on the outcome each
    get what the phases before them left.
    A rank late past it raises ``AgreeTimeout`` (a ``TimeoutError``) on every rank.

    Raises ``CheckpointNotFoundError`` on every rank when no step is complete for every rank
    in some tier (a node's disk empty, wiped, or holding another run's or attempt's files, and
    the step not on the store)."""
    steps = agree_parts(dist, f"{key}/parts", root, by, step, None if store is None else store[2])
    if not steps:
        what = f"step {step}" if step is not None else "a step"
        raise CheckpointNotFoundError(f"no node-local checkpoint under {root}: {what} complete for every rank with "
                                      "one attempt is on no node's disk")  # fmt: skip
    chosen, attempt, source = int(steps[-1][0]), str(steps[-1][1]), steps[-1][3][dist.rank]
    error: BaseException | None = None
    state: Any = None
    log.info("rank %d: loading step %d from %s", dist.rank, chosen, "its node's disk" if source == "local" else
             "the store")  # fmt: skip
    try:
        if source == "store":
            assert store is not None
            reads_by = by.before(outcome_reserve(by))
            far = open_root(store[0], storage_options=store[1], deadline_s=reads_by.remaining())
            state = load_step(far, chosen, rank=dist.rank, verify=verify, expect=attempt,
                              deadline=reads_by.monotonic)  # fmt: skip
        else:
            state = _read_local(root, chosen, attempt, dist.rank, verify, by.before(outcome_reserve(by)))
    except (CheckpointError, OSError) as e:
        error = e
    mine = {"error": None if error is None else f"{type(error).__name__}: {error}"}

    def decide(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
        return {"bad": [[r, o["error"]] for r, o in enumerate(outcomes) if o["error"]]}

    bad = agree(dist, f"{key}/outcome", mine, decide, by)["bad"]
    if error is not None:
        raise error
    if bad:
        raise CheckpointError(f"step {chosen} could not be loaded from the node-local root {root} on rank(s) "
                              f"{[r for r, _ in bad]}: {bad[0][1]}")  # fmt: skip
    return chosen, state


def outcome_reserve(by: Deadline) -> float:
    """Seconds of ``by`` a read from the store leaves to the agreement on the outcome: a
    quarter of what is left, at most 5 s."""
    return min(5.0, by.remaining() / 4)


def _read_local(root: str, chosen: int, attempt: str, rank: int, verify: bool, by: Deadline) -> Any:
    """Rank ``rank``'s part of ``attempt`` of step ``chosen`` from this node's ``root``, verified,
    by ``by``: a read the node's file system never answers (a hung server, a dead disk) raises
    ``CheckpointReadError`` (``ETIMEDOUT``) naming the rank and the file it was reading, in time
    for the agreement on the outcome (the read itself is left blocked on its own thread)."""
    step_dir = os.path.join(root, step_dir_name(chosen))
    at = [os.path.join(step_dir, MANIFEST)]  # the file being read, for the error

    def read() -> Any:
        m = read_part(root, chosen)
        if m.attempt != attempt:
            raise CheckpointCorruptError(f"holds attempt {m.attempt}, not the agreed {attempt}", step_dir)
        return load_rank(step_dir, m, rank, verify, reading=lambda path: at.__setitem__(0, path))

    try:
        return call_by(read, by, f"asyncckpt-nodeload-r{rank}")
    except CallTimeout:
        raise CheckpointReadError(errno.ETIMEDOUT, f"rank {rank}: reading its part of step {chosen} from this "
                                  "node's disk did not finish within the load's deadline", at[0]) from None
