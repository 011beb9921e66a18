"""``python -m asyncckpt.cli``: the same command line as ``python -m asyncckpt``."""

from __future__ import annotations

from . import main

if __name__ == "__main__":
    raise SystemExit(main())
