"""A Checkpointer's start on its root: made, shared, taken, cleaned up, surveyed.

On a file-system root (:func:`start_on_root`): rank 0 creates the root; with many ranks,
every rank then checks it sees the same directory (``_sharedroot``), before anything is
written to it; only then rank 0 takes ownership (``_ownership``), removes the leftovers,
dead now that the root is its, and lists the committed steps. On an object-store root
(:func:`remote_start`): rank 0 checks the store enforces conditional creates, takes the
root's lease (``_lease``) and removes the dead leftovers. Each is bounded by one deadline
counted from the constructor's call, at most :data:`START_S`.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._errors import CheckpointError, CheckpointReadError
from ..ranks import _sharedroot
from ..ranks._distributed import DistContext
from ..threads._deadline import CallTimeout, Deadline, call_by
from ..threads._sync import run_sync
from .posix import _discovery, _ownership
from .posix._ensure_dir import ensure_dir
from .posix._osops import OsOps
from .posix._ownership import Ownership
from .posix._retention import leftovers, remove_leftovers

if TYPE_CHECKING:
    from .objstore._lease import Lease

#: Longest a construction waits in all, whatever ``timeout`` (a store that does not answer, a
#: rank that does not see the root): what the constructor's waits are bounded by.
START_S = 120.0
_REFUSED = (errno.EROFS, errno.EACCES, errno.EPERM)


def start_on_root(
    root: str,
    ops: OsOps,
    own: Ownership | None,
    dist: DistContext | None,
    key: str,
    timeout: float,
    ranks: Sequence[int],
    dead: set[str],
    by: Deadline,
) -> tuple[BaseException | None, list[int]]:
    """Construction on a file-system root, on every rank of the group (``own``: rank 0's
    ownership to fill in; ``key``: the construction's store key, ``DistContext.start_key``).

    Returns rank 0's start-up failure (``None`` on the others: rank 0 shares its own, with
    ``DistContext.agree_at_start``) and the committed steps (rank 0's). The names of the
    leftovers it removed go into ``dead`` (a retry of their step may remove what remains).
    Rank 0's mkdir of the root ends by ``by``.
    """
    failure: BaseException | None = None
    if own is not None:
        try:  # on a thread of its own: a mkdir the file system never answers has no deadline of its own
            call_by(lambda: make_root(root, timeout, ops), by, "asyncckpt-rootmake")
        except CallTimeout:
            failure = CheckpointReadError(errno.ETIMEDOUT, "making the root did not finish within the "
                                          "construction's deadline", root)  # fmt: skip
        except (CheckpointError, OSError, ValueError) as e:
            failure = e
    if dist is not None:
        window = min(timeout, START_S)
        unshared: BaseException | None
        try:
            unshared = _sharedroot.check(dist, key, root, failure is not None, timeout, window, tuple(ranks))
        except OSError as e:  # rank 0 could not place its token: the root is not writable
            unshared = not_writable_or(root, e)
        failure = failure or unshared
    if own is None or failure is not None:
        return failure, []
    try:
        # not on a thread of its own (unlike the mkdir): a take that outlived a construction which
        # gave up would remove the leftovers of the next owner's saves once it released the root
        return None, take_root(root, ranks, own, dead, ops)
    except (CheckpointError, OSError, ValueError) as e:
        return e, []


def node_start(
    root: str, ops: OsOps, own: Ownership | None, timeout: float, ranks: Sequence[int], dead: set[str]
) -> None:
    """A node's leader on a node-local root (``saving._nodelocal``; ``own``: its ownership to
    fill in): make the root on its node's disk, take it, remove the leftovers. No shared-root
    check: the disks differ by design."""
    assert own is not None, "only a node's leader starts on its disk"
    make_root(root, timeout, ops)
    take_root(root, ranks, own, dead, ops)


def make_root(root: str, timeout: float, ops: OsOps) -> None:
    """Rank 0: create the root (``RootNotWritableError`` if it cannot)."""
    try:
        ensure_dir(root, timeout=min(timeout, 60.0), ops=ops)
    except OSError as e:
        refused = not_writable_or(root, e)
        if refused is e:
            raise
        raise refused from e


def take_root(root: str, ranks: Sequence[int], own: Ownership, dead: set[str], ops: OsOps) -> list[int]:
    """Rank 0, the root made (and shared): take ownership (into ``own``), then clean up
    leftovers; return the committed steps. The caller releases ``own`` on failure."""
    _ownership.acquire(root, ranks, into=own)
    # leftovers present now, with the root ours, are dead: a retry may remove them
    dead.update(os.path.basename(p) for p in leftovers(root))
    try:
        remove_leftovers(root, ops)
    except OSError as e:
        if e.errno in _REFUSED:
            raise _ownership.not_writable(root, e) from e
        raise
    return [i.step for i in _discovery.resumable(root)]


def not_writable_or(root: str, e: OSError) -> OSError:
    """``RootNotWritableError`` for a refusal (EROFS, EACCES, EPERM), else ``e`` itself."""
    if isinstance(e, PermissionError) or e.errno in _REFUSED:
        return _ownership.not_writable(root, e)
    return e


def remote_start(lease: Lease, timeout: float, start: float) -> tuple[list[int], set[int]]:
    """Rank 0 at construction under an object-store root: check the store enforces
    conditional creates (``ConditionalWriteUnsupportedError`` if not), take the root's
    lease (``RootInUseError`` naming a live owner), then remove the leftovers, dead now
    that the root is ours. Returns the complete steps and every step prefix looked at.

    One deadline for all of it, counted from ``start`` (the constructor's call):
    ``min(timeout, 120 s)``, or up to twice the lease's TTL when ``timeout`` allows, to
    wait out a dead owner's lease; a store that does not answer fails it by then."""
    from .objstore._leftovers import remove_dead

    budget = min(timeout, START_S)
    end = start + max(budget, min(timeout, 2 * lease.ttl + 10.0))

    async def go() -> tuple[list[int], set[int]]:
        await lease.store.probe(start + budget)
        # a dead owner's lease is taken over once its TTL passed: wait up to that long
        await lease.take(end)
        found = await remove_dead(lease.store, min(end, time.monotonic() + budget))
        return found.complete, found.seen

    return run_sync(go)
