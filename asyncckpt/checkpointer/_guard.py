"""The backstop of every save: bounded by its deadline, any escape turned into a ``SaveError``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from .._errors import RankFailure, SaveError, SaveTimeoutError, with_global_ranks
from .._info import CheckpointInfo
from ..saving._savejob import SaveJob
from ..saving._verdict import LEADER_SILENT_UNKNOWN

#: Past the save deadline, when a save that is still running is given up (``guarded``).
GUARD_S = 2.5


async def guarded(coro: Any, job: SaveJob, rank: int, ranks: Sequence[int] = ()) -> CheckpointInfo:
    """Bound the whole save by its deadline and turn any escape into a ``SaveError``.

    Every phase of a save is bounded by its deadline (``_commit``), so this is a backstop
    for a rank whose own calls overran it. A follower still waiting here past the deadline
    is waiting on rank 0: the coordinator, which usually also hosts the c10d store (a
    stopped rank 0 freezes the store, so no store call of ours can complete). It names rank
    0, within timeout + 2.5 s. Rank 0 past its deadline here names itself: no wait of its
    own is for another rank beyond the deadline.
    """
    follower = rank != 0
    remaining = job.deadline - time.monotonic() + GUARD_S
    try:
        result: CheckpointInfo = await asyncio.wait_for(coro, remaining)
        return result
    except SaveError:
        raise
    except TimeoutError as e:
        if follower:
            failure = RankFailure(0, "TimeoutError", "rank 0 (the coordinator and store host) did not answer in time")
            failures = with_global_ranks({0: failure}, ranks)
            raise SaveTimeoutError(job.step, failures, missing=(0,), detail=LEADER_SILENT_UNKNOWN) from e
        failure = RankFailure(rank, "TimeoutError", f"the save did not finish within its {job.timeout:.1f}s deadline")
        raise SaveTimeoutError(job.step, with_global_ranks({rank: failure}, ranks)) from e
    except Exception as e:
        raise SaveError(job.step, with_global_ranks({rank: RankFailure.from_exception(rank, e)}, ranks)) from e
