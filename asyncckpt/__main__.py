"""``python -m asyncckpt``: the command line (see :mod:`asyncckpt.cli`)."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
