"""Loading from the node-local tier: each rank reads its own part from its node's disk.

Collective (store only, every wait bounded): the ranks agree on the newest step complete for
every rank with one attempt (``roots._nodeparts.agree_parts``), each reads and verifies its own
files of that step on its node, and they agree on the outcome, so either every rank returns
the same step or every rank raises (its own error where it failed, ``CheckpointError`` naming
the failed ranks elsewhere). A rank whose node lacks its part
reads it from the persistent tier (``store``). With a memory tier (``saving._memtier``) a rank
reads from its node's memory when it holds that very attempt; a read that fails there (a
corrupt or missing file) goes on to the next tier holding the same attempt (its node's disk,
then the store): never to another step. With the peer replica, a rank whose buddy holds its
part fetches it from there after its own memory (``_peerread``: memory, peer, disk, store).
A part that no tier of the agreed attempt can serve because its bytes are damaged there (a
content fault: ``CheckpointCorruptError``, the rule of ``_resume.decide``) makes every rank
fall back to the next older step complete for every rank, after each node records the step's
attempt bad on its disk (the next start passes over it, and ``save()`` may take the step again);
any other failure (an I/O error, a timeout) raises on every rank: that step may be good. A
``load(step=N)`` never falls back.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointError, CheckpointNotFoundError, CheckpointReadError
from ..ranks._agree import agree
from ..ranks._distributed import DistContext
from ..roots._badmarks import record_bad
from ..roots._nodeparts import NodePart, agree_parts
from ..roots._registry import open_root
from ..threads._deadline import CallTimeout, Deadline, call_by
from ._peerread import fetch, read_fetched
from ._resume import decide, load_step, outcome_of

if TYPE_CHECKING:
    from ..roots.replica import PeerTier

log = logging.getLogger("asyncckpt")


def load_part(
    dist: DistContext, key: str, root: str, step: int | None, verify: bool, by: Deadline,
    store: tuple[str, Mapping[str, str] | None, list[list[Any]] | None] | None = None, memory: str | None = None,
    peer: PeerTier | None = None,
) -> tuple[int, Any]:  # fmt: skip
    """This rank's state of the agreed step (``step``: that one, else the newest) and its number.
    ``store``: the persistent tier's URL, storage options and (rank 0) its resumable steps; a
    rank whose node lacks its part of the agreed step reads it from there. ``peer``: the peer
    replica (``replicate=True``): a rank whose buddy holds its part reads it from there before
    its node's disk (``_peerread``).

    One deadline, ``by``, for the whole call: the agreement on the step, the reads (a read
    from the store or from this node's disk ends :func:`outcome_reserve` before it, so the
    ranks can still agree on the outcome: a local read that has not returned by then raises
    ``CheckpointReadError`` naming the rank and file) and the agreement on the outcome each
    get what the phases before them left.
    A rank late past it raises ``AgreeTimeout`` (a ``TimeoutError``) on every rank.

    Raises ``CheckpointNotFoundError`` on every rank when no step is complete for every rank
    in some tier (a node's disk empty, wiped, or holding another run's or attempt's files, and
    the step not on the store)."""
    steps = agree_parts(dist, f"{key}/parts", root, by, step, None if store is None else store[2], memory,
                        None if peer is None else peer.sources)  # fmt: skip
    if not steps:
        what = f"step {step}" if step is not None else "a step"
        raise CheckpointNotFoundError(f"no node-local checkpoint under {root}: {what} complete for every rank with "
                                      "one attempt is on no node's disk")  # fmt: skip
    # newest first; an older one only after a content fault (module docstring), never for a given step
    picks = steps[::-1] if step is None else steps[-1:]
    for n, pick in enumerate(picks):
        chosen, attempt, every = int(pick[0]), str(pick[1]), [list(t) for t in pick[4]]
        state, error = _read_part(dist, root, chosen, attempt, every, verify, by, store, memory, peer)
        outcome_key = f"{key}/outcome" if n == 0 else f"{key}/outcome/{chosen}"
        verdict = agree(dist, outcome_key, outcome_of(error), lambda outs: decide(step is not None, outs), by)
        if verdict["kind"] == "ok":
            return chosen, state
        failures = {int(r): o for r, o in verdict["failures"].items()}
        if verdict["kind"] == "fallback" and n + 1 < len(picks):
            state = None
            first = failures[min(failures)]
            # on this node's disk (every rank of it, the same mark): the next start's agreement
            # passes over the attempt, rank 0's root no longer counts it resumable, so save()
            # may take the step again (the node parts of that attempt are set aside then)
            record_bad(root, chosen, attempt, first.get("path") or root, f"rank {min(failures)}: {first['msg']}")
            log.warning("rank %d: step %d cannot be loaded: rank(s) %s hold a damaged part in every tier (%s); "
                        "marked bad on this node, falling back to step %d", dist.rank, chosen, sorted(failures),
                        first["msg"], int(picks[n + 1][0]))  # fmt: skip
            continue
        if error is not None:
            raise error
        r = min(failures)
        raise CheckpointError(f"step {chosen} could not be loaded from the node-local root {root} on rank(s) "
                              f"{sorted(failures)}: {failures[r]['type']}: {failures[r]['msg']}")  # fmt: skip
    raise AssertionError("unreachable: the last pick returns or raises")


def _read_part(
    dist: DistContext, root: str, chosen: int, attempt: str, every: list[list[str]], verify: bool, by: Deadline,
    store: tuple[str, Mapping[str, str] | None, Any] | None, memory: str | None, peer: PeerTier | None,
) -> tuple[Any, BaseException | None]:  # fmt: skip
    """This rank's part of ``attempt`` of step ``chosen`` from its tiers (``every[rank]``, fastest
    first; the next one on a failed read, same step and attempt): its state, or the last error.
    The peer replica's fetch is collective: every rank takes part once some rank's tiers name it."""
    tiers = every[dist.rank]
    error: BaseException | None = None
    state: Any = None
    done = False

    def read(source: str, how: Callable[[], Any]) -> None:
        nonlocal state, error, done
        log.info("rank %d: loading step %d from %s", dist.rank, chosen, _WHERE[source])
        try:
            state, error, done = how(), None, True
        except (CheckpointError, OSError) as e:
            error = e
            if source != tiers[-1]:
                log.warning("rank %d: step %d could not be read from %s (%s: %s); falling back to the same step "
                            "from %s", dist.rank, chosen, _WHERE[source], type(e).__name__, e,
                            _WHERE[tiers[tiers.index(source) + 1]])  # fmt: skip

    def tier(source: str) -> Callable[[], Any]:
        return lambda: _read_from(source, root, memory, store, chosen, attempt, dist, verify, by)

    k = tiers.index("peer") if "peer" in tiers else len(tiers)
    for source in tiers[:k]:
        read(source, tier(source))
        if done:
            break
    if peer is not None and memory is not None and any("peer" in t for t in every):
        need = not done and k < len(tiers)
        reads_by = by.before(outcome_reserve(by))
        got = fetch(peer, chosen, attempt, need, reads_by.remaining() / 2, dist.rank)
        if need:
            read("peer", lambda: _from_peer(got, memory, chosen, attempt, dist))
    for source in tiers[k + 1 :]:
        if done:
            break
        read(source, tier(source))
    return state, error


_WHERE = {"memory": "its node's memory tier", "peer": "its buddy's memory (the peer replica)",
          "local": "its node's disk", "store": "the store"}  # fmt: skip


def _from_peer(got: Any, memory: str, chosen: int, attempt: str, dist: DistContext) -> Any:
    """A needer's part from what its fetch returned (its files, or the error that says why not)."""
    if isinstance(got, BaseException):
        raise got
    if got is None:
        raise CheckpointNotFoundError(f"rank {dist.rank}: its buddy sent no replica of step {chosen}")
    return read_fetched(got, memory, chosen, attempt, dist.rank, dist.world_size)


def _read_from(
    source: str, root: str, memory: str | None, store: tuple[str, Mapping[str, str] | None, Any] | None,
    chosen: int, attempt: str, dist: DistContext, verify: bool, by: Deadline,
) -> Any:  # fmt: skip
    """This rank's part of the agreed attempt from one tier: ``CheckpointError`` when the step was
    saved by another number of ranks (a node-local step loads on its own world size only: the
    parts a restart with other ranks finds are not its ranks' state)."""
    reads_by = by.before(outcome_reserve(by))
    if source == "store":
        assert store is not None
        far = open_root(store[0], storage_options=store[1], deadline_s=reads_by.remaining())
        return load_step(far, chosen, rank=dist.rank, verify=verify, world_size=dist.world_size, expect=attempt,
                         deadline=reads_by.monotonic)  # fmt: skip
    where = root if source == "local" else memory
    assert where is not None
    return _read_local(where, chosen, attempt, dist, verify, reads_by)


def outcome_reserve(by: Deadline) -> float:
    """Seconds of ``by`` a read from the store leaves to the agreement on the outcome: a
    quarter of what is left, at most 5 s."""
    return min(5.0, by.remaining() / 4)


def _read_local(root: str, chosen: int, attempt: str, dist: DistContext, verify: bool, by: Deadline) -> Any:
    """This rank's (``dist``) part of ``attempt`` of step ``chosen`` from this node's ``root``, verified,
    by ``by`` (``_resume.load_step`` through the node's part, ``roots._nodeparts.NodePart``): a
    read the node's file system never answers (a hung server, a dead disk) raises
    ``CheckpointReadError`` (``ETIMEDOUT``) naming the rank and the file it was reading, in time
    for the agreement on the outcome (the read itself is left blocked on its own thread)."""
    rank = dist.rank
    part = NodePart(root, [rank])

    def read() -> Any:
        return load_step(part, chosen, rank=rank, verify=verify, world_size=dist.world_size, expect=attempt,
                         deadline=by.monotonic)  # fmt: skip

    try:
        return call_by(read, by, f"asyncckpt-nodeload-r{rank}")
    except CallTimeout:
        raise CheckpointReadError(errno.ETIMEDOUT, f"rank {rank}: reading its part of step {chosen} from this "
                                  "node's disk did not finish within the load's deadline", part.at) from None
