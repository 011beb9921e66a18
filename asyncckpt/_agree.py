"""One agreement among the ranks on the caller's thread: every rank reports, rank 0 decides.

Used by collective reads (``Checkpointer.load``): each rank publishes what happened to it
under a key of the c10d store, rank 0 waits for all of them (bounded by the Checkpointer's
timeout), computes one verdict and publishes it, and every rank returns that same verdict.
Store calls only (``set``, ``wait`` with a deadline, ``check``, ``get``), never collectives.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ._distributed import DistContext

#: Followers wait this much longer than rank 0 for the verdict (rank 0 publishes one, an
#: error naming the missing ranks, when its own wait runs out).
_MARGIN_S = 5.0


def agree(
    dist: DistContext,
    key: str,
    mine: dict[str, Any],
    decide: Callable[[list[dict[str, Any]]], dict[str, Any]],
    timeout: float,
) -> dict[str, Any]:
    """Publish ``mine``; return the verdict rank 0 computed with ``decide`` from every rank's.

    Raises ``TimeoutError`` naming the ranks that did not report (rank 0) or naming rank 0
    (the others) when the wait runs out.
    """
    base = f"{dist.prefix}/{key}"
    verdict_key = f"{base}/verdict"
    store = dist.store
    if dist.rank != 0:
        store.set(f"{base}/r{dist.rank}", json.dumps(mine))
        try:
            store.wait([verdict_key], timedelta(seconds=timeout + _MARGIN_S))
            got: dict[str, Any] = json.loads(store.get(verdict_key))
        except Exception as e:
            raise TimeoutError(
                f"asyncckpt: rank 0 did not answer {key!r} within {timeout + _MARGIN_S:.0f}s ({e})"
            ) from e
        if got.get("kind") == "timeout":
            raise TimeoutError(f"asyncckpt: {got['msg']}")
        return got
    keys = [f"{base}/r{r}" for r in range(1, dist.world_size)]
    try:
        if keys:
            store.wait(keys, timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - a timeout: find out who is missing, tell the others
        missing = [r for r, k in enumerate(keys, start=1) if not _check(store, k)]
        msg = f"rank(s) {missing} did not report {key!r} within {timeout:.0f}s"
        store.set(verdict_key, json.dumps({"kind": "timeout", "msg": msg}))
        raise TimeoutError(f"asyncckpt: {msg}") from None
    outcomes = [mine] + [json.loads(store.get(k)) for k in keys]
    verdict = decide(outcomes)
    store.set(verdict_key, json.dumps(verdict))
    return verdict


def _check(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001
        return False
