"""The small frozen records asyncckpt hands back: checkpoint info and save statistics."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SaveStatistics:
    """Where one save's time went (seconds) and how much it wrote.

    ``wait_s``: ``save()`` waiting for a free staging slot (backpressure).
    ``staging_s``: everything else ``save()`` did (flatten, layout, the buffer allocation of
    the first save, the copy); so ``blocking_s`` is the whole time the caller was stopped.
    ``prepare_s`` / ``prepare_cpu_s``: the part of ``staging_s`` that grows with the number of
    tensors rather than their bytes: the walk of the state, the layout plan and the structure's
    JSON, before the copy; wall seconds, and the CPU seconds of the caller's thread in them.
    ``write_s`` / ``fsync_s``: this rank's shard writes and their fsyncs.
    ``commit_s``: the manifest, the renames and the directory fsyncs.
    ``total_s``: from the call to ``save()`` until the outcome was known.
    ``writer_cpu_s``: CPU seconds the save's background work used, measured with per-thread
    CPU clocks on the threads themselves: every I/O-thread call of this save (checksums,
    writes, fsyncs, renames) plus the writer loop thread's CPU while the save ran (which
    includes other saves' loop work when saves overlap). This is what a save takes from
    training when no core is idle; it excludes the copy in ``save()`` (``staging_s``).
    ``cpu_s_per_gib`` relates it to the bytes written.
    ``device_copy_s``: a state holding CUDA tensors: from the call to ``save()`` until the
    device-to-host copies into the staging buffer had run (``save()`` returns once they are
    queued on a side stream; the caller's stream waits for them before touching the tensors
    again); 0.0 for a state without CUDA tensors.
    """

    wait_s: float = 0.0
    staging_s: float = 0.0
    write_s: float = 0.0
    fsync_s: float = 0.0
    commit_s: float = 0.0
    total_s: float = 0.0
    nbytes: int = 0
    retries: int = 0
    direct_io: bool = False
    writer_cpu_s: float = 0.0
    device_copy_s: float = 0.0
    prepare_s: float = 0.0
    prepare_cpu_s: float = 0.0

    @property
    def blocking_s(self) -> float:
        """Time the caller's ``save()`` was blocked: slot wait plus staging."""
        return self.wait_s + self.staging_s

    @property
    def cpu_s_per_gib(self) -> float:
        """``writer_cpu_s`` per GiB of tensor data (0.0 for an empty save)."""
        return self.writer_cpu_s / (self.nbytes / 2**30) if self.nbytes > 0 else 0.0

    @property
    def gbps(self) -> float:
        """Tensor bytes per second from the call to durable commit, in GB/s."""
        return self.nbytes / self.total_s / 1e9 if self.total_s > 0 else 0.0


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk.

    ``nbytes`` counts the tensor bytes written by all ranks. ``statistics`` is set on the
    info a save returns, and ``None`` for checkpoints found on disk. Under an object-store
    root (``Checkpointer("s3://...")``) ``url`` is the step's ``s3://`` prefix and ``path``
    the step's name relative to the root; ``url`` is ``None`` on a file system. ``run``: the
    id of the run the step belongs to (``None`` for a step written before run ids, and in
    the info a save returns on a root that records none). ``tier``: on a node-local root, in
    the info a save returns, where the step is durable: ``"local"`` (every node's disk) or
    ``"memory"`` (every node's memory tier only, ``disk_every``: it survives a crash of the
    training processes, not a reboot; with ``replicate=True`` also one node's loss), and
    ``path`` is the step's directory in that tier; ``None`` elsewhere.
    """

    step: int
    path: pathlib.Path
    nbytes: int
    world_size: int = 1
    created: float = 0.0
    statistics: SaveStatistics | None = None
    url: str | None = None
    run: str | None = field(default=None, compare=False)  # compared as before runs were recorded
    tier: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class RemoteCheckpointInfo:
    """A complete checkpoint on an object store (``url``: its step prefix; ``attempt``: the
    attempt its manifest names; ``run``: the id of the run it belongs to, ``None`` for a step
    written before run ids)."""

    step: int
    url: str
    nbytes: int
    world_size: int = 1
    created: float = 0.0
    attempt: str = ""
    run: str | None = field(default=None, compare=False)  # compared as before runs were recorded


def info_to_json(info: CheckpointInfo | RemoteCheckpointInfo) -> dict[str, Any]:
    """``info`` as JSON (what rank 0 sends every rank); :func:`info_from_json` reads it back
    equal. The statistics of a save's info are not sent (a found checkpoint has none)."""
    if isinstance(info, RemoteCheckpointInfo):
        return {"kind": "remote", "step": info.step, "url": info.url, "nbytes": info.nbytes,
                "world_size": info.world_size, "created": info.created, "attempt": info.attempt, "run": info.run}
    return {"kind": "local", "step": info.step, "path": str(info.path), "nbytes": info.nbytes,
            "world_size": info.world_size, "created": info.created, "url": info.url, "run": info.run}  # fmt: skip


def info_from_json(d: dict[str, Any]) -> CheckpointInfo | RemoteCheckpointInfo:
    """The info :func:`info_to_json` wrote."""
    if d["kind"] == "remote":
        return RemoteCheckpointInfo(int(d["step"]), str(d["url"]), int(d["nbytes"]), int(d["world_size"]),
                                    float(d["created"]), str(d["attempt"]), d["run"])  # fmt: skip
    return CheckpointInfo(int(d["step"]), pathlib.Path(d["path"]), int(d["nbytes"]), int(d["world_size"]),
                          float(d["created"]), None, d["url"], d["run"])  # fmt: skip


@dataclass(frozen=True)
class CheckpointerStatistics:
    """Running totals over one Checkpointer's saves (seconds summed over committed saves)."""

    saves_committed: int = 0
    saves_failed: int = 0
    bytes_committed: int = 0
    blocking_s: float = 0.0
    wait_s: float = 0.0
    staging_s: float = 0.0
    write_s: float = 0.0
    fsync_s: float = 0.0
    commit_s: float = 0.0
    total_s: float = 0.0
    writer_cpu_s: float = 0.0
    last: SaveStatistics | None = None


@dataclass(frozen=True)
class StagingBuffer:
    """One free staging buffer (:meth:`Checkpointer.staging_statistics`).

    ``address``: where it starts in this process's memory; ``capacity``: its size in bytes;
    ``huge_pages``/``pinned``: backed by transparent huge pages / registered with CUDA;
    ``copy_plans``: how many copy plans it built (one per new layout it staged)."""

    address: int
    capacity: int
    huge_pages: bool
    pinned: bool
    copy_plans: int


@dataclass(frozen=True)
class StagingStatistics:
    """The staging buffers of one Checkpointer, read-only (:meth:`Checkpointer.staging_statistics`).

    ``allocations``: buffers allocated so far (a save or ``reserve()`` that reuses one
    allocates none); ``slots``: staging slots free now (``max_pending`` when no save is in
    flight); ``free``: the buffers those slots hold (a slot never used holds none);
    ``layouts_planned``: shard layouts planned so far (kept while a state's structure stays)."""

    allocations: int
    slots: int
    free: tuple[StagingBuffer, ...]
    layouts_planned: int
