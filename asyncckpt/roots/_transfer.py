"""Copy committed steps from any :class:`~asyncckpt.roots._root.Root` to any other: what
``asyncckpt push`` (a local root to a store), ``pull`` (a store to a local root) and tier
mode's upload (``saving._mirror``) are, written once against the interface.

One step (:func:`copy_step`): the source step is opened for reading (``Root.open_reader``:
its files checked against its manifest as a load checks them, held so that a retirement
meanwhile cannot swap them), an attempt is begun at the destination under the *source's*
attempt id (so the manifest's bytes, copied unchanged, name it), every file is streamed
across (``Attempt.write_from``: a window or a store part at a time, never a whole file in
memory, :data:`FILES_IN_FLIGHT` files at once), the CRC-32C of the bytes stored compared
with the source manifest's, and only then the manifest committed (``Attempt.commit``: the
rename, the conditional create, the swap). Any failure before that aborts the attempt: the
destination holds no committed step, and a re-run starts over (the attempt's names are the
same, so what a killed run left is overwritten or collected as a leftover).

Idempotent: a step the destination already holds committed with the very manifest bytes is
``present`` (nothing written); one it holds as another commit (another attempt, or damaged)
is never overwritten (``CheckpointError`` naming it). Ownership: :func:`copy_steps` holds
the destination's claim (a flock, the store's lease) for the whole copy unless the caller
holds it (tier mode: the mirror's lease, passed in through ``ObjectRoot.over``)."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from .._errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ..format._layout import check_step
from ..threads._iopool import IOPool
from ._root import Attempt, Root, StepReader

log = logging.getLogger("asyncckpt")

#: Files of one step copied at a time (each streamed in bounded parts of its own).
FILES_IN_FLIGHT = 2


class TransferStopped(CheckpointError):
    """The caller stopped a copy (``stop`` set); nothing of it was committed."""


@dataclass(frozen=True)
class Copied:
    """What :func:`copy_step` did to one step: ``copied``, or ``present`` (the destination
    already held it committed with the same manifest bytes). ``where``: the destination's
    step (``Root.locate``); ``nbytes``: the bytes of the files its manifest lists."""

    step: int
    status: Literal["copied", "present"]
    where: str
    nbytes: int
    seconds: float


def _held_as(dst: Root, step: int, raw: bytes, attempt: str) -> bool:
    """Whether ``dst`` holds ``step`` committed with the manifest bytes ``raw`` (True) or not
    at all (False); another commit there raises ``CheckpointError`` naming it."""
    where = dst.locate(step)
    try:
        with dst.open_reader(step) as have:
            if have.manifest_raw == raw:
                return True
            other = have.manifest.attempt
    except CheckpointNotFoundError:
        return False
    except CheckpointCorruptError as e:
        raise CheckpointError(
            f"step {step} is already committed at {where} but does not verify ({e}): not overwritten; "
            "remove it there (asyncckpt verify, then gc --remove-bad) to copy the step again"
        ) from None
    raise CheckpointError(
        f"step {step} is already committed at {where} by another attempt ({other}; the source's is {attempt}): "
        "not overwritten"
    )


def _copy_files(reader: StepReader, attempt: Attempt, stop: threading.Event) -> None:
    """Stream every file of ``reader``'s manifest into ``attempt`` and compare its CRC-32C
    with the manifest's (``CheckpointCorruptError`` naming the source file on a mismatch).
    The first failure stops the other files at their next read."""
    m = reader.manifest

    def one(name: str, size: int, crc: int) -> None:
        def read(offset: int, view: memoryview) -> None:
            if stop.is_set():
                raise TransferStopped(f"copy of step {m.step} stopped")
            reader.read_into(name, offset, view)

        got = attempt.write_from(name, size, read)
        if got != crc:  # the source's bytes are not what it committed: never commit them elsewhere
            raise CheckpointCorruptError(
                f"checksum mismatch (CRC-32C {got:08x} read, {crc:08x} in the manifest); not copied",
                reader.locate(name),
            )

    files = sorted(m.files, key=lambda f: f.size)  # the small ones first: a damaged index fails fast
    if len(files) < 2:
        for f in files:
            one(f.name, f.size, f.crc32c)
        return
    # named daemon threads (IOPool), not a ThreadPoolExecutor: tier mode's last upload runs
    # in the exit hook, when a ThreadPoolExecutor refuses new work
    pool = IOPool(min(FILES_IN_FLIGHT, len(files)), "asyncckpt-copy")
    try:
        futures = [pool.submit(one, f.name, f.size, f.crc32c) for f in files]
        try:
            for fut in concurrent.futures.as_completed(futures):
                fut.result()
        except BaseException:
            stop.set()  # the others end at their next read
            concurrent.futures.wait(futures)
            raise
    finally:
        pool.shutdown(wait=False)


def copy_step(src: Root, dst: Root, step: int, *, deadline_s: float | None = None,
              stop: threading.Event | None = None) -> Copied:  # fmt: skip
    """Copy committed ``step`` of ``src`` to ``dst`` (module docstring): ``copied`` or
    ``present``. The destination's attempt runs within ``deadline_s`` (the roots' own
    deadlines bound each of their calls). Raises ``CheckpointNotFoundError`` (``src`` has no
    such committed step), ``CheckpointCorruptError`` (its files do not match its manifest:
    nothing committed), ``CheckpointError`` (``dst`` holds another commit of the step),
    ``TransferStopped`` (``stop`` was set), or the roots' own I/O errors; in every case
    ``dst`` was given no committed step. The caller holds ``dst``'s claim if it needs one."""
    check_step(step)
    t0 = time.monotonic()
    stop = stop if stop is not None else threading.Event()
    with src.open_reader(step) as reader:
        m, raw = reader.manifest, reader.manifest_raw
        nbytes = sum(f.size for f in m.files)
        if _held_as(dst, step, raw, m.attempt):
            return Copied(step, "present", dst.locate(step), nbytes, time.monotonic() - t0)
        try:
            attempt = dst.begin(step, attempt=m.attempt, deadline_s=deadline_s)
        except FileExistsError as e:  # committed meanwhile, or not a checkpoint: never ours to replace
            raise CheckpointError(f"step {step} cannot be copied to {dst.locate(step)}: {e.strerror}") from None
        except ValueError:  # the attempt id names files and keys: a manifest whose id cannot is damaged
            raise CheckpointCorruptError(f"manifest attempt id {m.attempt[:80]!r} is not a hex token",
                                         reader.locate()) from None  # fmt: skip
        try:
            _copy_files(reader, attempt, stop)
            if stop.is_set():
                raise TransferStopped(f"copy of step {step} stopped")
        except BaseException:
            try:
                attempt.abort()
            except Exception as e:  # noqa: BLE001 - the first failure is the one to raise
                log.warning("could not remove the attempt at %s after a failed copy: %s", attempt.location, e)
            raise
        try:
            attempt.commit(raw)  # aborts the attempt itself when it fails
        except FileExistsError as e:
            raise CheckpointError(f"step {step} was committed at {dst.locate(step)} by another attempt while this "
                                  f"copy ran: not overwritten ({e.strerror})") from None  # fmt: skip
    return Copied(step, "copied", dst.locate(step), nbytes, time.monotonic() - t0)


def choose_steps(src: Root, steps: str | int | Iterable[int] | None = None, *, newest: int | None = None) -> list[int]:
    """The steps of ``src`` a copy takes, oldest first: ``None`` every resumable step,
    ``"latest"`` the newest resumable one (``CheckpointNotFoundError`` if none), a step or
    steps as given (each must be committed there when copied); ``newest=N``: of those, the
    newest ``N``. ``ValueError``/``TypeError`` for anything else."""
    if newest is not None and (not isinstance(newest, int) or isinstance(newest, bool) or newest < 1):
        raise ValueError(f"newest must be a positive int or None, not {newest!r}")
    if steps is None:
        chosen = sorted({e.step for e in src.list_steps() if e.resumable})
    elif steps == "latest":
        found = src.newest_resumable()
        if found is None:
            raise CheckpointNotFoundError(f"no complete checkpoint under {src.url}")
        chosen = [found]
    elif isinstance(steps, str):
        raise ValueError(f"steps must be None, 'latest', a step or a list of steps, not {steps!r}")
    elif isinstance(steps, int):
        chosen = [check_step(steps)]
    else:
        chosen = sorted({check_step(s) for s in steps})
    return chosen if newest is None else chosen[-newest:]


def copy_steps(src: Root, dst: Root, steps: str | int | Iterable[int] | None = None, *, newest: int | None = None,
               role: str = "asyncckpt copy", claim: bool = True, keep_last: int | None = None,
               deadline_s: float | None = None) -> list[Copied]:  # fmt: skip
    """Copy the steps :func:`choose_steps` picks from ``src`` to ``dst``, oldest first, each
    by :func:`copy_step`; with ``claim`` holding ``dst``'s ownership as ``role`` throughout
    (``RootInUseError`` naming the holder if another has it). ``keep_last``: afterwards
    retire ``dst``'s resumable steps beyond its newest ``keep_last`` (``Root.retire``).
    Everything within ``deadline_s`` when given. Stops at the first step that fails."""
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise ValueError(f"keep_last must be a positive int or None, not {keep_last!r}")
    until = None if deadline_s is None else time.monotonic() + deadline_s
    chosen = choose_steps(src, steps, newest=newest)
    held = dst.claim(role) if claim else None
    try:
        out = []
        for s in chosen:
            left = None if until is None else max(0.0, until - time.monotonic())
            out.append(copy_step(src, dst, s, deadline_s=left))
        if keep_last is not None:
            retired = dst.retire(keep_last)
            if retired:
                log.info("retired steps %s under %s", retired, dst.url)
        return out
    finally:
        if held is not None:
            held.release()
