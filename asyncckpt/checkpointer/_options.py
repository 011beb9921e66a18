"""The Checkpointer's options, checked once at construction: bad input raises here, typed."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .._info import CheckpointInfo
from ..format._state_prefixes import check_strip_prefixes
from ..roots._scheme import is_url
from ..roots.posix._osops import OsOps
from ..roots.posix._root import step_dir_hint
from ..saving._frequency import Every, check_disk_every, check_every
from ..saving._memtier import check_apart
from ..saving._memtier import check_options as check_memory
from ..saving._mirror import check_options
from ..saving._nodelocal import check_option as check_node_local

OnError = Literal["raise", "warn"]
DirectIO = Literal["auto", "on", "off"]


def is_int(v: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Options:
    """Every option of one Checkpointer, checked (see :class:`Checkpointer` for their meaning).

    ``root`` is the resolved root (``realpath``; for a store root its URL), ``given`` the
    root as passed (made absolute): the key ranks agree on at start. ``store`` is the
    object store of an ``s3://`` root (``None`` for a directory); ``store_options`` its
    ``storage_options``; ``ttl`` its lease's TTL. ``lease_ttl`` is the mirror's lease TTL."""

    root: str
    given: str
    store: Any
    store_options: dict[str, str] | None
    ttl: float
    keep_last: int | None
    timeout: float
    max_pending: int
    on_error: OnError
    direct_io: DirectIO
    verify: bool
    io_threads: int
    process_group: Any
    on_commit: Callable[[CheckpointInfo], object] | None
    strip_prefixes: tuple[str, ...]
    allow_earlier_steps: bool
    dedupe: bool
    mirror: str | None
    keep_last_remote: int | None
    mirror_options: Mapping[str, str] | None
    lease_ttl: float | None
    huge_pages: bool
    os_ops: OsOps
    node_local: bool = False
    #: the memory tier (``saving._memtier``): its directory (absolute), steps kept, byte budget
    memory: str | None = None
    memory_keep_last: int = 1
    memory_budget: int | None = None
    #: tier frequencies (``saving._frequency``: every n-th save, or a save at least a timedelta
    #: after the last one there): the memory tier, the store (of the disk commits), the node disks
    #: (the others go to the memory tier only)
    memory_every: Every = 1
    mirror_every: Every = 1
    disk_every: Every = 1
    #: the peer replica of the memory tier (``roots.replica``)
    replicate: bool = False

    @classmethod
    def check(
        cls,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None,
        timeout: float,
        max_pending: int,
        on_error: OnError,
        direct_io: DirectIO,
        verify: bool,
        io_threads: int,
        process_group: Any,
        on_commit: Callable[[CheckpointInfo], object] | None,
        strip_prefixes: Sequence[str],
        allow_earlier_steps: bool,
        dedupe: bool,
        mirror: str | None,
        keep_last_remote: int | None,
        storage_options: Mapping[str, str] | None,
        lease_ttl: float | None,
        huge_pages: bool,
        os_ops: OsOps,
        node_local: bool = False,
        memory: str | os.PathLike[str] | None = None,
        memory_keep_last: int | None = None,
        memory_budget: int | None = None,
        memory_every: Every | None = None,
        mirror_every: Every | None = None,
        replicate: bool = False,
        disk_every: Every | None = None,
    ) -> Options:
        """The checked options; raises ``TypeError``/``ValueError`` naming the first bad one
        (no I/O: an ``s3://`` root's store is opened, not reached)."""
        prefixes = check_strip_prefixes(strip_prefixes)
        store = None
        ttl = 0.0
        if is_url(root):
            store = open_store_root(root, mirror, keep_last_remote, storage_options, direct_io, allow_earlier_steps)
            from ..roots.objstore._lease import DEFAULT_TTL_S, check_ttl  # obstore: only for s3:// roots

            ttl = check_ttl(lease_ttl) if lease_ttl is not None else DEFAULT_TTL_S
        else:
            check_options(mirror, keep_last_remote, storage_options)  # tier mode: bad options raise here
            if lease_ttl is not None:
                if mirror is None:
                    raise ValueError(
                        "lease_ttl applies to an object-store root (s3://...) or a mirror=; a local root is locked"
                    )
                from ..roots.objstore._lease import check_ttl  # obstore: only for tier mode

                lease_ttl = check_ttl(lease_ttl)  # the mirror's lease (taken at its first upload)
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"root must be a path, not {type(root).__name__}")
        if keep_last is not None and (not is_int(keep_last) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None, not {keep_last!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        if not is_int(max_pending) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, not {max_pending!r}")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', not {on_error!r}")
        if direct_io not in ("auto", "on", "off"):
            raise ValueError(f"direct_io must be 'auto', 'on' or 'off', not {direct_io!r}")
        if not is_int(io_threads) or io_threads < 1:
            raise ValueError(f"io_threads must be a positive int, not {io_threads!r}")
        if store is not None:
            given = resolved = store.url
        else:
            given = os.path.abspath(os.fspath(root))
            # pinned: a symlinked root (runs/current -> runs/exp7) repointed while the job runs
            # must not make it write to, or retire in, a root it does not own
            resolved = os.path.realpath(given)
            hint = step_dir_hint(resolved)
            if hint is not None:  # saving there would write into a committed checkpoint
                raise ValueError(f"{given} is not a checkpoint root: {hint}")
        if on_commit is not None and not callable(on_commit):
            raise TypeError("on_commit must be callable")
        if not isinstance(allow_earlier_steps, bool):
            raise TypeError(f"allow_earlier_steps must be a bool, not {allow_earlier_steps!r}")
        if mirror is not None and allow_earlier_steps:
            # both tiers go by step (latest(), keep_last_remote): a rewound run's new, lower
            # steps would be retired on the store at once and lose to the old ones at resume
            raise ValueError("mirror= does not support allow_earlier_steps=True yet")
        if not isinstance(dedupe, bool):
            raise TypeError(f"dedupe must be a bool, not {dedupe!r}")
        if not isinstance(huge_pages, bool):
            raise TypeError(f"huge_pages must be a bool, not {huge_pages!r}")
        check_node_local(node_local, store is not None, allow_earlier_steps)  # the node-local tier
        mem = check_memory(memory, memory_keep_last, memory_budget, node_local)  # the memory tier
        if mem is not None:
            check_apart(mem, resolved)
        every_mem = check_every("memory_every", memory_every, mem, node_local)
        every_mirror = check_every("mirror_every", mirror_every, mirror, node_local, shared=True)
        every_disk = check_disk_every(disk_every, mem, every_mem, node_local)
        if not isinstance(replicate, bool):
            raise TypeError(f"replicate must be a bool, not {type(replicate).__name__}")
        if replicate and mem is None:
            raise ValueError("replicate=True copies the memory tier to a peer node: it needs memory=...")
        if not isinstance(os_ops, OsOps):
            raise TypeError(f"os_ops must be an asyncckpt.testing.OsOps, not {type(os_ops).__name__}")
        return cls(
            root=resolved, given=given, store=store,
            store_options=dict(storage_options) if store is not None and storage_options else None,
            ttl=ttl, keep_last=keep_last, timeout=float(timeout), max_pending=max_pending, on_error=on_error,
            direct_io=direct_io, verify=verify, io_threads=io_threads, process_group=process_group,
            on_commit=on_commit, strip_prefixes=prefixes, allow_earlier_steps=allow_earlier_steps,
            # node-local: a node's part must hold every byte its ranks load, so no rank writes for another
            dedupe=dedupe and not node_local,
            mirror=mirror, keep_last_remote=keep_last_remote, mirror_options=storage_options, lease_ttl=lease_ttl,
            huge_pages=huge_pages, os_ops=os_ops, node_local=node_local, memory=mem,
            memory_keep_last=memory_keep_last or 1, memory_budget=memory_budget, memory_every=every_mem,
            mirror_every=every_mirror, replicate=replicate, disk_every=every_disk,
        )  # fmt: skip


def open_store_root(
    url: str,
    mirror: object,
    keep_last_remote: object,
    storage_options: Mapping[str, str] | None,
    direct_io: object,
    allow_earlier_steps: object,
) -> Any:
    """The :class:`ObjectStore` of an ``s3://`` root (no I/O); options that have no meaning
    there raise ``ValueError`` here, at the constructor."""
    if mirror is not None:
        raise ValueError("mirror= needs a local root (tier mode); this root is already an object store")
    if keep_last_remote is not None:
        raise ValueError("keep_last_remote applies to mirror=; an object-store root retains with keep_last")
    if direct_io != "auto":
        raise ValueError(f"direct_io={direct_io!r} has no meaning on an object store (use the default 'auto')")
    if allow_earlier_steps:
        raise ValueError("allow_earlier_steps=True is not supported on an object-store root yet")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(f"storage_options must be a mapping of str to str, not {type(storage_options).__name__}")
    from ..roots.objstore._remote import open_store

    return open_store(url, storage_options)
