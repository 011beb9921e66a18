"""A run is an identity: which training history a step belongs to, and the step rules across tiers.

A *run* is one training history. Its id (32 hex digits) is made when a job starts where no
resumable step is found, recorded in the manifest of every step the job commits (sealed,
like the step), and carried through resumes: a job that resumes takes the run of the step it
resumes from. Rank 0 decides at construction (:func:`decide`); every rank gets its answer.

Which run a job continues, from the newest resumable step of each tier found at construction:

1. the local root's, when it holds one (tier mode too): the local root is what the job writes
   and restores from first, and its steps are this job's history;
2. else the store's (tier mode with an empty local root: a new node resuming its run from the
   store, nothing says otherwise; an ``s3://`` root: its only tier);
3. else a new run.

So a resume never takes another run's data silently: in tier mode a step of another run on
the store is never chosen by ``latest()`` / ``load(step=None)`` (a WARNING names it) and never
retired by this job's ``keep_last_remote``. A manifest written before runs were recorded
has no run (``None``): it counts as belonging to any run (:func:`same_run`), as before; a job
resuming from one starts a new run id.

The step rule across tiers (:func:`check_store_step`): a step at or below the newest committed
step the store held at construction (of any run) is refused by ``save()`` with ``ValueError``,
as a step below the newest local one is: both tiers are named and retained by step, so a lower
step could never be the newest and could not be uploaded over an existing one. What
construction found is cached (``save()`` does no store round trip). A store construction could
not read leaves the rule *pending*, never off: ``save()`` looks again (:class:`StoreLook`, at
most once a minute, bounded) until a look succeeds, and until then the mirror looks before
each upload and refuses to upload a step below the store's newest (``_mirror``).

A load across many ranks agrees on the exact commit (:func:`choice`): rank 0 picks the step and
names its manifest's attempt and run; every rank checks that the manifest it reads is that
attempt (:func:`check_choice`) and refuses another one with ``CheckpointError``, so no rank
reads another run's (or another attempt's) files for the step the others read.

Torch-free; the store functions import obstore only when called.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointCorruptError, CheckpointError
from ..format._layout import step_dir_name
from ..format._stepstates import same_run
from ..threads._sync import run_sync
from .posix._discovery import newest_resumable

if TYPE_CHECKING:
    from ..format._manifest import Manifest
    from ._root import Root
    from .objstore._client import ObjectStore

log = logging.getLogger("asyncckpt")


def new_run_id() -> str:
    """A fresh run id: 32 lowercase hex digits."""
    return uuid.uuid4().hex


def short(run: str | None) -> str:
    """A run id as messages show it (its first 12 hex digits; ``none`` for an older step)."""
    return "none (written before run ids)" if run is None else run[:12]


@dataclass(frozen=True)
class Newest:
    """A tier's newest resumable step as construction found it: its step and its run."""

    step: int
    run: str | None

    def as_json(self) -> list[Any]:
        return [self.step, self.run]

    @staticmethod
    def from_json(v: Any) -> Newest | None:
        return None if v is None else Newest(int(v[0]), v[1])


def decide(local: Newest | None, store: Newest | None) -> str:
    """The run a job continues (module docstring): the local root's newest step's, else the
    store's, else a new one; a newest step without a run starts a new one."""
    found = local if local is not None else store
    if found is None or found.run is None:
        return new_run_id()
    return found.run


def local_newest(root: str) -> Newest | None:
    """The newest resumable step under local ``root`` and its run (``None``: there is none)."""
    m = newest_resumable(root)  # the manifest the look read: its run
    return None if m is None else Newest(m.step, m.run)


async def store_newest(store: ObjectStore, deadline: float) -> Newest | None:
    """The newest resumable step on ``store`` and its run (``None``: there is none)."""
    from .objstore._steps import newest_resumable

    found = await newest_resumable(store, deadline)
    return None if found is None else Newest(found[0].step, found[0].run)


def at_start(
    root: str, resuming: bool, store: ObjectStore | None, mirror: ObjectStore | None, timeout: float
) -> list[Any]:
    """Rank 0 at construction (JSON for every rank): the run this job continues (:func:`decide`)
    and, in tier mode, the mirror's newest step (``None``: none, or unknown). ``root`` is a local
    root or, with ``store``, an object-store root; ``resuming``: it holds complete steps."""
    if store is not None:  # an object-store root: its only tier
        return [decide(survey_store(store, timeout)[0] if resuming else None, None), None, True]
    far, known = (None, True) if mirror is None else survey_store(mirror, timeout)
    run = decide(local_newest(root) if resuming else None, far)
    if mirror is not None:
        warn_at_start(far, mirror.url, run)
    return [run, None if far is None else far.as_json(), known]


def survey_store(store: ObjectStore, timeout: float, when: str = "at construction") -> tuple[Newest | None, bool]:
    """Rank 0: the store's newest step, within ``timeout`` s, and whether the store could be read.

    A store that cannot be read does not stop training (README "Tier mode"): the failure is
    logged and ``(None, False)`` returned; the step rule across tiers is then pending
    (module docstring), never dropped.
    """
    try:
        return run_sync(lambda: store_newest(store, time.monotonic() + timeout)), True
    except Exception as e:  # noqa: BLE001 - ObjectStoreError, a corrupt listing: never fatal here
        log.warning(
            "asyncckpt: could not read the newest step under %s %s (%s: %s): save() looks again (at most once a "
            "minute) and, until a look succeeds, each upload first checks that the store holds no higher step",
            store.url, when, type(e).__name__, e,
        )  # fmt: skip
        return None, False


#: A pending step rule (a store construction could not read) is looked at again at most this often.
RELOOK_EVERY_S = 60.0


class StoreLook:
    """Rank 0's looks at the store's newest step after construction could not read it
    (module docstring): at most one every :data:`RELOOK_EVERY_S`, each within ``timeout``."""

    def __init__(self) -> None:
        self._last = -math.inf

    def __call__(self, store: ObjectStore, timeout: float) -> list[Any]:
        """``[newest as JSON, known]`` (JSON for every rank): ``known`` False when the look
        failed or was skipped (one was tried less than :data:`RELOOK_EVERY_S` ago)."""
        now = time.monotonic()
        if now - self._last < RELOOK_EVERY_S:
            return [None, False]
        self._last = now
        far, known = survey_store(store, timeout, "before save()")
        return [None if far is None else far.as_json(), known]


def warn_at_start(far: Newest | None, url: str, run: str) -> None:
    """Tier mode at construction: say so (WARNING) when the store's newest step belongs to
    another run than the one this job continues (the local root's)."""
    if far is not None and not same_run(far.run, run):
        log.warning(
            "asyncckpt: the mirror %s holds steps of another run (newest: step %d, run %s); this job continues "
            "run %s (its local root's): those steps are never loaded unless asked for by step, never retired "
            "by it, and save() refuses steps at or below %d",
            url, far.step, short(far.run), short(run), far.step,
        )  # fmt: skip


def check_store_step(step: int, store: Newest | None, url: str, run: str, allow_earlier: bool) -> None:
    """``save(step)``'s rule across tiers: ``ValueError`` when the store held ``step`` (or,
    unless ``allow_earlier``, a higher step) at construction. No I/O."""
    if store is None or step > store.step:
        return
    whose = "this run's" if same_run(store.run, run) else f"another run's (run {short(store.run)}; this job is run " \
        f"{short(run)})"
    where = f"{url}/{step_dir_name(store.step)}"
    if step == store.step:
        raise ValueError(f"step {step} is already committed on the store ({where}, {whose}): a step is uploaded "
                         "once; save a higher step")
    if allow_earlier:
        return
    raise ValueError(
        f"step {step} is lower than step {store.step}, the newest committed checkpoint on the store ({where}, "
        f"{whose}): steps must increase across both tiers (latest(), load() and keep_last_remote go by step); "
        + ("resume from it (load()) and save higher steps" if same_run(store.run, run) else
           "mirror a new run to a prefix of its own, or remove the store's steps first")
    )


async def newest_of_run(
    store: ObjectStore, deadline: float, run: str | None, skip: frozenset[int] = frozenset(),
    bad: list[tuple[int, CheckpointCorruptError]] | None = None,
) -> tuple[tuple[Manifest, bytes] | None, list[Manifest]]:
    """The newest resumable step on ``store`` not in ``skip`` that belongs to ``run`` (any run
    with ``None``), and the newer ones of other runs passed over (newest first). Newer steps
    passed over as corrupt or known bad are put in ``bad``."""
    from .objstore._steps import newest_resumable

    passed: list[Manifest] = []
    skipped = set(skip)
    while True:
        found = await newest_resumable(store, deadline, frozenset(skipped), passed=bad)
        if found is None or same_run(found[0].run, run):
            return found, passed
        passed.append(found[0])
        skipped.add(found[0].step)


def warn_other_runs(passed: list[Manifest], url: str, run: str) -> None:
    """Log (WARNING) the store's steps of another run that a choice passed over."""
    if passed:
        steps = ", ".join(str(m.step) for m in passed[:5]) + (", ..." if len(passed) > 5 else "")
        log.warning(
            "asyncckpt: the store %s holds newer steps of another run (%s, run %s) than this job's (run %s): "
            "never chosen by latest() or load(); load(step=N) reads one explicitly",
            url, steps, short(passed[0].run), short(run),
        )  # fmt: skip


def warn_above(uploaded: int, newest: Newest | None, url: str, run: str) -> None:
    """After an upload: say so (WARNING) when the store holds a higher step than the one just
    uploaded (written there after construction by another writer, or unknown then)."""
    if newest is not None and newest.step > uploaded:
        whose = "this run" if same_run(newest.run, run) else f"another run, {short(newest.run)}"
        log.warning(
            "asyncckpt: uploaded step %d to %s, which already holds step %d (%s): the next job on this prefix "
            "will refuse steps at or below %d; keep_last_remote keeps the step just uploaded",
            uploaded, url, newest.step, whose, newest.step,
        )  # fmt: skip


# ------------------------------------------------------------------ many ranks: one exact commit


def choice(step: int, m: Manifest | None) -> list[Any]:
    """Rank 0's choice of a commit for a collective load (JSON): the step, its manifest's
    attempt and run (``None``, ``None``: rank 0 has no manifest to name; each rank finds out)."""
    return [step, None, None] if m is None else [step, m.attempt, m.run]


def choice_at(root: Root, step: int) -> list[Any]:
    """:func:`choice` for ``step`` of ``root``, as rank 0 sees it now (``Root.open_reader``: the
    committed manifest whose files match it; none: each rank finds out what is wrong)."""
    try:
        with root.open_reader(step) as reader:
            return choice(step, reader.manifest)
    except (CheckpointError, OSError):  # a defect, the medium's error: every rank finds it itself
        return choice(step, None)


def unpack(chosen: Any) -> tuple[int, str | None]:
    """A choice's step and attempt (a bare step, from a peer without choices: no attempt)."""
    if isinstance(chosen, list):
        return int(chosen[0]), chosen[1]
    return int(chosen), None


def check_choice(m: Manifest, attempt: str | None, where: str) -> None:
    """``CheckpointError`` unless manifest ``m`` (what this rank reads at ``where``) is the
    commit rank 0 chose (``attempt``; ``None``: no check)."""
    if attempt is not None and m.attempt != attempt:
        raise CheckpointError(
            f"step {m.step} at {where} is attempt {m.attempt} (run {short(m.run)}) here, not attempt {attempt} "
            "that rank 0 chose: the ranks do not see the same checkpoint (a node-local root, or another run's "
            "files at this path); refused rather than mixing two commits"
        )
