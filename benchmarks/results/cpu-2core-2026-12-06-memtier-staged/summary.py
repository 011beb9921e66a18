"""Summarize ``drive.sh``'s JSON lines (argv[1]): medians (min-max) per code base and tier."""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any


def ms(xs: list[float]) -> str:
    """Median (min-max) of ``xs`` seconds, in ms."""
    if not xs:
        return "-"
    return f"{statistics.median(xs) * 1e3:.0f} ({min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f})"


def main() -> None:
    with open(sys.argv[1]) as f:
        runs = [json.loads(line) for line in f]
    print("| code | tier | runs | save() blocking | staging copy | save() to disk commit | "
          "disk commit to memory commit (node a) | memory round |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for side in ("base", "new"):
        mine = [d for d in runs if d["side"] == side]
        for tier in ("memory", "none"):

            def pooled(key: str, tier: str = tier, mine: list[dict[str, Any]] = mine) -> list[float]:
                return [x for d in mine for x in d["run"][tier].get(key, [])]

            cells = [ms(pooled(k)) for k in ("block_s", "staging_s", "commit_s", "to_memory_s", "rounds_s")]
            print(f"| {side} | {tier} | {len(mine)} | " + " | ".join(cells) + " |")
    print()
    for d in runs:
        r = d["run"]
        print(f"- {d['side']} (load average {d['load']}): with the tier blocking {ms(r['memory']['block_s'])}, "
              f"save {ms(r['memory']['commit_s'])}, to memory {ms(r['memory']['to_memory_s'])}; without: "
              f"blocking {ms(r['none']['block_s'])}, save {ms(r['none']['commit_s'])}")  # fmt: skip


if __name__ == "__main__":
    main()
