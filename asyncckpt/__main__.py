"""``python -m asyncckpt``: the command line (see :mod:`asyncckpt._cli`)."""

from __future__ import annotations

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
