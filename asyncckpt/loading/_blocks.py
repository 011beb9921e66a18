"""Checked blocks of many files (``read_blocks``): the resharded load's reader
(``_load_global``, DCP's reader in ``integrations.dcp``).

Each :class:`Block` is a file range with its own CRC-32C and the parts of it that land in
memory; the blocks are spread over the I/O threads in file order, adjacent ones share a
``preadv``, and each block is checked as its bytes land (streamed through the thread's
bounce buffer of :data:`~asyncckpt.loading._readinto.BOUNCE` bytes where the parts do not
tile it). Sources and bounce buffers are ``_pread``'s, the threads ``_readinto``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import CheckpointCorruptError
from ..format._checksum import crc32c
from ._pread import Bounce, Source, advise_sequential, bytes_of, parallel, pread_exact, source_order
from ._readinto import BOUNCE, threads_for


# ---------------------------------------------------------------------- checked blocks, many files
@dataclass(frozen=True)
class Block:
    """Bytes ``[offset, offset + nbytes)`` of source ``fd``, checked against ``crc`` (``None``:
    not checked), of which the parts in ``runs`` land in memory.

    ``runs``: ``(byte inside the block, destination)`` pairs, ascending and disjoint. When
    they tile the block it is read straight into them (one ``preadv``); otherwise through the
    thread's bounce buffer, checksummed there and the runs copied out (no runs: only checked).
    ``what`` names the bytes in a checksum error (``CheckpointCorruptError`` naming ``path``).
    """

    fd: Source
    path: str
    offset: int
    nbytes: int
    crc: int | None
    runs: tuple[tuple[int, memoryview], ...]
    what: str


@dataclass
class _Segment:
    """At most :data:`BOUNCE` bytes of one block, read in one go (a block streams through them)."""

    block: Block
    offset: int  # file byte
    nbytes: int
    parts: list[tuple[int, memoryview]]  # (byte inside the segment, destination)
    direct: bool
    last: bool


def _segments(b: Block) -> list[_Segment]:
    out: list[_Segment] = []
    runs, i = b.runs, 0
    for s in range(0, b.nbytes, BOUNCE) if b.nbytes else [0]:
        e = min(b.nbytes, s + BOUNCE)
        parts: list[tuple[int, memoryview]] = []
        while i < len(runs) and runs[i][0] < e:
            pos, v = runs[i]
            lo, hi = max(pos, s), min(pos + len(v), e)
            parts.append((lo - s, v[lo - pos : hi - pos]))
            if pos + len(v) <= e:
                i += 1
            else:
                break  # the run goes on in the next segment
        covered, direct = 0, True
        for pos, v in parts:
            direct = direct and pos == covered
            covered = pos + len(v)
        direct = direct and covered == e - s
        out.append(_Segment(b, b.offset + s, e - s, parts, direct, e == b.nbytes))
    return out


def _read_segments(blocks: list[Block]) -> None:
    """One thread's blocks (sorted by file and offset): adjacent segments of one kind share a
    ``preadv`` of at most :data:`BOUNCE` bytes; each block's CRC runs over its segments as
    they land and is compared when its last one did."""
    bounce = Bounce()
    crcs: dict[int, int] = {}
    batch: list[_Segment] = []

    def check(seg: _Segment, crc: int) -> None:
        b = seg.block
        if b.crc is None:
            return
        crcs[id(b)] = crc
        if seg.last and crcs.pop(id(b)) != b.crc:
            raise CheckpointCorruptError(f"checksum mismatch in {b.what}", b.path)

    def flush() -> None:
        if not batch:
            return
        first = batch[0].block
        start = batch[0].offset
        if batch[0].direct:
            pread_exact(first.fd, [v for s in batch for _, v in s.parts], start, first.path)
            for s in batch:
                if s.block.crc is not None:
                    crc = crcs.get(id(s.block), 0)
                    for _, v in s.parts:  # just landed: still in cache
                        crc = crc32c(v, crc)
                    check(s, crc)
        else:
            total = sum(s.nbytes for s in batch)
            buf = bytes_of(bounce.get(total)[:total]) if total else memoryview(bytearray())
            pread_exact(first.fd, [buf], start, first.path)
            at = 0
            for s in batch:
                piece = buf[at : at + s.nbytes]
                if s.block.crc is not None:
                    check(s, crc32c(piece, crcs.get(id(s.block), 0)))
                for pos, v in s.parts:
                    v[:] = piece[pos : pos + len(v)]
                at += s.nbytes
        batch.clear()

    size = 0
    for b in blocks:
        for seg in _segments(b):
            prev = batch[-1] if batch else None
            joins = (
                prev is not None
                and prev.block.fd == b.fd
                and prev.offset + prev.nbytes == seg.offset
                and prev.direct == seg.direct
                and size + seg.nbytes <= BOUNCE
            )
            if not joins:
                flush()
                size = 0
            batch.append(seg)
            size += seg.nbytes
    flush()


def _split_blocks(blocks: list[Block], parts: int) -> list[list[Block]]:
    """``blocks`` sorted by (file, offset) and cut into at most ``parts`` runs of about equal
    bytes; unchecked blocks larger than :data:`BOUNCE` are cut first so one large copy is
    still read by every thread (a checked block stays whole: its CRC runs in order)."""
    pieces: list[Block] = []
    for b in blocks:
        if b.crc is None and b.nbytes > BOUNCE:
            pieces.extend(_cut(b, s, min(b.nbytes, s + BOUNCE)) for s in range(0, b.nbytes, BOUNCE))
        else:
            pieces.append(b)
    pieces.sort(key=lambda b: (source_order(b.fd), b.offset))
    total = sum(b.nbytes for b in pieces)
    groups: list[list[Block]] = [[]]
    acc, share = 0, total / max(1, parts)
    for b in pieces:
        if acc >= share * len(groups) and len(groups) < parts and groups[-1]:
            groups.append([])
        groups[-1].append(b)
        acc += b.nbytes
    return [g for g in groups if g]


def _cut(b: Block, s: int, e: int) -> Block:
    """Bytes ``[s, e)`` of an unchecked block, with the parts of its runs that fall there."""
    runs = []
    for pos, v in b.runs:
        lo, hi = max(pos, s), min(pos + len(v), e)
        if lo < hi:
            runs.append((lo - s, v[lo - pos : hi - pos]))
    return Block(b.fd, b.path, b.offset + s, e - s, None, tuple(runs), b.what)


def read_blocks(blocks: list[Block], *, threads: int | None = None) -> None:
    """Read and check ``blocks`` (any sources, any order) on ``threads`` (default :data:`THREADS`,
    or what their range sources ask for).

    Every checked block is CRC-32C'd as its bytes land, on the thread that read them; a
    mismatch raises ``CheckpointCorruptError`` naming the block's file, after every thread
    stopped (no thread is left writing into the caller's memory). Extra memory: one
    :data:`BOUNCE` buffer per thread.
    """
    for fd in {b.fd for b in blocks}:
        advise_sequential(fd)
    groups = _split_blocks(blocks, threads or threads_for({id(b.fd): b.fd for b in blocks}.values()))
    parallel("asyncckpt-read", _read_segments, [(g,) for g in groups])
