"""What the framework integrations share: making a committed step visible under the name a
framework expects, in call order, and never removing a good checkpoint after a failure.

A framework names its checkpoints (Lightning: ``epoch=3.ckpt``; the Hugging Face Trainer:
``checkpoint-40/``) and finds them again by that name. The integrations save into an asyncckpt
root and publish a small *pointer* under the framework's name once the step committed.
:class:`Publisher` is the one thread that does that publishing and the removals the framework
asks for, strictly in the order they were asked: a removal requested after a save runs only
after that save committed, and once a save failed no later removal runs (the older checkpoint
stays) until the failure was raised to the caller.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import uuid
from collections.abc import Callable

from .._info import CheckpointInfo
from ..format._layout import deleting_dir_name, step_dir_name
from ..roots.posix._remove_tree import remove_tree
from ..saving._handle import SaveHandle

log = logging.getLogger("asyncckpt")

_Job = tuple[SaveHandle | None, Callable[..., None], str]


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, data: bytes, *, replace: bool = True) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, rename it to ``path``
    (atomically replacing an existing file) and fsync the directory.

    With ``replace=False`` the caller owns the directory's durability (it will rename or fsync
    the directory itself), so the last fsync is skipped.
    """
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if replace:
        fsync_dir(os.path.dirname(path) or ".")


def drop_step(root: str, step: int) -> None:
    """Remove one committed step of ``root`` that nothing points at any more.

    The step is first renamed to a ``.deleting-`` name (atomically not a checkpoint any more,
    and a crash half-way leaves a leftover the next Checkpointer removes, never a half-deleted
    step that looks complete), then its files are removed.
    """
    src = os.path.join(root, step_dir_name(step))
    dst = os.path.join(root, deleting_dir_name(step, uuid.uuid4().hex[:16]))
    try:
        os.rename(src, dst)
    except FileNotFoundError:
        return
    fsync_dir(root)
    remove_tree(dst)


class Publisher:
    """One thread that runs publishing jobs in the order they were submitted.

    ``after_commit(handle, fn)`` runs ``fn(info)`` once ``handle`` committed; if the save
    failed, its error is kept and every later :meth:`then` job is skipped (logged), because
    those are removals that assumed the save succeeded. ``then(fn)`` runs ``fn()`` after
    every job submitted before it. Errors (the save's, or a job's own) are raised by
    :meth:`raise_failure`, first one first with the others as notes.

    Args:
        name: the thread's name.
        timeout: how long one job may wait for its save, in seconds (the Checkpointer's own
            deadline plus a margin: the save fails by itself before this runs out).
    """

    def __init__(self, name: str, timeout: float) -> None:
        self._name = name
        self._timeout = timeout
        self._lock = threading.Lock()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []
        self._idle = threading.Condition()  # notified as jobs finish; guards _unfinished
        self._unfinished = 0  # jobs submitted and not yet run or skipped

    def after_commit(self, handle: SaveHandle, fn: Callable[[CheckpointInfo], None]) -> None:
        """Run ``fn(info)`` on the publisher thread once ``handle``'s save committed."""
        self._put((handle, fn, ""))

    def then(self, fn: Callable[[], None], what: str) -> None:
        """Run ``fn()`` after every job submitted so far, unless a save among them failed
        (then log that ``what``, e.g. "removing x.ckpt", was skipped)."""
        self._put((None, fn, what))

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every job submitted so far ran (or was skipped), at most ``timeout``
        seconds (default: the publisher's own, which bounds a job's wait for its save: every
        save submitted before the call has failed or committed by then). ``TimeoutError`` names
        the jobs still to run (a removal or pointer write stuck on a file system that does not
        answer); they go on in order, and a later drain waits for them again."""
        limit = self._timeout if timeout is None else timeout
        with self._idle:  # wait_for counts its timeout down across wake-ups: one deadline
            if not self._idle.wait_for(lambda: self._unfinished == 0, limit):
                raise TimeoutError(f"asyncckpt: {self._unfinished} publishing job(s) of {self._name} still "
                                   f"running after {limit}s")  # fmt: skip

    def stop(self) -> None:
        """Let the thread end once the jobs submitted so far ran; a later job starts a new one.

        Also forgets a failed save for the jobs submitted later (the failure itself stays
        until :meth:`raise_failure`).
        """
        with self._lock:
            if self._thread is not None:
                self._jobs.put(None)
                self._thread = None

    def raise_failure(self) -> None:
        """Raise the first error recorded since the last call (the others as notes)."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            first = errors[0]
            for e in errors[1:]:
                first.add_note(f"also failed: {type(e).__name__}: {e}")
            raise first

    def record(self, e: BaseException) -> None:
        """Keep ``e`` for :meth:`raise_failure` (errors of the caller's own background work)."""
        with self._lock:
            self._errors.append(e)

    def _put(self, job: _Job) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            with self._idle:
                self._unfinished += 1
            self._jobs.put(job)

    def _run(self) -> None:
        blocked = False  # a save failed: later removals must not take an older good checkpoint
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                handle, fn, what = job
                if handle is not None:
                    try:
                        info = handle.result(timeout=self._timeout)
                    except BaseException as e:  # noqa: BLE001 - raised by raise_failure()
                        self.record(e)
                        blocked = True
                        continue
                    fn(info)
                elif blocked:
                    log.warning("asyncckpt: not %s: an earlier save failed", what)
                else:
                    fn()
            except BaseException as e:  # noqa: BLE001 - raised by raise_failure()
                self.record(e)
            finally:
                self._jobs.task_done()
                if job is not None:
                    with self._idle:
                        self._unfinished -= 1
                        self._idle.notify_all()

