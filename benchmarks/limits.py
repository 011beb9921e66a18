"""Physical limits of this machine for the same bytes: copy, write+fsync, read.

* ``memcpy``: ``dst.copy_(src)`` of every tensor into preallocated tensors of the same
  shape (on CUDA: into pinned host tensors, i.e. the D2H copy a snapshot needs).
* ``write``: one ``os.write`` loop of all tensor bytes (16 MiB per call) into one new
  file, then ``fsync`` of the file and its directory; ``write_direct`` does the same with
  ``O_DIRECT`` from a page-aligned anonymous ``mmap`` buffer, and ``write_direct_huge`` from
  such a buffer advised ``MADV_HUGEPAGE`` (what ``Checkpointer(huge_pages=True)`` stages
  into: O_DIRECT pins 512x fewer pages).
* ``read_cold`` / ``read_warm``: ``os.readv`` of that file into a preallocated buffer,
  after evicting its pages with ``posix_fadvise(DONTNEED)`` (cold) or right after a read
  (warm).

``image_bytes`` bounds the file image and the read buffer (a multiple of 16 MiB): the file
then holds the first ``image_bytes`` of the tensors' bytes over and over, still
``nbytes`` long, and reads cycle through a buffer that size; ``copy_bytes`` likewise makes
the memcpy targets views into one preallocated buffer of that size, reused from its start
whenever the next tensor would not fit. Both let the limits of a state near the machine's
memory be measured beside it and beside the save's staging buffer: the disk sees the same
number of incompressible bytes in the same calls, and every tensor is still copied into
memory that is already mapped.
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from typing import Any

import torch
from measure import drop_cache, fsync_dir
from states import byte_view, tensors_of

CHUNK = 16 * 1024 * 1024
ALIGN = 4096
_DIRECT = getattr(os, "O_DIRECT", 0)


def _round_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def _views_in(src: list[torch.Tensor], nbytes: int, pin: bool) -> list[torch.Tensor]:
    """A target for every tensor of ``src``: views into one buffer of ``nbytes``, 64-byte aligned,
    reused from its start whenever the next tensor would not fit (its pages faulted in now)."""
    largest = max((t.numel() * t.element_size() for t in src), default=0)
    if nbytes < largest:
        raise ValueError(f"copy_bytes={nbytes} is smaller than the largest tensor ({largest} bytes)")
    flat = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
    out, pos = [], 0
    for t in src:
        n = t.numel() * t.element_size()
        if pos + n > nbytes:
            pos = 0
        out.append(flat[pos : pos + n].view(t.dtype).view(t.shape))
        pos = -(-(pos + n) // 64) * 64
    return out


class Limits:
    """Buffers and files for the limit measurements of one state."""

    def __init__(self, state: Any, scratch: str, image_bytes: int | None = None, copy_bytes: int | None = None) -> None:
        if image_bytes is not None and (image_bytes <= 0 or image_bytes % CHUNK):
            raise ValueError(f"image_bytes must be a positive multiple of {CHUNK}, not {image_bytes}")
        self.src = list(tensors_of(state))
        self.nbytes = sum(t.numel() * t.element_size() for t in self.src)
        cuda = any(t.device.type == "cuda" for t in self.src)
        pin = cuda and torch.cuda.is_available()
        if copy_bytes is None:
            self.dst = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for t in self.src]
        else:
            self.dst = _views_in(self.src, copy_bytes, pin)
        self.cuda = cuda
        # the file image: every tensor's bytes back to back (or the first image_bytes of them),
        # in a page-aligned mapping
        self.size = _round_up(max(self.nbytes, 1))
        self.image = self.size if image_bytes is None else min(self.size, image_bytes)
        self.buf = mmap.mmap(-1, self.image, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = memoryview(self.buf)
        pos = 0
        for t in self.src:
            if pos >= self.image:
                break
            b = byte_view(t.detach().cpu().contiguous() if cuda else t.detach().contiguous())
            n = min(len(b), self.image - pos)
            view[pos : pos + n] = b[:n]
            pos += n
        self.view = view
        self.huge_buf: mmap.mmap | None = None  # made by the first write(huge=True)
        self.read_buf = mmap.mmap(-1, self.image, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.read_view = memoryview(self.read_buf)
        self.read_view[:] = self.view  # fault its pages in now, not during the timed read
        self.scratch = scratch
        os.makedirs(scratch, exist_ok=True)
        self._n = 0
        self.last_file: str | None = None

    # ------------------------------------------------------------------ copy
    def memcpy(self) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for d, s in zip(self.dst, self.src, strict=True):
                d.copy_(s, non_blocking=self.cuda)
            if self.cuda:
                torch.cuda.synchronize()
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ write
    def _path(self) -> str:
        self._n += 1
        return os.path.join(self.scratch, f"raw_{self._n:04d}.bin")

    def _huge_view(self) -> memoryview:
        """The bytes again, in a buffer advised MADV_HUGEPAGE before its pages were touched
        (allocated once, untimed: the kernel may compact memory for it)."""
        if self.huge_buf is None:
            buf = mmap.mmap(-1, self.image, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf.madvise(getattr(mmap, "MADV_HUGEPAGE", 14))
            memoryview(buf)[:] = self.view
            self.huge_buf = buf
        return memoryview(self.huge_buf)

    def write(self, direct: bool = False, huge: bool = False) -> float:
        """Write the bytes to a new file, fsync file and directory; returns seconds. ``huge``:
        from the huge-page buffer (with ``direct``)."""
        view = self._huge_view() if huge else self.view
        path = self._path()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if direct:
            if not _DIRECT:
                raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform")
            flags |= _DIRECT
        n = self.size if direct else self.nbytes  # O_DIRECT writes whole pages
        t0 = time.perf_counter()
        fd = os.open(path, flags, 0o644)
        try:
            pos = 0
            while pos < n:
                off = pos % self.image  # the image over and over when it is bounded
                w = os.write(fd, view[off : off + min(CHUNK, n - pos, self.image - off)])
                if w <= 0:
                    raise OSError(errno.EIO, "short write")
                pos += w
            if direct and n != self.nbytes:
                os.ftruncate(fd, self.nbytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.scratch)
        elapsed = time.perf_counter() - t0
        self._retire(path)
        return elapsed

    def _retire(self, path: str) -> None:
        """Remove the previous file, durably and untimed: its freed blocks are committed (and
        discarded, on a ``-o discard`` mount) now, not in whatever is timed next (a save)."""
        if self.last_file is not None and os.path.exists(self.last_file):
            os.unlink(self.last_file)
            fsync_dir(self.scratch)
        self.last_file = path

    # ------------------------------------------------------------------ read
    def read(self, cold: bool) -> float:
        assert self.last_file is not None, "write() first"
        if cold:
            drop_cache([self.last_file])
        # file offset o lands at o % image: with a bounded image the buffer ends up holding it
        pieces = [
            self.read_view[i % self.image : i % self.image + min(CHUNK, self.nbytes - i)]
            for i in range(0, self.nbytes, CHUNK)
        ]
        t0 = time.perf_counter()
        fd = os.open(self.last_file, os.O_RDONLY)
        try:
            off = 0
            for i in range(0, len(pieces), 64):
                batch = pieces[i : i + 64]
                want = sum(len(p) for p in batch)
                got = os.preadv(fd, batch, off)
                if got != want:
                    raise OSError(errno.EIO, f"short read ({got} of {want})")
                off += got
        finally:
            os.close(fd)
        return time.perf_counter() - t0

    def verify_read(self) -> bool:
        n = min(self.nbytes, self.image)
        return self.read_view[:n] == self.view[:n]

    def close(self) -> None:
        if self.last_file is not None and os.path.exists(self.last_file):
            os.unlink(self.last_file)
        self.view.release()
        self.read_view.release()
        self.buf.close()
        self.read_buf.close()
        self.dst = []
