"""Nodes: which ranks share a machine (and so a node-local disk).

Each rank names its node: the value of the environment variable :data:`NODE_ENV`
(``ASYNCCKPT_NODE``) when it is set, for tests that simulate several nodes on one machine and
for launchers whose containers all report the same host name; else the host name
(``socket.gethostname()``). The names are exchanged through the process group's c10d store
(``_agree.agree``: store calls with a deadline, never a collective); rank 0 groups the ranks by
name and every rank returns the same :class:`Nodes`. Nodes are numbered in the order of their
lowest rank, so node 0 holds rank 0, and each node's *leader* is its lowest rank.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._agree import agree
from ._distributed import DistContext

#: The environment variable that overrides a rank's node name (any non-empty string of at
#: most :data:`MAX_NAME` characters; ranks with the same name are one node).
NODE_ENV = "ASYNCCKPT_NODE"
MAX_NAME = 255


@dataclass(frozen=True)
class Nodes:
    """The ranks of a group by node: ``members[k]`` the ranks of node ``k``, ascending;
    ``names[k]`` its name. Every rank of the group is in exactly one node."""

    names: tuple[str, ...]
    members: tuple[tuple[int, ...], ...]

    @staticmethod
    def group(names: Sequence[str]) -> Nodes:
        """Group ranks ``0..len(names)-1`` by ``names[rank]`` (nodes in order of their lowest rank)."""
        order: dict[str, list[int]] = {}
        for rank, name in enumerate(names):
            order.setdefault(name, []).append(rank)
        return Nodes(tuple(order), tuple(tuple(r) for r in order.values()))

    @staticmethod
    def single(world_size: int, name: str = "") -> Nodes:
        """Every rank on one node (one process, or a group that shares one disk)."""
        return Nodes((name,), (tuple(range(world_size)),))

    def node_of(self, rank: int) -> int:
        """The node that holds ``rank`` (``ValueError`` for a rank of no node)."""
        for k, ranks in enumerate(self.members):
            if rank in ranks:
                return k
        raise ValueError(f"rank {rank} is in no node of {self.members}")

    def leader(self, node: int) -> int:
        """The lowest rank of ``node``: the one that commits and retires on its disk."""
        return self.members[node][0]

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(m[0] for m in self.members)

    def as_json(self) -> dict[str, Any]:
        return {"names": list(self.names), "members": [list(m) for m in self.members]}

    def describe(self) -> str:
        """``node "a": ranks [0, 1]; node "b": ranks [2, 3]`` for messages and logs."""
        return "; ".join(f"node {n!r}: ranks {list(m)}" for n, m in zip(self.names, self.members, strict=True))


def node_name(env: Mapping[str, str] | None = None) -> str:
    """This process's node name: :data:`NODE_ENV` if set, else the host name. ``ValueError``
    for an override that is empty, too long, or holds a control character."""
    env = os.environ if env is None else env
    given = env.get(NODE_ENV)
    if given is None:
        return socket.gethostname()
    if not given or len(given) > MAX_NAME or any(ord(c) < 32 for c in given):
        raise ValueError(f"{NODE_ENV} must be a non-empty name of at most {MAX_NAME} printable characters, "
                         f"not {given!r}")  # fmt: skip
    return given


def discover(dist: DistContext | None, key: str, timeout: float, name: str | None = None) -> Nodes:
    """Collective on every rank of ``dist``'s group (bounded by ``timeout``; an ``AgreeTimeout``
    names the ranks that did not answer): the group's :class:`Nodes`. ``name``: this rank's
    node name (default :func:`node_name`). Without a group: one node holding rank 0."""
    mine = node_name() if name is None else name
    if dist is None:
        return Nodes.single(1, mine)

    def decide(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
        return Nodes.group([o["node"] for o in outcomes]).as_json()

    got = agree(dist, f"{key}/nodes", {"node": mine}, decide, timeout)
    return Nodes(tuple(got["names"]), tuple(tuple(m) for m in got["members"]))
