"""Frames over the replica's :class:`Links`: point-to-point ``send``/``recv`` of uint8 tensors.

The links (``_links``) are a gloo process group of two ranks per pair that talks.

One *frame* from a rank to a peer is 3 + P messages, in order on that pair:

1. a fixed header, 4 int64 (32 bytes): magic, kind (:data:`DATA` or :data:`FAIL`), the length
   of the JSON description, the number P of payload messages;
2. the JSON description (for :data:`DATA` the step, attempt and each file's name and size; for
   :data:`FAIL` the failure's kind and message, and nothing follows);
3. the files' bytes in :func:`pieces` of at most :data:`CHUNK` (sent from and received into the
   memory the caller gives: a mapped file, no copy);
4. the trailer: the number of files and each one's CRC-32C (int64), sent once the sender computed them while the
   pieces were on their way; the receiver computes its own from each piece as it lands
   (:class:`Receiving`), so neither CRC pass waits for the transfer nor the other way round.

Every wait is bounded by the round's :class:`Deadline` (``Work.wait(timeout)``: with gloo a
wait past it closes that pair, so the group is not used again). A peer that dies fails the
wait at once (gloo: "Connection closed by peer"). Failures are :class:`WireError`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from ...format._checksum import crc32c
from ...threads._deadline import Deadline
from ._links import Links

MAGIC = 0x41434B5245504C31  # "ACKREPL1"
DATA, FAIL = 1, 2
_FIXED = 4
_MAX_DESC = 64 << 20
#: The largest payload message: the receiver checks one while the next arrives, small enough that
#: it is still in the cache when its wait returns (a 32 MiB piece's CRC took twice as long).
CHUNK = 8 << 20


class WireError(Exception):
    """A frame did not arrive or leave whole by the deadline (``timeout``) or the pair failed."""

    def __init__(self, message: str, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


@dataclass
class Counts:
    """Messages and bytes this rank sent and received over the group (headers included)."""

    sent_messages: int = 0
    sent_bytes: int = 0
    recv_messages: int = 0
    recv_bytes: int = 0

    def as_json(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Sending:
    """The works of one frame being sent, and the tensors they read (kept alive until done)."""

    peer: int
    works: list[Any] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)


def send(group: Links, peer: int, kind: int, desc: dict[str, Any], payloads: Sequence[torch.Tensor],
         counts: Counts, ready: Callable[[int], None] | None = None) -> Sending:  # fmt: skip
    """Post ``kind``'s frame to rank ``peer`` (``payloads``: the non-empty files' bytes,
    uint8 tensors); wait with :func:`finish`. ``ready(k)``, when given, is called just before
    payload ``k`` is posted (the sender faults its pages in while the ones before travel)."""
    body = json.dumps(desc).encode()
    fixed = torch.tensor([MAGIC, kind, len(body), len(payloads)], dtype=torch.int64)
    msgs = [fixed, torch.frombuffer(bytearray(body), dtype=torch.uint8), *payloads]
    out = Sending(peer, keep=msgs)
    try:
        for k, t in enumerate(msgs):
            if ready is not None and k >= 2:
                ready(k - 2)
            out.works.append(group.send(t, peer))
            counts.sent_messages += 1
            counts.sent_bytes += t.numel() * t.element_size()
    except Exception as e:  # gloo refuses a send on a closed pair at once
        raise WireError(f"sending to rank {peer} failed: {first_line(e)}") from e
    return out


def send_more(sending: Sending, group: Links, t: torch.Tensor, counts: Counts) -> None:
    """Post one more message of ``sending``'s frame (its trailer)."""
    try:
        sending.works.append(group.send(t, sending.peer))
    except Exception as e:  # a closed pair refuses at once
        raise WireError(f"sending to rank {sending.peer} failed: {first_line(e)}") from e
    sending.keep.append(t)
    counts.sent_messages += 1
    counts.sent_bytes += t.numel() * t.element_size()


def spans(sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """The payload messages of files of ``sizes``: (file index, offset, at most :data:`CHUNK` bytes)."""
    return [(i, off, min(CHUNK, n - off)) for i, n in enumerate(sizes) for off in range(0, n, CHUNK)]


def pieces(views: Sequence[memoryview]) -> list[tuple[int, memoryview]]:
    """The payload messages of files ``views`` (:func:`spans`): (file index, its bytes)."""
    return [(i, views[i][off : off + n]) for i, off, n in spans([len(v) for v in views])]


def count_pieces(sizes: Sequence[int]) -> int:
    return sum(-(-n // CHUNK) for n in sizes)


def tensors(views: Sequence[memoryview]) -> list[torch.Tensor]:
    """uint8 tensors over the :func:`pieces` of ``views`` (no copy)."""
    return [torch.frombuffer(v, dtype=torch.uint8) for _, v in pieces(views)]


def trailer(crcs: Sequence[int]) -> torch.Tensor:
    """A frame's last message: how many files, then each one's CRC-32C (never empty)."""
    return torch.tensor([len(crcs), *crcs], dtype=torch.int64)


class Receiving:
    """A frame's payload and trailer being received from ``peer`` into ``views`` (the files'
    memory): every message posted at once; :meth:`finish` waits for each piece in turn and
    adds it to its file's CRC while the next arrives."""

    def __init__(self, group: Links, peer: int, views: Sequence[memoryview], counts: Counts) -> None:
        self.peer, self.counts = peer, counts
        self.pieces = pieces(views)
        self.targets = [torch.frombuffer(v, dtype=torch.uint8) for _, v in self.pieces]
        self.trailer = torch.empty(len(views) + 1, dtype=torch.int64)
        self.works = [_irecv(t, group, peer) for t in [*self.targets, self.trailer]]
        self.crcs = [0] * len(views)

    def finish(self, by: Deadline) -> tuple[list[int], list[int]]:
        """The CRC-32C of each file as received, and as the sender computed it."""
        what = f"receiving from rank {self.peer}"
        for (i, view), w in zip(self.pieces, self.works, strict=False):
            _wait(w, by, what)
            self.counts.recv_messages += 1
            self.counts.recv_bytes += len(view)
            self.crcs[i] = crc32c(view, self.crcs[i])
        _wait(self.works[-1], by, what)
        self.counts.recv_messages += 1
        self.counts.recv_bytes += self.trailer.numel() * 8
        count, *crcs = self.trailer.tolist()
        if count != len(self.crcs):
            raise WireError(f"rank {self.peer} sent a trailer of {count} files, not {len(self.crcs)}")
        sent = [int(x) & 0xFFFFFFFF for x in crcs]
        self.targets, self.works, self.pieces = [], [], []
        return self.crcs, sent


def finish(sending: Sending, by: Deadline) -> None:
    """Wait until ``sending``'s messages left (``WireError`` past ``by`` or on a failed pair)."""
    try:
        for w in sending.works:
            _wait(w, by, f"sending to rank {sending.peer}")
    finally:
        sending.keep.clear()


def recv_desc(group: Links, peer: int, by: Deadline, counts: Counts) -> tuple[int, dict[str, Any], int]:
    """The next frame's head from rank ``peer``: its kind, description and the number of
    payload messages that follow (receive them with :func:`recv_into`)."""
    fixed = torch.empty(_FIXED, dtype=torch.int64)
    _wait(_irecv(fixed, group, peer), by, f"receiving from rank {peer}")
    magic, kind, desc_len, n = (int(x) for x in fixed.tolist())
    counts.recv_messages += 1
    counts.recv_bytes += fixed.numel() * 8
    if magic != MAGIC or kind not in (DATA, FAIL) or not 0 <= desc_len <= _MAX_DESC or n < 0:
        raise WireError(f"rank {peer} sent a frame that is not a replica's ({[magic, kind, desc_len, n]})")
    body = torch.empty(desc_len, dtype=torch.uint8)
    if desc_len:
        _wait(_irecv(body, group, peer), by, f"receiving from rank {peer}")
        counts.recv_messages += 1
        counts.recv_bytes += desc_len
    try:
        desc = json.loads(body.numpy().tobytes()) if desc_len else {}
    except ValueError as e:
        raise WireError(f"rank {peer} sent an unreadable description ({e})") from None
    return kind, desc, n


def _irecv(t: torch.Tensor, group: Links, peer: int) -> Any:
    try:
        return group.recv(t, peer)
    except Exception as e:  # a closed pair refuses at once
        raise WireError(f"receiving from rank {peer} failed: {first_line(e)}") from e


def _wait(work: Any, by: Deadline, what: str) -> None:
    left = by.remaining()
    if left <= 0:
        raise WireError(f"{what}: the deadline passed", timeout=True)
    try:
        work.wait(timedelta(seconds=left))
    except Exception as e:  # gloo raises RuntimeError for a timeout and a dead peer alike
        text = first_line(e)
        raise WireError(f"{what} failed: {text}", timeout="Timed out" in text) from e


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message, without gloo's ``[file:line]`` prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split("] ", 1)[-1] if text.startswith("[") else text
