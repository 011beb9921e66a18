"""The peer replica: every rank's files of a step kept in the memory of a rank on another node.

:class:`Replicas` is one rank's side. Its rounds are collective over every rank of the group,
called in the same order everywhere:

- :meth:`Replicas.push` sends this rank's files to its buddy (``_buddies``) and receives the
  files of the ranks whose buddy it is, checks each file's size and CRC-32C and commits them
  under its directory (``_held``); then the ranks agree (``ranks._agree``, the c10d store) on
  the outcome, so a push that failed anywhere fails on every rank, with the same
  :class:`ReplicaPushError` naming the ranks.
- :meth:`Replicas.fetch`: the ranks agree which of them need their files (each names the step
  and attempt); each buddy of a needer sends its replica from the mapped files with the CRCs it
  was pushed with, or why it cannot; the needer checks every piece as it lands; a second
  agreement names every failure. A needer
  that got nothing and its buddy raise the same typed error (missing, corrupt, transport);
  the other ranks go on. The caller falls back to the next tier for those ranks.

Every round is bounded by ``timeout`` seconds from its call: the transfers end a little before
(each ``Work.wait`` gets what is left) so the agreement can name a dead or silent rank. The
traffic runs on its own process group (:func:`open_group`, gloo), never the training's. After
a transport failure (a dead peer, a wait past its deadline: gloo closes the pair) every rank
marks the group broken (the same verdict everywhere), and the next round first builds a new
one on every rank (:func:`open_group`, its next generation: a peer that stalled past a
deadline and came back rejoins); when that fails (a rank gone for good) the object is dead
and refuses every round with :class:`ReplicaTransportError`. A missing or corrupt replica
leaves the group usable.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import torch

from ...format._checksum import crc32c
from ...ranks._agree import AgreeTimeout, agree
from ...ranks._distributed import DistContext
from ...ranks._nodes import Nodes
from ...threads._deadline import Deadline
from ._buddies import buddy_of, sources_of
from ._failures import (
    ReplicaError,
    ReplicaPushError,
    ReplicaPushTimeout,
    ReplicaTimeoutError,
    ReplicaTransportError,
    SingleNodeError,
    kind_error,
    worst,
)
from ._held import HeldReplicas, Incoming, NotHeld, Record, check_name, populate
from ._links import Links, open_group
from ._wire import (
    DATA,
    FAIL,
    Counts,
    Receiving,
    Sending,
    WireError,
    count_pieces,
    finish,
    first_line,
    recv_desc,
    send,
    send_more,
    spans,
    tensors,
    trailer,
)

#: What a file to push is: a path, or its bytes.
Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview]

#: At most this much of a round's time is kept for its closing agreement: twice what rank 0
#: keeps of what is left when it enters it (``_agree``: a quarter, at most 5 s), so a rank whose
#: transfers ran to their end still reports before rank 0 decides.
_AGREE_S = 10.0


class Replicas:
    """This rank's side of the peer replica.

    ``ranks``: the job's ranks (store, prefix and rank: the agreements, and the transfers'
    group, :func:`open_group`, built here: collective, within ``timeout``); ``nodes``: the
    ranks by node; ``directory``: where this rank keeps the replicas it holds; ``keep``: steps
    kept per source; ``timeout``: seconds each round may take. ``SingleNodeError`` with one
    node; :class:`ReplicaTransportError` when the group cannot be built."""

    def __init__(self, ranks: DistContext, nodes: Nodes, directory: str, keep: int = 2,
                 timeout: float = 60.0) -> None:  # fmt: skip
        world = sum(len(m) for m in nodes.members)
        if world != ranks.world_size:
            raise ValueError(f"the nodes ({nodes.describe()}) and the ranks ({ranks.world_size}) must count the "
                             "same ranks")  # fmt: skip
        buddy = buddy_of(nodes, ranks.rank)
        if buddy is None:
            raise SingleNodeError(f"asyncckpt: every rank is on one node ({nodes.describe()}): no other node "
                                  "can hold a replica")  # fmt: skip
        self.ranks, self.nodes, self.timeout = ranks, nodes, timeout
        self.rank, self.buddy = ranks.rank, buddy
        self.sources = sources_of(nodes, ranks.rank)
        #: the ranks this one talks to: its buddy, its sources
        self.peers = (buddy, *self.sources)
        try:
            self.group = open_group(ranks, self.peers, 0, timeout)
        except Exception as e:  # gloo's rendezvous: a rank that never came
            raise ReplicaTransportError(f"asyncckpt: the replica group could not be built: {first_line(e)}",
                                        broken=True) from e  # fmt: skip
        self.generation = 0
        self.held_here = HeldReplicas(directory, keep)
        self.held_here.clean(self.sources)
        self.counts = Counts()
        self._key = "replica"
        self._round = 0
        #: why the group broke (the next round builds the next one first), or ``None``
        self._broken: str | None = None
        #: why this object refuses every round (a broken group that could not be rebuilt)
        self.dead: str | None = None

    # ----------------------------------------------------------------------------------- push
    def push(self, step: int, attempt: str, files: Mapping[str, Source], crcs: Mapping[str, int] | None = None) -> None:
        """Collective: this rank's ``files`` (name to path or bytes) to its buddy; its sources'
        files into this rank's directory. ``crcs``: the CRC-32C of some of the files, known
        already (their writer computed it): sent as is, so the buddy checks the bytes it got
        against the bytes first written; the others' are computed here. Returns when every
        rank's replica is committed on its buddy; else raises :class:`ReplicaPushError`
        (:class:`ReplicaPushTimeout` when a rank did not answer) on every rank, within
        ``timeout``."""
        self._check()
        by = Deadline.after(self.timeout)
        moving = by.before(min(_AGREE_S, self.timeout / 2))
        key = self._next("push")
        problems: list[str] = []
        transport = False
        views: list[memoryview] | None = None  # set when a DATA frame goes out: its trailer follows
        try:
            names, views, maps = _open_files(files)
        except (OSError, ValueError) as e:
            views = None
            problems.append(f"its files could not be read ({e})")
            sending = self._send_fail(self.buddy, "source", problems[-1])
        else:
            desc = {"source": self.rank, "step": step, "attempt": attempt,
                    "files": [[n, len(v), 0] for n, v in zip(names, views, strict=True)]}  # fmt: skip
            sending = self._send(DATA, desc, tensors(views), ready=_faulting_in(views, maps))
        if sending is None:
            transport = True
            problems.append(f"its send to rank {self.buddy} failed")
        receiving: dict[int, tuple[Record, Incoming, Receiving]] = {}
        for s in self.sources:  # every receive posted before this rank computes its own CRCs
            try:
                receiving[s] = self._start_push(s, step, attempt, moving)
            except (WireError, _Refused, OSError) as e:
                transport |= self._problem(s, e, problems)
        if sending is not None and views is not None:
            try:  # while the pieces travel
                sums = [crcs[n] if crcs and n in crcs else crc32c(v) for n, v in zip(names, views, strict=True)]
                send_more(sending, self.group, trailer(sums), self.counts)
            except WireError as e:
                transport = True
                problems.append(str(e))
        del views
        for s, (rec, incoming, rcv) in receiving.items():
            try:
                self._end_push(rec, incoming, rcv, moving)
            except (WireError, _Refused, OSError) as e:
                transport |= self._problem(s, e, problems)
        if sending is not None:
            try:
                finish(sending, moving)
            except WireError as e:
                transport = True
                problems.append(str(e))
        verdict = self._agree(key, {"problems": problems, "transport": transport}, by, ReplicaPushTimeout)
        failed = {int(r): "; ".join(p) for r, p in verdict["problems"].items()}
        if verdict["transport"]:
            self._broken = f"push of step {step} failed on the group"
        if failed:
            text = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
            raise ReplicaPushError(f"asyncckpt: the replica of step {step} did not land on every buddy: {text}",
                                   failed, broken=bool(verdict["transport"]))  # fmt: skip

    def _problem(self, source: int, e: Exception, problems: list[str]) -> bool:
        """Note what went wrong with ``source``'s files; whether it was the transport."""
        if isinstance(e, WireError):
            problems.append(f"receiving rank {source}'s files: {e}")
            return True
        if isinstance(e, _Refused):
            problems.append(f"rank {source}'s files: {e}")
        else:
            problems.append(f"rank {source}'s files could not be written to {self.held_here.directory} ({e})")
        return False

    def _start_push(self, source: int, step: int, attempt: str, by: Deadline) -> tuple[Record, Incoming, Receiving]:
        """Read ``source``'s description, open the replica's files, post every receive."""
        kind, desc, n = recv_desc(self.group, source, by, self.counts)
        if kind == FAIL:
            raise _Refused(f"rank {source} sent none: {desc.get('msg', '')}")
        rec = _record(desc, n)
        if (rec.source, rec.step, rec.attempt) != (source, step, attempt):
            raise WireError(f"rank {source} sent rank {rec.source}'s step {rec.step} of attempt {rec.attempt!r}, "
                            f"not its step {step} of {attempt!r}")  # fmt: skip
        try:
            incoming = self.held_here.receive(rec)
        except OSError:  # keep the pair in step, then say why
            scratch = [memoryview(torch.empty(e.size, dtype=torch.uint8).numpy()) for e in rec.files]  # type: ignore[arg-type]
            Receiving(self.group, source, scratch, self.counts).finish(by)
            raise
        try:
            return rec, incoming, Receiving(self.group, source, incoming.views, self.counts)
        except BaseException:
            incoming.abort()
            raise

    def _end_push(self, rec: Record, incoming: Incoming, rcv: Receiving, by: Deadline) -> None:
        """Wait for the bytes (each piece CRC-checked as it lands) and commit them."""
        try:
            got, sent = rcv.finish(by)
            incoming.record = dataclasses.replace(
                rec, files=tuple(dataclasses.replace(e, crc=c) for e, c in zip(rec.files, sent, strict=True))
            )
            incoming.commit(got)
        except NotHeld as e:
            raise _Refused(f"arrived corrupt, refused ({e})") from None
        finally:
            incoming.abort()

    # ---------------------------------------------------------------------------------- fetch
    def held(self, step: int, attempt: str, source: int | None = None) -> bool:
        """Whether this rank holds ``source``'s (default: every one of its sources') replica of
        ``step`` made by ``attempt``, every file there with its size (local, no messages)."""
        sources = self.sources if source is None else (source,)
        return bool(sources) and all(self.held_here.held(s, step, attempt) for s in sources)

    def fetch(self, step: int, attempt: str, need: bool) -> dict[str, memoryview] | None:
        """Collective: a rank with ``need`` gets its files of ``step`` made by ``attempt`` back from
        its buddy (name to its bytes, a memoryview; every CRC checked); a rank without returns ``None``.

        A needer that gets nothing raises :class:`ReplicaMissingError`,
        :class:`ReplicaCorruptError` or :class:`ReplicaTransportError`, and so does its buddy
        (``failed`` names every failed needer, the same on every rank; a rank that failed to
        serve but got its own files finds them in the error's ``files``); within ``timeout``."""
        self._check()
        by = Deadline.after(self.timeout)
        moving = by.before(min(_AGREE_S, self.timeout / 2))
        key = self._next("fetch")
        mine = {"need": need, "step": step, "attempt": attempt}

        def decide(outs: list[dict[str, Any]]) -> dict[str, Any]:
            return {"needs": {str(r): [o["step"], o["attempt"]] for r, o in enumerate(outs) if o["need"]}}

        needs = self._agree(f"{key}/need", mine, moving, ReplicaTimeoutError, decide)["needs"]
        failures: dict[str, list[Any]] = {}  # needer -> [kind, message]
        sendings = [self._serve(s, int(needs[str(s)][0]), str(needs[str(s)][1]), failures)
                    for s in self.sources if str(s) in needs]  # fmt: skip
        got: dict[str, memoryview] | None = None
        if need:
            try:
                got = self._receive_fetch(step, attempt, moving)
            except WireError as e:
                failures[str(self.rank)] = ["transport", str(e)]
            except NotHeld as e:
                failures[str(self.rank)] = [e.kind, str(e)]
        for s in sendings:
            if s is None:
                continue
            try:
                finish(s, moving)
            except WireError as e:
                failures.setdefault(str(s.peer), ["transport", str(e)])
        verdict = self._agree(key, {"failures": failures}, by, ReplicaTimeoutError, _merge_failures)
        failed = {int(r): f"{k}: {m}" for r, (k, m) in verdict["failures"].items()}
        kinds = [k for k, _ in verdict["failures"].values()]
        if "transport" in kinds:
            self._broken = f"fetch of step {step} failed on the group"
        mine_failed = [r for r in failed if r == self.rank or buddy_of(self.nodes, r) == self.rank]
        if mine_failed:
            which = worst(verdict["failures"][str(r)][0] for r in mine_failed)
            text = "; ".join(f"rank {r} from rank {buddy_of(self.nodes, r)}: {failed[r]}" for r in sorted(failed))
            err = kind_error(which)(f"asyncckpt: a replica could not be fetched: {text}", failed,
                                    broken="transport" in kinds)  # fmt: skip
            err.files = got
            raise err
        return got

    def _serve(self, source: int, step: int, attempt: str, failures: dict[str, list[Any]]) -> Sending | None:
        """Send ``source`` its replica of ``step`` (from the mapped files), or why not (recorded
        in ``failures``)."""
        try:
            rec = self.held_here.find(source, step, attempt)
            views = self.held_here.map(rec, check=False)  # the needer checks as the bytes land
        except (NotHeld, OSError) as e:
            kind = e.kind if isinstance(e, NotHeld) else "missing"
            failures[str(source)] = [kind, f"rank {self.rank} holds none: {e}"]
            sending = self._send_fail(source, kind, failures[str(source)][1])
        else:
            sending = self._send(DATA, {"record": rec.as_json()}, tensors(views), source)
            del views
            if sending is not None:
                try:
                    send_more(sending, self.group, trailer([e.crc for e in rec.files]), self.counts)
                except WireError:
                    sending = None
        if sending is None:
            failures[str(source)] = ["transport", f"rank {self.rank} could not send"]
        return sending

    def _receive_fetch(self, step: int, attempt: str, by: Deadline) -> dict[str, memoryview]:
        kind, desc, n = recv_desc(self.group, self.buddy, by, self.counts)
        if kind == FAIL:
            raise NotHeld(str(desc.get("kind", "missing")), str(desc.get("msg", "")))
        rec = _record(desc.get("record"), n)
        if (rec.source, rec.step, rec.attempt) != (self.rank, step, attempt):
            raise WireError(f"rank {self.buddy} sent rank {rec.source}'s step {rec.step} of {rec.attempt!r}")
        views = [_view(torch.empty(e.size, dtype=torch.uint8)) for e in rec.files]
        got, _ = Receiving(self.group, self.buddy, views, self.counts).finish(by)
        bad = [e.name for e, c in zip(rec.files, got, strict=True) if c != e.crc]
        if bad:
            raise NotHeld("corrupt", f"{', '.join(bad)} of rank {self.rank}'s step {step} from rank {self.buddy} "
                                     "fails its CRC-32C")  # fmt: skip
        return {e.name: v for e, v in zip(rec.files, views, strict=True)}

    # -------------------------------------------------------------------------------- helpers
    def _send(self, kind: int, desc: dict[str, Any], payloads: Sequence[torch.Tensor],
              peer: int | None = None, ready: Callable[[int], None] | None = None) -> Sending | None:  # fmt: skip
        try:
            return send(self.group, self.buddy if peer is None else peer, kind, desc, payloads, self.counts, ready)
        except WireError:
            return None

    def _send_fail(self, peer: int, kind: str, msg: str) -> Sending | None:
        return self._send(FAIL, {"kind": kind, "msg": msg}, (), peer)

    def _agree(self, key: str, mine: dict[str, Any], by: Deadline, timeout_error: type[ReplicaError],
               decide: Any = None) -> dict[str, Any]:  # fmt: skip
        def union(outs: list[dict[str, Any]]) -> dict[str, Any]:
            return {"problems": {str(r): o["problems"] for r, o in enumerate(outs) if o["problems"]},
                    "transport": any(o["transport"] for o in outs)}  # fmt: skip

        try:
            return agree(self.ranks, key, mine, decide or union, by)
        except AgreeTimeout as e:
            self._broken = f"{key} timed out"
            raise timeout_error(f"asyncckpt: the replica round {key!r} did not complete: {e}",
                                {r: "did not answer" for r in e.missing}, broken=True) from e  # fmt: skip

    def _next(self, what: str) -> str:
        self._round += 1
        return f"{self._key}/{self._round}-{what}"

    def _check(self) -> None:
        """Before a round: refuse it when the object is dead; build the next group first when
        the last one broke (every rank saw the same verdict, so every rank does it now)."""
        if self.dead is None and self._broken is not None:
            self._reopen(self._broken)
        if self.dead is not None:
            raise ReplicaTransportError(f"asyncckpt: this replica group is broken and could not be rebuilt "
                                        f"({self.dead})", broken=True)  # fmt: skip

    def _reopen(self, why: str) -> None:
        """Collective: the group's next generation, built by every rank within ``timeout`` (a
        rank that comes back from a stall late in its last round still joins), then an
        agreement that every rank has it (bounded too). A rank that did not come makes the
        object dead on every rank: it raises :class:`ReplicaTransportError` naming it."""
        key = self._next("reopen")
        # the agreement waits for the ranks whose links took their whole time to fail (a dead
        # buddy's rank), and then some, to name the rank that never came
        by = Deadline.after(self.timeout + min(_AGREE_S, self.timeout / 2))
        self.group = Links({})  # the broken pairs go first
        mine: dict[str, Any] = {"error": ""}
        try:
            self.group = open_group(self.ranks, self.peers, self.generation + 1, self.timeout)
        except RuntimeError as e:
            mine["error"] = str(e)

        def decide(outs: list[dict[str, Any]]) -> dict[str, Any]:
            return {"failed": {str(r): o["error"] for r, o in enumerate(outs) if o["error"]}}

        try:
            failed = {int(r): m for r, m in agree(self.ranks, key, mine, decide, by)["failed"].items()}
        except AgreeTimeout as e:
            failed = {r: "did not answer" for r in e.missing}
        if failed:
            self.group = Links({})
            text = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
            self.dead = f"{why}; rebuilding it failed: {text}"
            raise ReplicaTransportError(f"asyncckpt: the replica group is broken and could not be rebuilt "
                                        f"({self.dead})", failed, broken=True)  # fmt: skip
        self.generation += 1
        self._broken = None


class _Refused(Exception):
    """A push's files that arrived but cannot be committed."""


def _merge_failures(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's view of the failed needers; the needer's own report first (it saw them arrive)."""
    merged: dict[str, list[Any]] = {}
    for r, o in enumerate(outs):
        for needer, fail in o["failures"].items():
            if needer == str(r) or needer not in merged:
                merged[needer] = fail
    return {"failures": merged}


def _record(desc: Any, messages: int) -> Record:
    """The record a frame's description holds; ``WireError`` when it cannot be read or does not
    announce as many files as messages follow (the pair is out of step: nothing more is read)."""
    try:
        rec = Record.from_json(desc)
        for e in rec.files:
            check_name(e.name)
    except (KeyError, TypeError, ValueError, AssertionError) as e:
        raise WireError(f"an unreadable description ({e})") from None
    if any(e.size < 0 for e in rec.files) or count_pieces([e.size for e in rec.files]) != messages:
        raise WireError(f"a description of {len(rec.files)} files with {messages} messages")
    return rec


def _view(t: torch.Tensor | None) -> memoryview:
    array: Any = t.numpy() if t is not None else b""
    return memoryview(array)


def _open_files(files: Mapping[str, Source]) -> tuple[list[str], list[memoryview], list[mmap.mmap | None]]:
    """The files' names, bytes and mappings: a path's file mapped copy-on-write (no copy; it must
    not change while it is pushed; its pages faulted in by :func:`_faulting_in`, a piece at a
    time), read-only bytes copied once (no mapping)."""
    names, views, maps = [], [], []
    for name, src in files.items():
        check_name(name)
        m = None
        if isinstance(src, (bytes, bytearray, memoryview)):
            view = memoryview(src).cast("B")
            if view.readonly:
                view = memoryview(bytearray(view))
        else:
            with open(os.fspath(src), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size:
                    m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
                    view = memoryview(m)
                else:
                    view = memoryview(bytearray())
        names.append(name)
        views.append(view)
        maps.append(m)
    return names, views, maps


def _faulting_in(views: Sequence[memoryview], maps: Sequence[mmap.mmap | None]) -> Callable[[int], None]:
    """``ready`` for :func:`send`: faults payload ``k``'s pages in (one ``madvise``) just before it
    is posted, so the mapping of a piece overlaps the transfer of the ones before (a whole 256 MiB
    file's took ~25 ms before its first byte left)."""
    assert len(views) == len(maps)
    messages = spans([len(v) for v in views])

    def ready(k: int) -> None:
        i, off, length = messages[k]
        m = maps[i]
        if m is not None:
            populate(m, write=False, start=off, length=length)

    return ready
