"""Where checkpoints live: one :class:`Root` interface (``_root``) and one registry,
:func:`open_root` (``_registry``: the only scheme check), with a POSIX directory
(``posix/``), an object-store prefix (``objstore/``) and memory (``_memory``) behind it, tier
mode's two roots read as one (``_tier``), a node's part of a step on the node-local tiers read
through the interface's read side (``_nodeparts``); and what serves them all (the storage half
of the save protocol, one file write's contract, bad marks, read faults, runs, the
Checkpointer's start on its root)."""

from ._registry import open_root
from ._root import Attempt, Capabilities, Claim, Leftover, Listed, Root

__all__ = ["Attempt", "Capabilities", "Claim", "Leftover", "Listed", "Root", "open_root"]
