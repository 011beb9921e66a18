"""Output of the command line: units, tables, safe text, JSON, and the progress line."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

PROG = "asyncckpt"


def human_bytes(n: int | float) -> str:
    """``n`` bytes as a short binary-unit string: ``512 B``, ``1.5 KiB``, ``12.0 MiB``."""
    if n < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} PiB"


def human_age(seconds: float) -> str:
    """A duration as one unit, rounded down: ``42s``, ``5m``, ``3h``, ``2d`` (negative or unknown: ``0s``/``?``)."""
    if not math.isfinite(seconds):
        return "?"
    s = max(0, int(min(seconds, 2.0**62)))
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def safe(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\x1b``, ``\\n``, undecodable bytes).

    File names come from the disk and may hold terminal escape sequences or newlines; printed
    raw they would rewrite the screen or forge output lines. Names that were not valid UTF-8
    (surrogate escapes from ``os.listdir``) show their original bytes as ``\\xNN``.
    """
    if text.isprintable():
        return text
    out = []
    for ch in text:
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:
            out.append(f"\\x{o - 0xDC00:02x}")
        elif ch.isprintable():
            out.append(ch)
        elif o < 0x100:
            out.append(f"\\x{o:02x}")
        elif o < 0x10000:
            out.append(f"\\u{o:04x}")
        else:
            out.append(f"\\U{o:08x}")
    return "".join(out)


def say(line: str = "", stream: IO[str] | None = None) -> None:
    """Print one line, non-printable characters escaped (stdout unless ``stream``)."""
    print(safe(line), file=sys.stdout if stream is None else stream)


def note(command: str, message: str) -> None:
    """One ``asyncckpt COMMAND: message`` line on stderr."""
    say(f"{PROG} {command}: {message}", sys.stderr)


def dump_json(doc: Any) -> None:
    """Print ``doc`` as indented JSON (non-finite floats as strings, so the output stays valid JSON)."""
    print(json.dumps(_finite(doc), indent=2))


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns separated by two spaces; the last column is not padded.

    Cells are escaped first, so widths are those of what is printed.
    """
    cells = [[safe(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        padded = [c.ljust(w) for c, w in zip(r[:-1], widths[:-1], strict=True)] + [r[-1]]
        return "  ".join(padded).rstrip()

    return [line(r) for r in cells]


class Progress:
    """A one-line byte-progress indicator (bytes, percent, rate, ETA) redrawn in place.

    When ``enabled`` is false every method does nothing, so callers need not check. Redraws
    at most ten times a second; :meth:`close` erases the line.
    """

    def __init__(self, stream: IO[str], total: int, enabled: bool) -> None:
        self._stream = stream
        self._total = max(total, 0)
        self._enabled = enabled
        self._done = 0
        self._label = ""
        self._t0 = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def label(self, text: str) -> None:
        """Show ``text`` in front of the bar from now on."""
        self._label = safe(text)
        self._draw(force=True)

    def advance(self, n: int) -> None:
        """Count ``n`` more bytes as done."""
        self._done += n
        self._draw(force=False)

    def _draw(self, force: bool) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1 and self._done < self._total:
            return
        self._last = now
        frac = min(1.0, self._done / self._total) if self._total else 1.0
        width = 24
        filled = int(frac * width)
        elapsed = max(now - self._t0, 1e-6)
        rate = self._done / elapsed
        left = max(self._total - self._done, 0)
        eta = f"ETA {human_age(left / rate)}" if rate > 0 and left else ("done" if not left else "ETA ?")
        bar = "#" * filled + "-" * (width - filled)
        text = (
            f"{self._label} [{bar}] {frac * 100:5.1f}%  "
            f"{human_bytes(self._done)} / {human_bytes(self._total)}  {human_bytes(int(rate))}/s  {eta}"
        )
        self._stream.write("\r\x1b[K" + text)
        self._stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Erase the progress line (if one was drawn)."""
        if self._enabled and self._drawn:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._drawn = False
