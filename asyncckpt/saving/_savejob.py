"""The record of one save: :class:`SaveJob`, everything the writer needs to run it.

``save()`` builds it on the caller thread; the protocol (``_commit.run_save``) and the storage
half (``roots._backend``, which reads it through its ``StepJob`` protocol) read and update it on
the writer thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ..format._lifecycle import SaveEvent, SaveState, advance
from ..format._safetensors import ShardLayout
from ..threads._cpumeter import CpuMeter
from . import _dedupe
from ._arena import Arena
from ._memwrite import MemoryWrite
from ._stageprogress import StageProgress


@dataclass
class SaveJob:
    """Everything the writer needs for one save; built by ``save()`` on the caller thread."""

    step: int
    seq: int
    root: str
    arena: Arena | None
    layout: ShardLayout | None
    tree: bytes
    cuda_events: Any
    nbytes: int
    deadline: float  # time.monotonic() by which the outcome must be known
    started: float  # time.perf_counter() at the call to save()
    wait_s: float
    staging_s: float
    keep_last: int | None
    timeout: float = 0.0
    state: SaveState = SaveState.STAGED
    times: dict[str, float] = field(default_factory=dict)
    direct: bool = False
    # set when this rank's state was refused at the call: the rank still takes part, as a failure
    prefailed: BaseException | None = None
    # attempts whose commit rename happened but whose save failed and could not be taken back
    # (shared by the Checkpointer's saves): a retry of that step may replace them
    failed_commits: set[str] = field(default_factory=set)
    # names of directories under the root known dead (shared by the Checkpointer's saves):
    # its own failed attempts and retirements, and the leftovers present when it took the
    # root; only these may be removed before a save of their step
    dead: set[str] = field(default_factory=set)
    # one per writer loop: overlapping saves apply retention one at a time
    retention_lock: asyncio.Lock | None = None
    # one per writer loop: removals of retired checkpoints still running (flush() waits)
    removals: set[asyncio.Task[None]] | None = None
    # retention keeps the latest committed rather than the highest steps
    by_commit_order: bool = False
    # global ranks of the writing group, in group-rank order (recorded in the manifest)
    ranks: tuple[int, ...] | None = None
    # the DTensors this rank holds (``_index.rank_part``'s descriptions); None: none
    dtensors: list[dict[str, Any]] | None = None
    # write plain tensors identical on every rank once (``_dedupe``; many ranks only)
    dedupe: bool = False
    # the state names a tensor twice (tied weights): readers of asyncckpt/1 cannot read it
    tied: bool = False
    # set when save() stages while the writer streams: how far the copy got (its staging_s
    # is the one reported then)
    progress: StageProgress | None = None
    # CPU seconds of the I/O threads' calls for this save
    meter: CpuMeter = field(default_factory=CpuMeter)
    # with dedupe: the file this rank writes before its dedupe round ends, whatever the round
    # decides, a prefix of the arena (``layout`` itself, or the slots the previous round of
    # this structure gave the rank, laid out first); None: the round decides first
    file: ShardLayout | None = None
    # the Checkpointer's record of its last dedupe plan, and the key (the state's layout, one
    # object per structure) this save's plan is recorded under
    plan_hint: _dedupe.PlanHint | None = None
    plan_key: Any = None
    # the run the step belongs to (``_runs``), recorded in the manifest; None: none recorded
    run: str | None = None
    # a save due for the memory tier: this rank's files go there too, from the bytes it holds
    # (``_memwrite``); None: not due, or no memory tier
    memory: MemoryWrite | None = None
    # save()'s walk, plan and tree JSON: wall and caller-thread CPU seconds (SaveStatistics.prepare_s)
    prepared: tuple[float, float] = (0.0, 0.0)
    # the tiers this save goes to (``_frequency.Tiers``): rank 0's decision, sent in the start word
    tiers: Any = None
    # another rank: takes rank 0's decision (the start word's ``tiers``) and returns the backend
    # the save then runs on (``_frequency.Routes.follow``); None: the route is fixed at the call
    route: Any = None

    def advance(self, event: SaveEvent) -> None:
        self.state = advance(self.state, event)
