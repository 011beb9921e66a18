"""Who holds whose replica: each rank's *buddy* is a rank on the next node of a ring of nodes.

Deterministic from :class:`~asyncckpt.ranks._nodes.Nodes` alone, so every rank computes the
same assignment without a message: rank ``r``, the ``i``-th rank of node ``k``, has as its buddy
the ``i``-th rank (modulo that node's size) of node ``(k + 1) % n``. So a buddy is always on
another node; with nodes of one size every rank holds exactly one other rank's replica (its
*source*), with uneven nodes a rank may hold several or none (:func:`sources_of`). With one node
there is no other node to hold a replica: :func:`buddy_of` is ``None``.

What survives (one replica per rank, the ring above): the loss of any one node (its ranks'
parts are on the next node); the loss of two nodes that are not neighbours in the ring; not the
loss of two neighbours ``k`` and ``k + 1`` (node ``k``'s parts were on ``k + 1``), which with two
nodes is every pair.
"""

from __future__ import annotations

from ...ranks._nodes import Nodes


def buddy_of(nodes: Nodes, rank: int) -> int | None:
    """The rank that holds ``rank``'s replica (on the next node), ``None`` with one node."""
    n = len(nodes.members)
    if n < 2:
        return None
    k = nodes.node_of(rank)
    nxt = nodes.members[(k + 1) % n]
    return nxt[nodes.members[k].index(rank) % len(nxt)]


def sources_of(nodes: Nodes, rank: int) -> tuple[int, ...]:
    """The ranks whose replicas ``rank`` holds, ascending (empty with one node)."""
    world = sum(len(m) for m in nodes.members)
    return tuple(s for s in range(world) if buddy_of(nodes, s) == rank)


def lost_with(nodes: Nodes, lost: set[int]) -> tuple[int, ...]:
    """The ranks whose parts no surviving replica holds when the nodes ``lost`` (indices) are
    gone with their memory: a lost rank whose buddy is on a lost node too."""
    out = []
    for k in sorted(lost):
        for r in nodes.members[k]:
            b = buddy_of(nodes, r)
            if b is None or nodes.node_of(b) in lost:
                out.append(r)
    return tuple(out)
