"""The replica's channels: one gloo process group of two ranks per pair of ranks that talks.

A rank talks to its buddy and to its sources only (``_buddies``), so each such pair has a
process group of its own (:func:`open_group`): a rank holds a socket or two per peer, not one
per rank of the job (a group of every rank is a full mesh: 8,000 sockets a rank at 1,000
nodes of 8). The groups are built directly over the c10d store, not registered with
``torch.distributed`` (no ``new_group``): building them again on the memory tier's thread
(a broken pair: ``_replicas``) cannot interleave with the groups the caller builds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...ranks._distributed import DistContext


class Links:
    """This rank's channels to its peers (job ranks): ``pairs`` maps a peer to the gloo process
    group of the two and the peer's rank in it."""

    def __init__(self, pairs: dict[int, tuple[Any, int]]) -> None:
        self.pairs = pairs

    def send(self, t: torch.Tensor, peer: int) -> Any:
        """Post ``t`` to ``peer``; its ``Work``. ``KeyError`` for a rank this one has no link to."""
        pg, r = self.pairs[peer]
        return pg.send([t], r, 0)

    def recv(self, t: torch.Tensor, peer: int) -> Any:
        """Post the receive of ``t`` from ``peer``; its ``Work``."""
        pg, r = self.pairs[peer]
        return pg.recv([t], r, 0)


def open_group(ranks: DistContext, peers: Iterable[int], generation: int, timeout: float) -> Links:
    """The replica's :class:`Links` from this rank to ``peers`` (its buddy and its sources): a
    gloo process group of two ranks per pair, the pair's ``generation``-th (a new one replaces a
    broken one: :meth:`Replicas.push`), met through the c10d store under the ranks' prefix.
    Collective over the pairs (built side by side on threads, so no order among them can
    deadlock): returns once each peer built it too, else raises ``RuntimeError`` naming the
    peers that did not (gloo's rendezvous) after ``timeout`` seconds."""
    me = ranks.rank
    pairs: dict[int, tuple[Any, int]] = {}
    errors: list[str] = []

    def build(peer: int) -> None:
        low, high = sorted((me, peer))
        try:
            # a store client of the pair's own: a c10d client serves one call at a time, and
            # gloo's rendezvous waits in it (two pairs sharing one could wait on each other)
            store = dist.distributed_c10d.PrefixStore(f"{ranks.prefix}/replica-link/{generation}/{low}-{high}/",
                                                      ranks.connect(probe=False))  # fmt: skip
            pg = dist.ProcessGroupGloo(store, 0 if me == low else 1, 2, timedelta(seconds=max(timeout, 0.01)))
        except Exception as e:  # noqa: BLE001 - raised on the caller's thread below
            text = str(e).strip()
            errors.append(f"the link to rank {peer} could not be built ({text.splitlines()[0] if text else e!r})")
        else:
            pairs[peer] = (pg, 1 if me == low else 0)

    threads = [threading.Thread(target=build, args=(p,), name=f"asyncckpt-replica-link-{p}")
               for p in sorted(set(peers))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # each bounded by gloo's rendezvous timeout
    if errors:
        raise RuntimeError("; ".join(sorted(errors)))
    return Links(pairs)
