"""Rank coordination for one save: agree on the attempt, collect results, share the verdict.

Every method is awaited on the writer thread's loop, by every rank, in the same order:

1. :meth:`Coordinator.begin` - the leader (rank 0) prepares the attempt directory and
   publishes ``(attempt, error, tiers)`` (the start word; ``tiers``: where the save goes, as
   rank 0's clock decided: ``saving._frequency``); the others wait for it.
2. :meth:`Coordinator.report` - each rank publishes what it wrote (or why it failed); the
   leader receives every rank's report, or learns which ranks did not answer in time.
3. :meth:`Coordinator.decide` - the leader publishes the verdict (committed or failed);
   the others wait for it.

Failures travel as values, never as exceptions across ranks, so no rank leaves the
protocol early and nobody waits without a deadline.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from .._errors import CoordinationLost, RankFailure

log = logging.getLogger("asyncckpt")


class RoundTimeout(TimeoutError):
    """Ranks did not take part in an exchange before its deadline: ``missing`` names them."""

    def __init__(self, message: str, missing: tuple[int, ...]) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass
class Report:
    """One rank's outcome of the write phase."""

    rank: int
    files: list[dict[str, Any]] = field(default_factory=list)
    nbytes: int = 0
    failure: RankFailure | None = None
    #: this rank's part of the global tensor index (``_load_global.rank_index``), or None
    #: when it holds no DTensor
    index: dict[str, Any] | None = None
    #: the rank's files need a reader of manifest format ``asyncckpt/2`` (tied tensors)
    needs_v2: bool = False
    #: no I/O of this rank on its files of the attempt is still running (False after its
    #: own write timed out: a thread may still be inside a file, stuck in the kernel)
    settled: bool = True


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
    #: the tiers the save goes to, as rank 0 decided them (``saving._frequency.Tiers``' JSON)
    tiers: Any = None


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

    async def may_commit(self, seq: int) -> bool:
        """Leader only: claim the right to commit (False if a follower already gave up)."""
        ...

    async def exchange(
        self, seq: int, tag: str, value: Any, deadline: float, wait: bool = True, among: Sequence[int] | None = None
    ) -> dict[int, Any]:
        """Every rank publishes ``value`` (JSON; ``None`` says "I failed") under ``tag`` and,
        with ``wait``, gets the values of the ranks ``among`` (default: every rank's);
        :class:`RoundTimeout` (a ``TimeoutError`` naming them) if some are missing at ``deadline``.
        A round where each rank reads only the values it needs costs the store O(world) reads,
        not O(world²).
        Called between ``begin`` and ``report`` by every rank (dedupe, on the writer thread)."""
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

    async def may_commit(self, seq: int) -> bool:
        return True

    async def exchange(
        self, seq: int, tag: str, value: Any, deadline: float, wait: bool = True, among: Sequence[int] | None = None
    ) -> dict[int, Any]:
        return {0: value} if wait else {}

    async def close(self, deadline: float) -> None:
        return None


# ---------------------------------------------------------------------------- many ranks
# followers wait this much past the deadline for the leader's verdict, and at most
# _LATE_S in all when the leader already claimed the commit (so they raise within timeout + 2 s)
_GRACE_S = 1.0
_LATE_S = 2.0


def _enc_failure(f: RankFailure | None) -> Any:
    return (
        None
        if f is None
        else {"rank": f.rank, "exc_type": f.exc_type, "message": f.message, "errno": f.errno, "path": f.path}
    )


def _dec_failure(d: Any) -> RankFailure | None:
    return None if d is None else RankFailure(d["rank"], d["exc_type"], d["message"], d["errno"], d["path"])


#: Longest single store ``wait`` (longer waits are sliced), and the time a connect probe may take.
CALL_S = 5.0
#: Our store clients' own timeout (handshake and each non-wait call). A host that is gone is
#: found at once (refused probe, closed connection); this only bounds a store that is slow.
CLIENT_S = 30.0
#: Followers beat this often; rank 0's close() stops waiting for a rank whose beat is this stale.
HEARTBEAT_S = 1.0
STALE_S = 6.0


def lost_message(e: BaseException) -> str:
    """The wording of :class:`CoordinationLost` for the store error ``e``."""
    return (
        "the coordinator is gone: the c10d store (hosted by rank 0 or the launcher) cannot be "
        f"reached ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'connection lost'})"
    )


class StoreCoordinator:
    """Coordination over the c10d store, driven from the writer thread.

    Why the store and not a gloo side group: a store ``wait`` takes an explicit deadline and
    the store stays usable after one expires (a gloo group that timed out is dead and must
    never be reused); ``check`` names exactly which ranks are missing; ``compare_set`` lets
    the leader and a follower that gave up agree on whether the commit happened; and no
    collective ordering is imposed, so nothing here can deadlock against training
    collectives on the process group. Blocking store calls run on the coordination threads
    (``run``), never on the event loop, nor on the I/O threads: a wait for the other ranks
    must not hold a thread the save's own writes need meanwhile.

    Keys live under ``asyncckpt/<namespace>/``; the namespace is chosen by the leader when
    the Checkpointer is built, so several Checkpointers in one job never mix their keys.
    """

    def __init__(self, connect: Any, rank: int, world_size: int, namespace: str, run: Any) -> None:
        # One store client per thread: a TCPStore client serves one request at a time, so a
        # blocking wait on a shared client would stall every other user of it (the training
        # thread's own store calls included) for the whole wait.
        self._connect = connect
        self._clients = threading.local()
        self.rank = rank
        self.world_size = world_size
        self.ns = namespace
        self._run = run  # coroutine function: await run(fn, *args) on a coordination thread
        self._last_seq = 0
        # leader: ranks that did not report in the last save (known dead or stopped): close()
        # does not wait for them
        self.missing: set[int] = set()
        self.lost: CoordinationLost | None = None  # once the store is gone, stay gone
        # the liveness check rank 0's close() uses for ranks that died while no save was running
        self._heartbeat = _Heartbeat(connect, self._ns_key("alive", rank)) if rank != 0 else None

    def _ns_key(self, *parts: object) -> str:
        return "/".join(["asyncckpt", self.ns, *map(str, parts)])

    def shutdown(self) -> None:
        """Stop this rank's heartbeat (bounded); the store itself is left alone."""
        if self._heartbeat is not None:
            self._heartbeat.stop()

    def _key(self, seq: int, *parts: object) -> str:
        return "/".join(["asyncckpt", self.ns, str(seq), *map(str, parts)])

    def _op(self, name: str, *args: Any) -> Any:
        client = getattr(self._clients, "store", None)
        if client is None:
            client = self._clients.store = self._connect()
        return getattr(client, name)(*args)

    async def _call(self, name: str, *args: Any) -> Any:
        if self.lost is not None:
            # no reconnect attempts against a store that is gone: each would cost a connect timeout
            raise CoordinationLost(str(self.lost))
        try:
            return await self._run(self._op, name, *args)
        except Exception as e:
            if is_store_timeout(e):
                raise
            self.lost = CoordinationLost(lost_message(e))
            raise CoordinationLost(str(self.lost)) from e

    async def _set(self, key: str, value: Any) -> None:
        await self._call("set", key, json.dumps(value))

    async def _wait_keys(self, keys: list[str], deadline: float) -> bool:
        """Wait until every key is set; False if ``deadline`` passes first.

        Waits in slices of at most :data:`CALL_S`, so no single store call outlives the
        client's own timeout and a store that goes away is noticed at once.
        """
        while True:
            remaining = deadline - time.monotonic()
            try:
                await self._call("wait", keys, timedelta(seconds=min(max(remaining, 0.01), CALL_S)))
                return True
            except Exception as e:
                if not is_store_timeout(e):
                    raise
            if deadline - time.monotonic() <= 0:
                return False

    async def _wait_get(self, key: str, deadline: float) -> Any | None:
        """The value of ``key`` once set, or ``None`` if ``deadline`` passes first."""
        if not await self._wait_keys([key], deadline):
            return None
        return json.loads(await self._call("get", key))

    async def begin(self, step: int, seq: int, start: Start | None, deadline: float) -> Start:
        key = self._key(seq, "start")
        self._last_seq = seq
        if self.rank == 0:
            assert start is not None
            await self._set(key, {"attempt": start.attempt, "step": step, "failure": _enc_failure(start.failure),
                                  "tiers": start.tiers})
            return start
        got = await self._wait_get(key, deadline + _GRACE_S)
        if got is None:
            raise LeaderSilent("the leader (rank 0) did not start the save in time", aborted=True)
        failure = _dec_failure(got["failure"])
        if got["step"] != step:  # this rank's failure: it reports it, so rank 0 names it (saving._commit)
            failure = RankFailure(
                self.rank,
                "ValueError",
                f"ranks disagree on the step: rank 0 saves {got['step']}, rank {self.rank} saves {step}",
            )
        return Start(got["attempt"], failure, got.get("tiers"))

    async def report(self, step: int, seq: int, attempt: str, mine: Report, deadline: float) -> dict[int, Report]:
        await self._set(
            self._key(seq, "report", self.rank),
            {"files": mine.files, "nbytes": mine.nbytes, "failure": _enc_failure(mine.failure), "index": mine.index,
             "v2": mine.needs_v2, "settled": mine.settled},
        )
        if self.rank != 0:
            return {}
        keys = [self._key(seq, "report", r) for r in range(self.world_size)]
        await self._wait_keys(keys, deadline)  # then see who answered
        out: dict[int, Report] = {}
        for r, key in enumerate(keys):
            if not await self._call("check", [key]):
                self.missing.add(r)
                continue
            self.missing.discard(r)
            d = json.loads(await self._call("get", key))
            out[r] = Report(r, d["files"], d["nbytes"], _dec_failure(d["failure"]), d.get("index"), d.get("v2", False),
                            d.get("settled", True))
        return out

    async def decide(self, step: int, seq: int, attempt: str, verdict: Verdict | None, deadline: float) -> Verdict:
        lock, key = self._key(seq, "lock"), self._key(seq, "verdict")
        if self.rank == 0:
            assert verdict is not None
            await self._set(key, _enc_verdict(verdict))
            return verdict
        got = await self._wait_get(key, deadline + _GRACE_S)
        if got is None:
            # give up only if the leader has not started committing: whoever sets the lock first wins
            won = (await self._call("compare_set", lock, "", "abort")).decode()
            if won == "commit":
                got = await self._wait_get(key, deadline + _LATE_S)
            if got is None:
                raise LeaderSilent("the leader (rank 0) did not publish the outcome in time", aborted=won != "commit")
        return _dec_verdict(got)

    async def exchange(
        self, seq: int, tag: str, value: Any, deadline: float, wait: bool = True, among: Sequence[int] | None = None
    ) -> dict[int, Any]:
        await self._set(self._key(seq, tag, self.rank), value)
        if not wait:
            return {}
        ranks = list(range(self.world_size) if among is None else among)
        keys = [self._key(seq, tag, r) for r in ranks]
        if keys and not await self._wait_keys(keys, deadline):
            missing = [r for r, key in zip(ranks, keys, strict=True) if not await self._call("check", [key])]
            raise RoundTimeout(f"rank(s) {missing} did not take part in the {tag!r} round before the save's deadline",
                               tuple(missing))  # fmt: skip
        # one round trip for every value (a get per rank cost as many round trips)
        values = await self._call("multi_get", keys) if keys else []
        return {r: json.loads(v) for r, v in zip(ranks, values, strict=True)}

    async def post_once(self, seq: int, tag: str, value: Any) -> Any:
        """Set ``tag`` of save ``seq`` to ``value`` unless it is set; return the value that stands
        (the node-local tier's go/abort word, ``saving._nodelocal``)."""
        stood = await self._call("compare_set", self._key(seq, tag), "", json.dumps(value))
        return json.loads(stood)

    async def wait_for(self, seq: int, tag: str, deadline: float) -> Any | None:
        """The value of ``tag`` of save ``seq`` once set (:meth:`post_once`, :meth:`exchange`
        with the rank as the tag's last part), or ``None`` if ``deadline`` passes first."""
        return await self._wait_get(self._key(seq, tag), deadline)

    async def may_commit(self, seq: int) -> bool:
        """Leader only: claim the commit unless a follower already gave up on this save."""
        won = await self._call("compare_set", self._key(seq, "lock"), "", "commit")
        return bool(won == b"commit")

    async def close(self, deadline: float) -> None:
        await self._set(self._ns_key("closed", self.rank), self._last_seq)
        if self.rank != 0:
            return
        # rank 0 usually hosts the store: stay until every rank has read its last verdict, but
        # not for ranks known dead: missing in the last save, or whose heartbeat stopped
        # (waiting a whole timeout for them only delays the exit of every survivor)
        if self.missing:
            log.warning("close(): not waiting for rank(s) %s, missing since an earlier save", sorted(self.missing))
        pending = {r for r in range(self.world_size) if r not in self.missing}
        beats: dict[int, tuple[Any, float]] = {}
        while pending:
            keys = [self._ns_key("closed", r) for r in sorted(pending)]
            if await self._wait_keys(keys, min(deadline, time.monotonic() + 2 * HEARTBEAT_S)):
                return
            now = time.monotonic()
            if now >= deadline:
                log.warning("close(): rank(s) %s did not close within the timeout; leaving anyway", sorted(pending))
                return
            for r in sorted(pending):
                if await self._call("check", [self._ns_key("closed", r)]):
                    pending.discard(r)
                    continue
                alive_key = self._ns_key("alive", r)
                beat = await self._call("get", alive_key) if await self._call("check", [alive_key]) else None
                last = beats.get(r)
                if last is None or last[0] != beat:
                    beats[r] = (beat, now)
                elif beat is not None and now - last[1] > STALE_S:
                    log.warning("close(): rank %d stopped beating %.0fs ago; not waiting for it", r, now - last[1])
                    self.missing.add(r)
                    pending.discard(r)


class LeaderSilent(TimeoutError):
    """A follower gave up waiting for the leader. ``aborted``: the leader can no longer commit
    this save (it never started it, or the follower claimed the commit lock first), so the
    follower's files of it are dead."""

    def __init__(self, message: str, *, aborted: bool) -> None:
        super().__init__(message)
        self.aborted = aborted


class _Heartbeat:
    """A follower's liveness signal: a counter under ``key``, bumped every HEARTBEAT_S on its
    own thread and store client (so a busy writer or I/O pool cannot delay it)."""

    def __init__(self, connect: Any, key: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(connect, key), name="asyncckpt-heartbeat", daemon=True)
        self._thread.start()

    def _run(self, connect: Any, key: str) -> None:
        try:
            client = connect()
            n = 0
            while not self._stop.is_set():
                n += 1
                client.set(key, str(n))
                self._stop.wait(HEARTBEAT_S)
        except Exception:  # noqa: BLE001 - the store is gone: there is nobody left to tell
            return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(HEARTBEAT_S + CALL_S)


def is_store_timeout(e: BaseException) -> bool:
    """A store call that ran out of time (the store is alive), as opposed to a lost store."""
    if isinstance(e, CoordinationLost):
        return False  # its message may quote a connect that "timed out"
    if isinstance(e, TimeoutError):
        return True
    import torch.distributed as dist

    network = getattr(dist, "DistNetworkError", None)
    if network is not None and isinstance(e, network):
        return False  # connection refused/reset/closed, or a connect that timed out: the store is gone
    msg = str(e).lower()
    return "wait timeout" in msg or "timeout" in msg or "timed out" in msg


def _enc_verdict(v: Verdict) -> Any:
    return {
        "committed": v.committed,
        "failures": {str(r): _enc_failure(f) for r, f in v.failures.items()},
        "missing": list(v.missing),
        "nbytes": v.nbytes,
        "created": v.created,
    }


def _dec_verdict(d: Any) -> Verdict:
    failures = {int(r): f for r, f in ((r, _dec_failure(x)) for r, x in d["failures"].items()) if f is not None}
    return Verdict(d["committed"], failures, tuple(d["missing"]), d["nbytes"], d["created"])
