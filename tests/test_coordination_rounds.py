"""A round's exchange reads only the values its rank needs (``exchange(among=...)``), over a real
c10d TCPStore: the node-local tiers' rounds cost the store O(ranks) reads, not O(ranks²)
(docs/node-local.md, "How it grows with the number of nodes")."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from _ranks import free_port
from torch.distributed import TCPStore

from asyncckpt.ranks._coordination import RoundTimeout, StoreCoordinator


class _Counted:
    """A TCPStore client that counts the keys each call names (the store's work)."""

    def __init__(self, store: TCPStore, counts: Counter[str]) -> None:
        self.store, self.counts = store, counts

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            keys = args[0] if args else []
            self.counts[name] += len(keys) if isinstance(keys, list) else 1
            return call(*args)

        return counted


@pytest.fixture
def world() -> Any:
    """Coordinators of 4 ranks on one real store (their calls on a thread pool), and the counts."""
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    counts: Counter[str] = Counter()

    def connect() -> _Counted:
        return _Counted(TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)), counts)

    async def run(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    coords = [StoreCoordinator(connect, r, 4, "rounds", run) for r in range(4)]
    yield coords, counts
    for c in coords:
        c.shutdown()
    del server


def test_each_rank_reads_only_the_values_it_asks_for(world: Any) -> None:
    coords, counts = world
    nodes = [[0, 1], [0, 1], [2, 3], [2, 3]]

    async def main() -> list[dict[int, Any]]:
        deadline = time.monotonic() + 10
        return await asyncio.gather(*(c.exchange(1, "written", {"r": c.rank}, deadline, among=nodes[c.rank])
                                      for c in coords))  # fmt: skip

    got = asyncio.run(main())
    assert got == [{r: {"r": r} for r in nodes[k]} for k in range(4)]
    assert counts["multi_get"] == 8  # 2 values a rank; every value to every rank would be 16


@pytest.mark.timing
def test_a_missing_rank_fails_only_the_ranks_that_wait_for_it_and_is_named(world: Any) -> None:
    coords, _ = world

    async def main() -> tuple[Any, Any]:
        deadline = time.monotonic() + 1.0
        first = coords[1].exchange(2, "parts", {"ok": True}, deadline, among=[0, 1])
        everyone = coords[0].exchange(2, "parts", {"ok": True}, deadline)  # rank 2 and 3 never answer
        return await asyncio.gather(first, everyone, return_exceptions=True)

    t0 = time.monotonic()
    node, everyone = asyncio.run(main())
    assert node == {0: {"ok": True}, 1: {"ok": True}}
    assert isinstance(everyone, RoundTimeout) and everyone.missing == (2, 3), everyone
    assert "rank(s) [2, 3] did not take part" in str(everyone), everyone
    assert time.monotonic() - t0 < 8  # by the deadline, not a store call's own timeout
