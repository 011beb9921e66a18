"""The committing rank's last check: what a reader would refuse is never committed.

``save()`` refuses at the call what the readers' bounds would refuse in one rank's files (its
structure and its shard header: ``_structure_encode``, ``_format``, sharing their limits with the
readers). What no single rank sees, the files of the whole step, is checked here: the
leader (rank 0, or the single process) puts the global index and the manifest it is about to
commit through the very parsers ``load()``, discovery and the CLI use. A failure is the
save's failure (``SaveError`` whose cause is the ``CheckpointCorruptError`` a reader would
raise): nothing is committed and nothing retired, so the previous checkpoint stays the
latest. Torch-free.
"""

from __future__ import annotations

import os

from .._errors import CheckpointCorruptError
from ..format import _index, _manifest


def check_manifest(loc: str, body: bytes) -> None:
    """The manifest ``body`` about to be committed in ``loc``, through the parser every reader
    uses (``_manifest.decode``: its bounds, seal and consistency): ``CheckpointCorruptError``
    naming it, as ``load()`` would raise, if a reader would refuse it."""
    path = os.path.join(loc, _manifest.MANIFEST)
    try:
        _manifest.decode(body, path)
    except CheckpointCorruptError as e:
        raise CheckpointCorruptError(f"not committed, no reader would accept it: {_reason(e)}", path) from None


def check_index(loc: str, world: int, sizes: dict[str, int], index: bytes) -> None:
    """The global index ``index`` about to be written in ``loc``, whose step lists files of
    ``sizes``, through the parser ``load()`` uses (``_index.parse``: its bounds, and every
    chunk tiling its tensor inside the files listed): ``CheckpointCorruptError`` naming it if
    a reader would refuse it."""
    path = os.path.join(loc, _index.INDEX)
    try:
        _index.parse(index, world, sizes)
    except ValueError as e:
        raise CheckpointCorruptError(f"not committed, no reader would accept its global index ({e})", path) from None


def _reason(e: CheckpointCorruptError) -> str:
    msg = str(e)
    return msg[: -len(f": {e.path}")] if e.path and msg.endswith(f": {e.path}") else msg
