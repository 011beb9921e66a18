"""Ownership of an object-store root: a lease object, renewed by compare-and-swap.

The object-store counterpart of ``_ownership`` (an ``flock`` plus an owner record on a POSIX
root): one writing job per ``s3://bucket/prefix``. The writing Checkpointer (rank 0 of its
group) takes the lease at construction and holds it until ``close()``; ``asyncckpt gc URL``
holds it for its run. Readers never touch it. The lease is one object::

    P/.asyncckpt/owner    JSON: role, host, pid, process start time, global ranks, since,
                          ttl_s, renew_s, token (this holder), seq (renewal count), released

Every write is one conditional PUT read back after every outcome
(``ObjectStore.create_once`` / ``replace_if``), so a lost response never misleads; SeaweedFS
4.48 enforces both ``If-None-Match: *`` and ``If-Match`` on PUT, and of 8 concurrent
``If-Match`` updates with one ETag exactly one wins (``benchmarks/s3_if_match.py``: 50 of
50 trials).

Theory of operation:

* **take**: ``create_once`` of a fresh record. If a record is there (read back with its
  ETag and ``last_modified``):

  - released by its holder (``close()``) → replaced with ours (``If-Match`` its ETag);
  - not renewed for longer than *its holder's* TTL plus the clock's 1 s resolution,
    judged by the store's clock (its ``last_modified`` against that of a fresh object
    written just then: ``ObjectStore.server_time``; never local time) → taken over the
    same way (a SIGKILLed job does not lock the prefix for ever);
  - else watched (HEAD every fraction of its renewal interval): renewed meanwhile → its
    holder is alive → ``RootInUseError`` naming it (host, pid, since; never credentials);
    not renewed until its TTL passed → taken over.

  Two takers racing for one stale lease: one ``If-Match`` wins, the other sees the new
  holder renew and is refused. Every wait is bounded by the caller's deadline.
* **hold**: a thread of its own (``asyncckpt-lease``, one event loop: renewals never wait
  behind a save) renews every ``renew_s`` (``ttl / 6``) with ``If-Match`` on the ETag of the
  last renewal; a failed renewal (503, a timeout) is retried sooner and costs nothing while
  the lease is valid. The holder counts the lease valid until *the send time of its last
  successful renewal + ttl* on its monotonic clock: the store stamped that renewal no earlier
  than it was sent, so no taker can judge it stale before then.
* **lost**: a renewal that finds another holder's record (or none) means the lease was
  taken over; that is final. :meth:`Lease.check` (before a save opens its attempt) and
  :meth:`Lease.confirm` (right before the commit's conditional create, renewing first when
  less than ``ttl / 3`` is left) raise ``RootInUseError`` from then on, so the job commits
  nothing more; what it uploaded is under attempt keys no manifest names (dead leftovers for
  the new holder). A commit is never sent once the lease may have expired: ``confirm``
  fails then (the renewal's error), and the create's deadline is the lease's validity.
* **release**: the record replaced (``If-Match``) by one marked released: the next job takes
  it at once. A lease already lost is left alone.

Limit (every lease on a store without fencing tokens has it): a commit request delayed in
the network past the holder's validity can still land after a takeover. The holder never
*sends* a commit outside its validity, and bounds the create's deadline by it; and a commit
is a conditional create of one step's manifest naming verified objects, so even such a
late commit is a correct checkpoint and never overwrites a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ..._errors import ObjectNotFoundError, ObjectStoreError, RootInUseError
from ...format._layout import META_DIR
from ...threads._writer import WriterThread
from ..posix._ownership import describe_owner, process_start_time
from ._client import ObjectStore
from ._conditional import CreateResult
from ._reads import ObjectInfo

log = logging.getLogger("asyncckpt")

KEY = f"{META_DIR}/owner"
#: Default time a lease lives without renewal (seconds); renewed every ``ttl / 6``.
DEFAULT_TTL_S = 60.0
MIN_TTL_S = 2.0
MAX_TTL_S = 86400.0
#: Resolution of ``last_modified`` (HTTP dates: whole seconds): added to a holder's TTL
#: before its lease counts as stale, so the true age is then above the TTL.
RESOLUTION_S = 1.0
#: Renewals per TTL.
RENEWALS_PER_TTL = 6
#: Validity a commit needs at the least (seconds) when the lease cannot be renewed.
MIN_LEFT_S = 1.0


def check_ttl(ttl: object) -> float:
    """``ttl`` as seconds, or ``ValueError``."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not MIN_TTL_S <= ttl <= MAX_TTL_S:
        raise ValueError(f"lease_ttl must be a number of seconds in [{MIN_TTL_S:g}, {MAX_TTL_S:g}], not {ttl!r}")
    return float(ttl)


def _record(raw: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return rec if isinstance(rec, dict) else None


def _seconds(rec: dict[str, Any] | None, field: str, default: float) -> float:
    v = rec.get(field) if rec is not None else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= MAX_TTL_S:
        return default
    return float(v)


class Lease:
    """The lease of one object-store root (module docstring), made before it is taken so a
    caller interrupted anywhere holds something to :meth:`release`.

    ``ranks``: the global ranks of the writing group (recorded); ``role``: who writes
    (``Checkpointer``, ``asyncckpt gc``); ``ttl``: seconds the lease lives unrenewed.
    """

    def __init__(self, store: ObjectStore, ranks: Sequence[int], role: str = "Checkpointer",
                 ttl: float = DEFAULT_TTL_S) -> None:
        self.store = store
        self.ttl = check_ttl(ttl)
        self.renew_s = self.ttl / RENEWALS_PER_TTL
        self.token = uuid.uuid4().hex
        self.url = store.object_url(KEY)
        # who holds it, as the record says (never a credential)
        self._who = {"role": role, "host": socket.gethostname(), "pid": os.getpid(),
                     "start_time": process_start_time(), "ranks": list(ranks), "since": time.time()}
        self._seq = 0
        self._etag: str | None = None
        self._valid_until = 0.0  # time.monotonic(): the last good renewal's send time + ttl
        self._lost: str | None = None  # who holds it now, once it was taken over
        self._released = False
        self._state = threading.Lock()
        self._thread: WriterThread | None = None
        self._keeper: Any = None
        self._mutex: asyncio.Lock | None = None  # on the lease loop: one renewal at a time

    def __repr__(self) -> str:
        return f"Lease({self.url!r}, ttl={self.ttl:g}, held={self.held})"

    # -- state ---------------------------------------------------------------------------------

    @property
    def held(self) -> bool:
        """Taken, not lost, not released (it may still have expired: see :meth:`confirm`)."""
        return self._etag is not None and self._lost is None and not self._released

    @property
    def valid_for(self) -> float:
        """Seconds this holder may still count the lease as its own (0 once lost)."""
        if not self.held:
            return 0.0
        return max(0.0, self._valid_until - time.monotonic())

    def check(self) -> None:
        """Raise ``RootInUseError`` if the lease was taken over (or released); any thread."""
        if self._lost is not None:
            raise RootInUseError(
                f"asyncckpt: this job lost the lease of {self.store.url} (its lease {self.url} was taken over "
                f"by {self._lost}); it commits nothing more: close it (one root has one writing job at a time)"
            )
        if self._released or self._etag is None:
            raise RootInUseError(f"asyncckpt: this job does not hold the lease of {self.store.url}")

    def _body(self, seq: int, released: bool = False) -> bytes:
        return json.dumps({**self._who, "ttl_s": self.ttl, "renew_s": self.renew_s, "token": self.token,
                           "seq": seq, "released": released}, sort_keys=True).encode()

    def _describe(self, rec: dict[str, Any] | None) -> str:
        if rec is None:
            return "a writer whose lease record is unreadable"
        return describe_owner(rec)

    # -- take ----------------------------------------------------------------------------------

    async def take(self, deadline: float) -> None:
        """Take the lease (module docstring) by ``deadline`` (``time.monotonic()``) and start
        renewing it; ``RootInUseError`` naming the holder if a live one holds it."""
        if self._etag is not None or self._released:
            raise RuntimeError("a Lease is taken once")
        while True:
            sent = time.monotonic()
            res = await self.store.create_once(KEY, self._body(0), deadline)
            if res.won:
                return await self._taken(res.info, sent, deadline)
            if res.info is None:  # pragma: no cover - create_once reads back a stored object
                continue
            won = await self._take_over(res.stored, res.info, deadline)
            if won:
                return

    async def _take_over(self, stored: bytes, info: ObjectInfo, deadline: float) -> bool:
        """Watch the record there until it is released or stale (then swap it for ours:
        True) or renewed (``RootInUseError``); False if it vanished (create again)."""
        while True:
            rec = _record(stored)
            ttl = _seconds(rec, "ttl_s", self.ttl) if rec is not None else self.ttl
            renew = _seconds(rec, "renew_s", ttl / RENEWALS_PER_TTL)
            age = None
            if not (rec is not None and rec.get("released") is True):
                age = (await self.store.server_time(deadline) - info.last_modified).total_seconds()
            if age is None or age > ttl + RESOLUTION_S:
                sent = time.monotonic()
                res = await self.store.replace_if(KEY, self._body(0), self._e_tag_of(info), deadline)
                if res.won:
                    if age is not None:
                        log.warning("took over the lease of %s from %s: not renewed for %.0f s (its TTL: %g s)",
                                    self.store.url, self._describe(rec), age, ttl)
                    await self._taken(res.info, sent, deadline)
                    return True
                if res.info is None:
                    return False
                stored, info = res.stored, res.info  # another taker, or its holder renewed: look again
                continue
            # live or dead? watched until it changes or its TTL has passed (monotonic waits,
            # the decision always by the store's clock again)
            stale_at = time.monotonic() + (ttl + RESOLUTION_S - age) + 0.05
            poll = min(max(renew / 3, 0.2), 2.0)
            if stale_at > deadline:
                log.info("lease of %s: held by %s, not renewed for %.0f s; waiting for a renewal or its TTL (%g s)",
                         self.store.url, self._describe(rec), age, ttl)
            while time.monotonic() < stale_at:
                if time.monotonic() + poll > deadline:
                    raise RootInUseError(self._in_use(rec, f"not renewed for {age:.0f} s of its {ttl:g} s TTL when "
                                                           "this writer gave up waiting"))
                await asyncio.sleep(min(poll, max(0.0, stale_at - time.monotonic())))
                try:
                    now = await self.store.head(KEY, deadline)
                except ObjectNotFoundError:
                    return False
                if now.e_tag != info.e_tag:
                    try:
                        stored, info = await self.store.get_object(KEY, deadline)
                    except ObjectNotFoundError:
                        return False
                    new = _record(stored)
                    if new is not None and new.get("released") is True:
                        break  # released meanwhile: take it
                    raise RootInUseError(self._in_use(new, f"renewed every {renew:.3g} s, TTL {ttl:g} s"))

    def _in_use(self, rec: dict[str, Any] | None, how: str) -> str:
        return (
            f"asyncckpt: object-store root {self.store.url} is already owned by another writer "
            f"({self._describe(rec)}; its lease {self.url} is {how}); one root has one writing job at a time: "
            "close that Checkpointer, or give this job its own prefix (reading - asyncckpt.load(), find_latest(), "
            "the CLI - needs no lease); a lease its holder stops renewing is taken over after its TTL"
        )

    def _e_tag_of(self, info: ObjectInfo | None) -> str:
        if info is None or not info.e_tag:
            raise ObjectStoreError(errno.EIO, "the store returned no ETag for the lease: it cannot be renewed",
                                   self.url)
        return info.e_tag

    async def _taken(self, info: ObjectInfo | None, sent: float, deadline: float) -> None:
        """Ours from ``sent`` on: start renewing (or, if :meth:`release` ran meanwhile, give
        it back at once)."""
        e_tag = self._e_tag_of(info)
        with self._state:
            self._etag = e_tag
            self._valid_until = sent + self.ttl
            released = self._released
            if not released:
                self._thread = WriterThread("asyncckpt-lease")
                self._keeper = self._thread.submit(self._keep())
        if released:
            await self._give_back(max(deadline, time.monotonic() + 10.0))

    # -- hold ----------------------------------------------------------------------------------

    def _one_at_a_time(self) -> asyncio.Lock:
        """The lock that orders renewals and the release (made on the loop that first asks:
        the lease loop, or the taker's when a release comes before any renewal)."""
        if self._mutex is None:
            self._mutex = asyncio.Lock()
        return self._mutex

    async def _keep(self) -> None:
        """Renew every ``renew_s`` (sooner after a failure) until lost or cancelled."""
        ok = True
        while self._lost is None:
            await asyncio.sleep(self.renew_s if ok else max(0.2, self.renew_s / 4))
            try:
                await self._renew()
                ok = True
            except Exception as e:  # noqa: BLE001 - retried; the lease stays valid until its TTL
                ok = False
                log.warning("could not renew the lease of %s (valid for %.1f s more): %s", self.store.url,
                            self.valid_for, e)
        log.error("asyncckpt: the lease of %s was taken over by %s: this job commits nothing more",
                  self.store.url, self._lost)

    async def _renew(self, until: float | None = None) -> None:
        """One renewal (on the lease loop), by ``until`` at the latest: extends the validity,
        or marks the lease lost."""
        async with self._one_at_a_time():
            if not self.held:
                return
            assert self._etag is not None
            sent = time.monotonic()
            deadline = sent + max(1.0, self.renew_s)
            res = await self.store.replace_if(KEY, self._body(self._seq + 1), self._etag,
                                              deadline if until is None else min(deadline, until))
            if res.won and res.info is not None and res.info.e_tag:
                self._seq += 1
                self._etag = res.info.e_tag
                self._valid_until = sent + self.ttl
                return
            if self._follow_own(res):
                return  # our own record under another ETag: followed, validity unchanged
            rec = _record(res.stored) if res.info is not None else None
            self._lost = self._describe(rec) if res.info is not None else "nobody (its lease object was deleted)"

    async def confirm(self, need: float) -> float:
        """On any loop but the lease's (the writer's, before a commit): make sure the lease is
        ours, and return until when (``time.monotonic()``). With less than ``need`` seconds
        left it is renewed now; if that renewal fails (the store failing for a while), the
        validity left is still used while at least ``MIN_LEFT_S`` remain, so a store that
        fails for less than the TTL costs a healthy job nothing. ``RootInUseError`` if the
        lease was taken over; the renewal's error once the lease may have expired."""
        self.check()
        if self._valid_until - time.monotonic() >= need:
            return self._valid_until
        assert self._thread is not None
        try:
            # the renewal may take the time down to MIN_LEFT_S, not the commit's share of it
            until = max(time.monotonic() + 0.5, self._valid_until - MIN_LEFT_S)
            await asyncio.wrap_future(self._thread.submit(self._renew(until)))
        except ObjectStoreError as e:
            self.check()
            if self._valid_until - time.monotonic() < MIN_LEFT_S:
                raise
            log.warning("could not renew the lease of %s before a commit (valid for %.1f s more): %s",
                        self.store.url, self.valid_for, e)
        self.check()
        return self._valid_until

    # -- release -------------------------------------------------------------------------------

    def release(self, timeout: float = 5.0) -> None:
        """Stop renewing and mark the record released (if still ours), bounded by ``timeout``;
        idempotent, any thread but the lease's. Never raises for the store's failures (the
        lease then expires after its TTL)."""
        with self._state:
            if self._released:
                return
            self._released = True
            thread, self._thread = self._thread, None
        if thread is None:
            return  # never taken (or being taken: _taken gives it back)
        try:
            if self._etag is not None and self._lost is None:
                thread.submit(self._give_back(time.monotonic() + timeout)).result(timeout + 2.0)
        except Exception as e:  # noqa: BLE001 - the lease expires after its TTL
            log.warning("could not release the lease of %s: %s", self.store.url, e)
        finally:
            thread.stop(timeout=10.0)

    async def arelease(self, timeout: float = 5.0) -> None:
        """:meth:`release` from a coroutine (the blocking part runs in a thread)."""
        await asyncio.to_thread(self.release, timeout)

    async def _give_back(self, deadline: float) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
        async with self._one_at_a_time():
            if self._lost is not None or self._etag is None:
                return
            # a renewal of ours cancelled in flight (or whose outcome was unknown) may land first
            # and move the ETag: follow our own record and try again, as a renewal does
            try:
                for _ in range(3):
                    res = await self.store.replace_if(
                        KEY, self._body(self._seq + 1, released=True), self._etag, self._drop_by(deadline)
                    )
                    if res.won or not self._follow_own(res):
                        break
            except ObjectStoreError as e:
                await self._drop(e, deadline)
                return
            if not res.won:
                log.warning("the lease of %s was no longer ours at release", self.store.url)

    def _drop_by(self, deadline: float) -> float:
        """Until when the release may try to mark the record released: by ``deadline``, but
        while the lease is valid, leaving time (within the deadline and the validity) for
        :meth:`_drop`."""
        now = time.monotonic()
        keep = self._valid_until - MIN_LEFT_S - 2.0
        return min(now + 0.6 * (deadline - now), keep) if keep > now + 0.5 else deadline

    async def _drop(self, e: ObjectStoreError, deadline: float) -> None:
        """The record could not be marked released (a store that refuses writes: out of
        space): delete it instead - a DELETE needs no room - while the lease is surely still
        ours (valid for ``MIN_LEFT_S`` more when sent, the request bounded by that), so no
        taker's record can be the one deleted. The next job then takes the root at once."""
        until = min(deadline, self._valid_until - MIN_LEFT_S)
        if until <= time.monotonic():
            raise e  # too late to be sure it is ours: it expires after its TTL
        try:
            await self.store.delete([KEY], until)
        except ObjectStoreError:
            raise e from None
        log.warning("could not mark the lease of %s released (%s); deleted it instead", self.store.url, e)

    def _follow_own(self, res: CreateResult) -> bool:
        """After a conditional update that lost: if what is stored is still our own live record
        (another ETag, from an earlier write of ours that landed), take its ETag and counter
        and return True; False when another holder's record (or none) is there."""
        rec = _record(res.stored) if res.info is not None else None
        if res.info is None or rec is None or rec.get("token") != self.token or rec.get("released"):
            return False
        seq = rec.get("seq")
        self._etag = res.info.e_tag or self._etag
        self._seq = seq if isinstance(seq, int) else self._seq
        return True


@contextlib.asynccontextmanager
async def held(store: ObjectStore, role: str, deadline: float, ttl: float = DEFAULT_TTL_S) -> Any:
    """``async with held(store, "asyncckpt gc", deadline) as lease:`` - take, then release."""
    lease = Lease(store, [], role, ttl)
    try:
        await lease.take(deadline)
        yield lease
    finally:
        await lease.arelease()
