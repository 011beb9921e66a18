"""Run one function on every rank of a process group and agree on the outcome, with a deadline.

The pattern this replaces, as NeMo Automodel 0.7.0's ``_ensure_dirs`` has it::

    _create_dirs(*dirs)                  # a rank raises FileExistsError (a stale cache) ...
    torch.distributed.barrier(group)     # ... and the others wait here for it, forever

A barrier has no outcome: a rank that failed either never arrives (it raised, and lives on
in an exception handler or a retry: the others wait for the process group's timeout, 30
minutes by default) or exits (the others die with "Connection closed by peer", naming
nobody). :func:`on_every_rank` makes the outcome a value: every rank runs ``fn``, reports
its result or its exception through the c10d store (``_agree.agree``: set, ``wait`` with a
deadline, ``compare_set``; never a collective, so nothing here can interleave with the
training loop's collectives), and every rank returns the same list of results or raises the
same :class:`~asyncckpt.RanksFailedError` naming the ranks that failed.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from typing import Any

from .._errors import RankFailure, RanksFailedError, RanksTimeoutError, with_global_ranks
from . import _agree, _distributed

#: Calls per group so far: the n-th call on every rank of a group is the same call (as with
#: any collective, every rank must make the same calls in the same order).
_calls: dict[str, int] = {}
_calls_lock = threading.Lock()


def on_every_rank(fn: Callable[[], Any], *, group: Any = None, timeout: float = 300.0) -> list[Any]:
    """Call ``fn()`` on every rank of ``group``; return every rank's result, in rank order.

    Collective: every rank of ``group`` (default: the default process group) must call it,
    the same number of times and in the same order. Each rank runs its own ``fn`` (it may
    do different work on different ranks: create the shared directories on one rank and its
    own file on every rank, say), then:

    * if ``fn`` returned on every rank, every rank gets the list of results indexed by the
      rank in ``group``;
    * if ``fn`` raised on some ranks, every rank raises the same :class:`RanksFailedError`,
      whose ``failures`` maps each failed rank to its exception type, message, errno and
      path (on a failed rank its own exception is the ``__cause__``);
    * if a rank does not answer (it died, hangs inside ``fn``, or never called this), every
      rank that is still there raises the same :class:`RanksTimeoutError` (also a
      ``TimeoutError``) naming the ranks in ``missing``.

    ``timeout`` (seconds) bounds each rank's wait for the others once its own ``fn``
    returned: rank 0 waits that long for every report, the others 5 s longer for rank 0's
    verdict. Results travel as JSON through the c10d store (str, int, float, bool, None,
    lists, dicts with str keys; tuples come back as lists), so keep them small: paths,
    sizes, flags; a result JSON cannot carry is a ``TypeError`` failure of that rank.
    Exceptions that are not ``Exception`` (``KeyboardInterrupt``, ``SystemExit``) are not
    caught: that rank leaves, and the others time out naming it.

    Without ``torch.distributed`` initialized (one process) ``fn`` runs once and its result
    is returned as ``[result]``; its exception still becomes a ``RanksFailedError``.

    Example, the all-rank directory creation that a barrier gets wrong::

        on_every_rank(lambda: [asyncckpt.ensure_dir(d) for d in dirs], timeout=60)
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {type(fn).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a finite number of seconds > 0, not {timeout!r}")
    what = f"on_every_rank({getattr(fn, '__qualname__', type(fn).__name__)})"
    dist = _distributed.resolve(group, timeout)
    if dist is None:
        try:
            return [fn()]
        except Exception as e:
            raise RanksFailedError(what, {0: RankFailure.from_exception(0, e)}) from e
    error: Exception | None = None
    value: Any = None
    try:
        # what the other ranks will see of the result (a result JSON cannot carry: TypeError)
        value = json.loads(json.dumps(fn()))
    except Exception as e:  # noqa: BLE001 - reported to every rank, raised below by all
        error = e
    if error is None:
        mine: dict[str, Any] = {"ok": True, "value": value}
    else:
        mine = {"ok": False, "failure": _encode(RankFailure.from_exception(dist.rank, error))}
    key = _next_key(group)
    try:
        verdict = _agree.agree(dist, key, mine, _decide, timeout)
    except _agree.AgreeTimeout as e:
        raise RanksTimeoutError(what, {}, missing=e.missing, detail=_first_line(e)) from error
    if verdict["kind"] == "ok":
        return list(verdict["values"])
    failures = {int(r): _decode(f) for r, f in verdict["failures"].items()}
    raise RanksFailedError(what, with_global_ranks(failures, _group_ranks(group))) from error


def _decide(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    failures = {str(r): o["failure"] for r, o in enumerate(outcomes) if not o["ok"]}
    if failures:
        return {"kind": "error", "failures": failures}
    return {"kind": "ok", "values": [o["value"] for o in outcomes]}


def _encode(f: RankFailure) -> dict[str, Any]:
    return {"rank": f.rank, "exc_type": f.exc_type, "message": f.message, "errno": f.errno, "path": f.path}


def _decode(d: dict[str, Any]) -> RankFailure:
    return RankFailure(int(d["rank"]), str(d["exc_type"]), str(d["message"]), d.get("errno"), d.get("path"))


def _group_name(group: Any) -> str:
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return "world"
    return str(getattr(group, "group_name", None) or "-".join(map(str, dist.get_process_group_ranks(group))))


def _group_ranks(group: Any) -> list[int] | None:
    """Global ranks of ``group`` in group-rank order (``None`` for the default group)."""
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return None
    return list(dist.get_process_group_ranks(group))


def _next_key(group: Any) -> str:
    name = _group_name(group)
    with _calls_lock:
        n = _calls[name] = _calls.get(name, 0) + 1
    return f"asyncckpt/every/{name}/{n}"


def _first_line(e: BaseException) -> str:
    text = str(e).removeprefix("asyncckpt: ")
    return text.splitlines()[0] if text else type(e).__name__
