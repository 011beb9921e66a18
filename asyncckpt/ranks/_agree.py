"""One agreement among the ranks on the caller's thread: every rank reports, rank 0 decides.

Used by collective reads (``Checkpointer.load``): each rank publishes what happened to it
under a key of the c10d store, rank 0 waits for all of them (bounded by the Checkpointer's
timeout), computes one verdict and publishes it, and every rank returns that same verdict.
Store calls only (``set``, ``wait`` with a deadline, ``check``, ``get``, ``compare_set``),
never collectives. The verdict is published with ``compare_set``: a follower that gives up on
rank 0 publishes a timeout verdict the same way, so whichever comes first is the one every
rank returns or raises (rank 0 arriving late adopts the follower's timeout).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..threads._deadline import Deadline
from ._distributed import DistContext

#: Followers wait this much longer than rank 0 for the verdict (rank 0 publishes one, an
#: error naming the missing ranks, when its own wait runs out).
_MARGIN_S = 5.0


class AgreeTimeout(TimeoutError):
    """Not every rank answered in time; ``missing`` names the ranks that did not (``(0,)``:
    rank 0 gave no verdict)."""

    def __init__(self, message: str, missing: tuple[int, ...]) -> None:
        super().__init__(message)
        self.missing = missing


def agree(
    dist: DistContext,
    key: str,
    mine: dict[str, Any],
    decide: Callable[[list[dict[str, Any]]], dict[str, Any]],
    timeout: float | Deadline,
) -> dict[str, Any]:
    """Publish ``mine``; return the verdict rank 0 computed with ``decide`` from every rank's.

    ``timeout``: seconds rank 0 waits for the others (they wait :data:`_MARGIN_S` longer, for
    rank 0's verdict naming the missing ranks), or a :class:`Deadline` of a larger operation
    that every rank's wait ends by (rank 0's a little before it, for the same reason).

    Raises :class:`AgreeTimeout` (a ``TimeoutError``) naming the ranks that did not report
    (rank 0's view) or naming rank 0 (a follower's) when the wait runs out; every rank that
    reads the verdict raises the same one.
    """
    if isinstance(timeout, Deadline):
        follow_s = timeout.remaining()
        lead_s = follow_s - min(_MARGIN_S, follow_s / 4)
    else:
        lead_s, follow_s = timeout, timeout + _MARGIN_S
    base = f"{dist.prefix}/{key}"
    verdict_key = f"{base}/verdict"
    store = dist.store
    if dist.rank != 0:
        store.set(f"{base}/r{dist.rank}", json.dumps(mine))
        try:
            store.wait([verdict_key], _wait_for(follow_s))
            got: dict[str, Any] = json.loads(store.get(verdict_key))
        except Exception as e:  # noqa: BLE001 - rank 0 is late or gone: give up on it, once
            msg = f"rank 0 did not answer {key!r} within {follow_s:.1f}s ({e})"
            try:
                got = _publish(store, verdict_key, {"kind": "timeout", "msg": msg, "missing": [0]})
            except Exception:  # noqa: BLE001 - the store itself is gone: nobody to agree with
                raise AgreeTimeout(f"asyncckpt: {msg}", (0,)) from e
        return _raise_timeout(got)
    keys = [f"{base}/r{r}" for r in range(1, dist.world_size)]
    try:
        if keys:
            store.wait(keys, _wait_for(lead_s))
    except Exception:  # noqa: BLE001 - a timeout: find out who is missing, tell the others
        missing = [r for r, k in enumerate(keys, start=1) if not _check(store, k)]
        msg = f"rank(s) {missing} did not report {key!r} within {lead_s:.1f}s"
        return _raise_timeout(_publish(store, verdict_key, {"kind": "timeout", "msg": msg, "missing": missing}))
    outcomes = [mine] + [json.loads(store.get(k)) for k in keys]
    return _raise_timeout(_publish(store, verdict_key, decide(outcomes)))


def _wait_for(seconds: float) -> timedelta:
    """A store wait of ``seconds``, at least a moment: a zero timeout is no bound to a c10d store."""
    return timedelta(seconds=max(seconds, 0.01))


def _publish(store: Any, key: str, verdict: dict[str, Any]) -> dict[str, Any]:
    """Set ``key`` to ``verdict`` unless a verdict is there already; return the one that stands."""
    stood: dict[str, Any] = json.loads(store.compare_set(key, "", json.dumps(verdict)))
    return stood


def _raise_timeout(verdict: dict[str, Any]) -> dict[str, Any]:
    if verdict.get("kind") == "timeout":
        raise AgreeTimeout(f"asyncckpt: {verdict['msg']}", tuple(verdict.get("missing", ())))
    return verdict


def _check(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001
        return False
