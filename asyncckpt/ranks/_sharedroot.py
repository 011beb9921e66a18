"""Whether every rank of a group sees the same root directory: checked at construction.

A root on node-local disks (the same path on every node, a different disk behind it) looks
fine to each rank on its own, and then every save fails as "a file listed in the manifest
is missing", leaves each other node's shards behind, and a load on another node may read
an earlier run's files lying at the same path. So before any rank writes anything to the
root, rank 0 places a token, a file with a random name, in it and tells the others the
name through the c10d store; each other rank looks for it in its own view of the root,
polling (a shared file system may show a new name late: NFS attribute caches, FUSE entry
timeouts) until the construction deadline; rank 0 collects every answer, removes the token
and fails the construction of every rank (``CheckpointError`` naming the ranks) if one did
not see it. Store calls only (``set``, ``wait`` with a deadline, ``check``, ``get``), never
collectives.
"""

from __future__ import annotations

import errno
import json
import os
import time
import uuid
from datetime import timedelta
from typing import Any

from .._errors import CheckpointError, CheckpointReadError, CoordinationLost, describe_ranks
from ..threads._deadline import CallTimeout, Deadline, call_by
from ._coordination import CALL_S, is_store_timeout, lost_message
from ._distributed import DistContext

#: The token's name in the root: a dot file no reader or clean-up looks at.
TOKEN_PREFIX = ".asyncckpt-shared-"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: How often a rank looks for the token again (each look is a lookup on the file system).
_POLL_S = (0.02, 0.5)


def place_token(root: str) -> str:
    """Create the token file in ``root`` (an existing directory); return its random part."""
    nonce = uuid.uuid4().hex
    fd = os.open(os.path.join(root, TOKEN_PREFIX + nonce),
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)  # fmt: skip
    try:
        os.write(fd, nonce.encode())
    finally:
        os.close(fd)  # close-to-open: an NFS client of another node sees it from here on
    return nonce


def remove_token(root: str, nonce: str) -> None:
    try:
        os.unlink(os.path.join(root, TOKEN_PREFIX + nonce))
    except FileNotFoundError:
        pass


def sees_token(root: str, nonce: str, deadline: float) -> bool:
    """Whether the token shows up in this rank's view of ``root`` before ``deadline``."""
    path = os.path.join(root, TOKEN_PREFIX + nonce)
    pause = _POLL_S[0]
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ESTALE, errno.ENOTDIR):
                raise
        else:
            try:
                if os.read(fd, 64) == nonce.encode():
                    return True
            finally:
                os.close(fd)
        if time.monotonic() + pause > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, _POLL_S[1])


def check(dist: DistContext, key: str, root: str, start_failed: bool, wait_s: float, window_s: float,
          ranks: tuple[int, ...]) -> CheckpointError | None:  # fmt: skip
    """Collective, at construction, before anything is written to ``root`` (the caller's
    rank 0 has only made sure it exists). ``start_failed``: rank 0 could not even do that
    (its error reaches every rank later, with the rest of its start-up): nothing to check.

    A rank waits ``wait_s`` for rank 0 to place the token (the ranks may start apart, as
    with any collective), then looks for it for ``window_s``; rank 0 waits for the answers
    (and a little more) that long. Rank 0
    returns the error every rank must raise when a rank did not see its token (or did not
    answer: it may not have started);
    ``None`` when every rank shares the root; it raises ``OSError`` when it cannot place
    the token (after telling the others). Other ranks always return ``None``: they hear
    rank 0's verdict with the rest of its start-up (``DistContext.agree_at_start``). A rank
    whose look the file system holds (a hung NFS server) answers once ``window_s`` and a
    second have passed, the look left blocked on a thread of its own: rank 0 then returns
    ``CheckpointReadError`` (``ETIMEDOUT``) naming it.
    """
    base = f"{key}/shared"
    if dist.rank != 0:
        doc = dist.wait_get(base, wait_s)
        seen, stuck = False, False
        if not doc.get("skip"):
            end = time.monotonic() + window_s
            try:  # a lookup has no deadline of its own: one the file system holds is not waited out
                seen = call_by(lambda: sees_token(root, str(doc["token"]), end), Deadline.at_monotonic(end + 1.0),
                               f"asyncckpt-sharedlook-r{dist.rank}")  # fmt: skip
            except CallTimeout:
                stuck = True
        _set(dist, f"{base}/r{dist.rank}", {"seen": seen, "skipped": bool(doc.get("skip")), "stuck": stuck})
        return None
    if start_failed:
        _set(dist, base, {"skip": True})
        return None
    try:
        nonce = place_token(root)
    except OSError:
        _set(dist, base, {"skip": True})  # the error reaches the others with rank 0's start-up
        raise
    try:
        _set(dist, base, {"token": nonce})
        answers = _collect(dist, base, time.monotonic() + wait_s + window_s + _ANSWER_GRACE_S)
    finally:
        remove_token(root, nonce)
    held = [r for r, a in answers.items() if a is not None and a.get("stuck")]
    blind = [r for r, a in answers.items() if a is not None and not a.get("seen") and r not in held]
    silent = [r for r, a in answers.items() if a is None]
    if not blind and not silent and not held:
        return None
    if held and not blind and not silent:  # a file system that stopped answering, not a different disk
        return CheckpointReadError(errno.ETIMEDOUT, f"asyncckpt: rank(s) {describe_ranks(held, ranks)}: looking "
                                   f"for a file rank 0 created in the root did not finish within {window_s:.0f}s "
                                   "(the file system did not answer); nothing was written", root)  # fmt: skip
    parts = []
    if blind:
        parts.append(f"rank(s) {describe_ranks(blind, ranks)} did not see a file rank 0 created in it "
                     f"within {window_s:.0f}s")
    if silent:
        parts.append(f"rank(s) {describe_ranks(silent, ranks)} did not answer in time (not started?)")
    if held:
        parts.append(f"rank(s) {describe_ranks(held, ranks)}: the file system did not answer the look")
    return CheckpointError(
        f"asyncckpt: the ranks do not share the checkpoint root {root}: {'; '.join(parts)}. The same path "
        "on different disks (node-local storage) needs node_local=True (each node keeps its own ranks' "
        "files: docs/node-local.md) or a shared file system every rank mounts (NFS, Lustre, GPFS, a FUSE "
        "mount of a bucket, ...); nothing was written"
    )


#: How long past the deadline rank 0 waits for an answer (a rank that polled to the deadline
#: still has to say so).
_ANSWER_GRACE_S = 5.0


def _set(dist: DistContext, key: str, value: Any) -> None:
    try:
        dist.store.set(key, json.dumps(value))
    except Exception as e:
        raise CoordinationLost(lost_message(e)) from e


def _collect(dist: DistContext, base: str, deadline: float) -> dict[int, Any]:
    """Every other rank's answer (``None`` for one that did not answer by ``deadline``)."""
    keys = {r: f"{base}/r{r}" for r in range(1, dist.world_size)}
    while keys and time.monotonic() < deadline:
        remaining = deadline - time.monotonic()
        try:
            dist.store.wait(list(keys.values()), timedelta(seconds=min(max(remaining, 0.01), CALL_S)))
            break
        except Exception as e:
            if not is_store_timeout(e):
                raise CoordinationLost(lost_message(e)) from e
    out: dict[int, Any] = {}
    for r, k in keys.items():
        try:
            out[r] = json.loads(dist.store.get(k)) if dist.store.check([k]) else None
        except Exception as e:
            raise CoordinationLost(lost_message(e)) from e
    return out


def check_node_disks(
    dist: DistContext, key: str, root: str, node_of: list[int], tokens: dict[int, str], timeout: float | Deadline,
    names: list[str],
) -> CheckpointError | None:  # fmt: skip
    """Collective, on a node-local root (``saving._nodelocal``) once each node's leader placed a
    token (``tokens``: leader rank -> its nonce) in its disk's ``root``: every rank looks for
    every token, and must see exactly its own node's (``node_of[rank]``; ``names[k]`` node
    ``k``'s name). The error every rank raises when a rank's node name does not match its disk
    (``ASYNCCKPT_NODE`` set wrong, or two nodes on one disk), ``None`` when all match. No
    polling: a node-local disk shows a file at once; the caller removes the tokens after.

    The look is bounded by ``timeout`` like the agreement: a rank whose disk never answers it
    raises ``CheckpointReadError`` (``ETIMEDOUT``) naming itself and ``root`` by then (its
    lookup is left blocked on a thread of its own), the others ``AgreeTimeout`` naming it."""
    from ._agree import agree

    by = timeout if isinstance(timeout, Deadline) else Deadline.after(timeout)
    mine_node = node_of[dist.rank]

    def look() -> list[list[Any]]:
        wrong = []
        for leader, nonce in sorted(tokens.items()):
            seen = os.path.lexists(os.path.join(root, TOKEN_PREFIX + nonce))
            if seen != (node_of[leader] == mine_node):
                wrong.append([node_of[leader], seen])
        return wrong

    try:  # a lookup has no deadline of its own (a disk that stopped answering holds it)
        wrong = call_by(look, by, f"asyncckpt-nodelook-r{dist.rank}")
    except CallTimeout:
        raise CheckpointReadError(errno.ETIMEDOUT, f"rank {dist.rank}: looking for the nodes' tokens on this "
                                  "node's disk did not finish within the construction's deadline", root) from None

    def decide(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
        problems = []
        for r, o in enumerate(outcomes):
            for k, seen in o["wrong"]:
                what = "sees the disk of node" if seen else "does not see the disk of its own node"
                problems.append(f"rank {r} (node {names[node_of[r]]!r}) {what} {names[k]!r}")
        return {"problems": problems}

    problems = agree(dist, f"{key}/node-disks", {"wrong": wrong}, decide, by)["problems"]
    if not problems:
        return None
    shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
    return CheckpointError(
        f"asyncckpt: node_local=True, but the ranks' node names do not match the disks behind {root}: {shown}. "
        "The ranks of one node (same ASYNCCKPT_NODE, else the same host name) must share one disk there, and "
        "two nodes never one; nothing was written"
    )
