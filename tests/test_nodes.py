"""Nodes: ranks grouped by name through a real c10d store (``ranks._nodes``), one thread per rank."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from asyncckpt.ranks._agree import AgreeTimeout
from asyncckpt.ranks._distributed import DistContext
from asyncckpt.ranks._nodes import NODE_ENV, Nodes, discover, node_name


def _discover_all(names: list[str | None], timeout: float = 10.0) -> dict[int, Any]:
    """Run ``discover`` on one thread per rank (``None``: that rank never takes part)."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    out: dict[int, Any] = {}

    def rank(r: int, name: str) -> None:
        ctx = DistContext(store, r, len(names), "test", lambda: store)
        try:
            out[r] = discover(ctx, "ctor/1", timeout, name=name)
        except Exception as e:  # noqa: BLE001 - what the test looks at
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r, n)) for r, n in enumerate(names) if n is not None]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    return out


def test_ranks_are_grouped_by_node_in_the_order_of_their_lowest_rank() -> None:
    got = _discover_all(["x", "x", "y", "y"])
    want = Nodes(("x", "y"), ((0, 1), (2, 3)))
    assert all(v == want for v in got.values()), got
    got = _discover_all(["b", "a", "b", "a", "c"])  # interleaved: a launcher that places ranks round robin
    nodes = got[0]
    assert all(v == nodes for v in got.values())
    assert nodes.members == ((0, 2), (1, 3), (4,)) and nodes.names == ("b", "a", "c")
    assert nodes.leaders == (0, 1, 4) and nodes.node_of(3) == 1 and nodes.leader(2) == 4
    assert "node 'a': ranks [1, 3]" in nodes.describe()
    with pytest.raises(ValueError, match="rank 9 is in no node"):
        nodes.node_of(9)


def test_a_rank_that_does_not_answer_is_named_on_every_rank_within_the_deadline() -> None:
    got = _discover_all(["x", "x", None], timeout=1.0)
    for r in (0, 1):
        assert type(got[r]) is AgreeTimeout, got[r]
    assert got[0].missing == (2,)


def test_the_node_name_comes_from_the_environment_else_the_host() -> None:
    assert node_name({}) == socket.gethostname()
    assert node_name({NODE_ENV: "rack4-node17"}) == "rack4-node17"
    for bad in ("", "x" * 256, "a\nb"):
        with pytest.raises(ValueError, match=NODE_ENV):
            node_name({NODE_ENV: bad})


def test_one_process_is_one_node() -> None:
    assert discover(None, "k", 1.0, name="solo") == Nodes(("solo",), ((0,),))
