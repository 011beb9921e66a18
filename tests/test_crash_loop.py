"""A real crash loop: SIGKILL a process that is saving checkpoints, at >= 20 random points in
every phase of a save, restart it, and check after every kill what the commit protocol promises.

The worker (``_crash_worker.py``) saves ``expected_state(step)`` for successive steps,
overwrites its tensors as soon as ``save()`` returns, and reports its progress. The test picks
a phase to aim at (staging, shard write, commit, post-commit, between saves), waits for the
event that opens it, sleeps a seeded random fraction of that phase's observed length and
sends SIGKILL. After each kill, with the worker reaped:

* every directory with a committed name (``step_N``) has a manifest, loads with
  verification, and equals exactly what was saved at step N; everything else is a leftover;
* ``find_latest()`` names the newest of them, ``load(root)`` returns it, and no save the
  worker saw committed is lost;
* a new ``Checkpointer`` on the root removes every leftover and keeps every checkpoint;
* the next worker resumes at the newest complete step + 1.

The phase a kill really landed in is read back from the worker's last events and the disk;
the test requires hits in every phase (aiming again at any phase the planned kills missed).
"""

from __future__ import annotations

import functools
import os
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
from _crash_worker import IDLE_S, KEEP_LAST, expected_state
from conftest import assert_same

from asyncckpt import Checkpointer, CheckpointError, find_latest, load
from asyncckpt.format._layout import META_DIR

WORKER = Path(__file__).parent / "support" / "_crash_worker.py"
REPO = Path(__file__).resolve().parents[1]
SEED = 20240521
TARGETS = ("staging", "shard write", "commit", "post-commit", "between saves")
# the worker events that open and close each phase, and a first guess of its length (s),
# replaced by the median of what the workers report
OPENED_BY = {"staging": "saving", "shard write": "write", "commit": "commit", "post-commit": "renamed",
             "between saves": "committed"}  # fmt: skip
CLOSED_BY = {"staging": "staged", "shard write": "commit", "commit": "renamed", "post-commit": "committed",
             "between saves": "saving"}  # fmt: skip
GUESS = {"staging": 0.01, "shard write": 0.1, "commit": 0.03, "post-commit": 0.03, "between saves": IDLE_S}
COMMITTED_NAME = re.compile(r"^step_(\d{8,})$")
LEFTOVER_NAME = re.compile(r"^step_\d{8,}\.(tmp|deleting)-[0-9a-f]+$")
WAIT_S = 30.0  # bound on every single wait


class ForkServer:
    """Drives ``_crash_worker.py``: spawn workers, watch their events, reap them."""

    def __init__(self, tmp_path: Path) -> None:
        self.err_path = tmp_path / "workers.err"
        self._err = open(self.err_path, "wb")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=env
        )
        self._lines: queue.Queue[tuple[float, str | None]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="crash-loop-reader", daemon=True)
        self._reader.start()
        #: pid -> [(arrival time, event, step)], and the exit codes of workers that ended
        self.events: defaultdict[int, list[tuple[float, str, int]]] = defaultdict(list)
        self.exited: dict[int, int] = {}
        self._pump(lambda line: line == "ready", 120.0, "the fork server to start")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._lines.put((time.monotonic(), raw.decode().rstrip("\n")))
        self._lines.put((time.monotonic(), None))

    def _fail(self, msg: str) -> None:
        self._err.flush()
        tail = self.err_path.read_text(errors="replace")[-3000:]
        pytest.fail(f"{msg}\n--- worker stderr ---\n{tail}", pytrace=False)

    def _pump(self, until: Callable[[str], bool], timeout: float, what: str) -> str:
        """Consume output (recording worker events) until a line satisfies ``until``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                t, line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._fail(f"timed out after {timeout:.0f}s waiting for {what}")
            if line is None:
                self._fail(f"the fork server exited while waiting for {what}")
            assert line is not None
            parts = line.split()
            if len(parts) == 3 and parts[0].isdigit():
                self.events[int(parts[0])].append((t, parts[1], int(parts[2])))
            elif len(parts) == 3 and parts[0] == "exited":
                self.exited[int(parts[1])] = int(parts[2])
            if until(line):
                return line

    def _send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd.encode() + b"\n")
        self.proc.stdin.flush()

    def spawn(self, root: Path) -> int:
        self._send(f"run {root}")
        return int(self._pump(lambda line: line.startswith("spawned "), WAIT_S, "a worker to spawn").split()[1])

    def wait_event(self, pid: int, event: str, step: int | None = None) -> tuple[float, int]:
        """(arrival time, step) of the worker's first ``event`` (of ``step``, if given)."""
        found = self.event_or_sigkill(pid, event, step)
        if found is None:
            self._fail(f"worker {pid} ended (exit code {self.exited.get(pid)}) before '{event} {step}'")
        assert found is not None
        return found

    def event_or_sigkill(self, pid: int, event: str, step: int | None = None) -> tuple[float, int] | None:
        """:meth:`wait_event`, or ``None`` if a SIGKILL the test did not send ended the worker first
        (any other end before the event fails the test)."""

        def match() -> tuple[float, int] | None:
            return next(((t, s) for t, e, s in self.events[pid] if e == event and step in (None, s)), None)

        if match() is None and pid not in self.exited:
            self._pump(lambda _: match() is not None or pid in self.exited, WAIT_S, f"'{event} {step}' from {pid}")
        found = match()
        if found is None and self.exited.get(pid) != -signal.SIGKILL:
            self._fail(f"worker {pid} ended (exit code {self.exited.get(pid)}) before '{event} {step}'")
        return found

    def reap(self, pid: int) -> int:
        self._send(f"reap {pid}")
        line = self._pump(lambda line: line.startswith(f"reaped {pid} "), WAIT_S, f"worker {pid} to be reaped")
        # the kernel may give this pid to a later worker: it must not inherit this one's end
        self.exited.pop(pid, None)
        return int(line.split()[2])

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self._send("quit")
        except OSError:
            pass
        finally:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=WAIT_S)
            self._reader.join(WAIT_S)
            self.proc.stdout.close()
            self._err.close()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def phase_lengths(events: list[tuple[float, str, int]]) -> dict[tuple[str, bool], list[float]]:
    """How long each phase lasted in one worker's life, from its events, keyed by (phase, first save?).

    A worker's first save allocates the staging buffer, so its staging takes longer than later ones.
    """
    at = {(e, s): t for t, e, s in events}
    first = min((s for _, e, s in events if e == "start"), default=None)
    out: dict[tuple[str, bool], list[float]] = defaultdict(list)
    for (e, s), t in at.items():
        for phase in TARGETS:
            if e == OPENED_BY[phase]:
                end = at.get((CLOSED_BY[phase], s + 1 if phase == "between saves" else s))
                if end is not None:
                    out[(phase, s == first)].append(end - t)
    return out


def landed_in(events: list[tuple[float, str, int]], root: Path) -> str:
    """The phase the worker was in when it died: after its last event, judged with the disk."""
    saving = [s for _, e, s in events if e == "saving"]
    if not saving:
        return "startup"
    step = max(saving)
    seen = {e for _, e, s in events if s == step}
    if "committed" in seen:
        return "between saves"
    if "commit" in seen:
        # the disk tells whether the attempt was renamed to step_N (the root fsync, retention, the handle follow)
        return "post-commit" if (root / f"step_{step:08d}").is_dir() else "commit"
    if "write" in seen or "staged" in seen:
        return "shard write"
    return "staging"


def _median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f}" if values else "-"


@functools.lru_cache(maxsize=4)
def expected(step: int) -> dict[str, Any]:
    return expected_state(step)


def _entries(root: Path) -> list[str]:
    """The root's entries but its metadata directory (the owner lock and record)."""
    return sorted(n for n in os.listdir(root) if n != META_DIR)


def check_disk(root: Path, acked: int, started: int) -> list[int]:
    """Assert the on-disk promises after a kill; return the complete steps."""
    names = _entries(root) if root.exists() else []
    complete = []
    for name in names:
        m = COMMITTED_NAME.match(name)
        if not m:
            assert LEFTOVER_NAME.match(name), f"unexpected entry {name!r} under the root: {names}"
            continue
        step = int(m.group(1))
        assert (root / name / "manifest.json").is_file(), f"{name} has a committed name but no manifest: {names}"
        try:
            state = load(root, step, verify=True)
        except CheckpointError as e:
            pytest.fail(f"{name} has a manifest but does not load: {e!r}", pytrace=False)
        assert_same(state, expected(step))
        complete.append(step)
    latest = find_latest(root)
    if acked:
        assert latest is not None and latest.step >= acked, f"step {acked} was reported committed, newest: {latest}"
    assert (latest.step if latest else None) == (max(complete) if complete else None), (latest, names)
    if latest is not None:
        assert latest.step <= started, f"step {latest.step} was never saved (highest begun: {started})"
        assert_same(load(root), expected(latest.step))
    return complete


@pytest.mark.parametrize(
    "kills",
    [
        pytest.param(20, marks=pytest.mark.timeout(180), id="20"),
        pytest.param(500, marks=[pytest.mark.slow, pytest.mark.timeout(1800)], id="500"),
    ],
)
def test_sigkill_crash_loop(tmp_path: Path, kills: int) -> None:
    rng = random.Random(SEED)
    root = tmp_path / "ckpt"
    plan = [TARGETS[i % len(TARGETS)] for i in range(kills)]
    rng.shuffle(plan)
    extra_tries = dict.fromkeys(TARGETS, 4)  # aims at a phase no planned kill landed in
    lengths: defaultdict[tuple[str, bool], list[float]] = defaultdict(list)
    landed: Counter[str] = Counter()
    aimed: Counter[tuple[str, str]] = Counter()
    cleaned = streak = outside = 0
    acked = started = 0
    complete: list[int] = []
    t_start = time.monotonic()

    with ForkServer(tmp_path) as server:
        while plan:
            target = plan.pop()
            pid = server.spawn(root)
            opened = start = server.event_or_sigkill(pid, "start")
            if start is not None:
                first = start[1]
                assert first == (max(complete) + 1 if complete else 1), f"resumed at {first}, complete: {complete}"
                nth = rng.randint(1, 2)  # the first save after a restart, or the next one
                opened = server.event_or_sigkill(pid, OPENED_BY[target], first + nth - 1)
            if opened is None:
                # SIGKILLed before the test aimed (CI runs other tests beside this one, and one
                # that signals a pid after its number was reused is one way): a crash all the same, at a
                # point nobody chose; every check below holds for it, and the planned kill comes again
                outside += 1
                assert outside <= 5, f"{outside} workers were SIGKILLed by something other than this test"
                plan.append(target)
            else:
                seen = lengths[(target, nth == 1)] or lengths[(target, nth != 1)]
                typical = statistics.median(seen) if seen else GUESS[target]
                time.sleep(max(0.0, opened[0] + rng.uniform(0.0, typical) - time.monotonic()))
                os.kill(pid, signal.SIGKILL)
            code = server.reap(pid)
            assert code == -signal.SIGKILL, f"worker {pid} ended with {code} before it was killed"

            events = server.events.pop(pid, [])
            for key, got in phase_lengths(events).items():
                lengths[key].extend(got)
            phase = landed_in(events, root)
            landed[phase] += 1
            aimed[(target, phase)] += 1
            acked = max([acked] + [s for _, e, s in events if e == "committed"])
            started = max([started] + [s for _, e, s in events if e == "saving"])

            complete = check_disk(root, acked, started)
            # retention runs after each commit; kills between a commit and its retention (with
            # no completed save since) may each leave one extra checkpoint, never fewer
            if any(e == "committed" for _, e, _ in events):
                streak = 0
            streak += phase == "post-commit"
            assert len(complete) <= KEEP_LAST + max(streak, 1), f"retention kept {complete} (keep_last={KEEP_LAST})"
            before = _entries(root)
            with Checkpointer(root, keep_last=KEEP_LAST) as ck:
                after = _entries(root)
                assert not [n for n in after if LEFTOVER_NAME.match(n)], f"leftovers survived a restart: {after}"
                assert ck.steps() == complete, f"a restart changed the checkpoints: {before} -> {after}"
            cleaned += len(before) != len(after)

            if not plan:  # top up: aim again at any phase that no kill has landed in yet
                plan = [p for p in TARGETS if not landed[p] and extra_tries[p] > 0]
                for p in plan:
                    extra_tries[p] -= 1

    landed_total = sum(landed.values())
    report = [f"{landed_total} SIGKILLs in {time.monotonic() - t_start:.1f}s; kills by phase:"]
    report += [f"  {p:14s} {landed[p]:3d}" for p in (*TARGETS, "startup") if landed[p]]
    report.append(f"aimed -> landed: {dict(sorted(aimed.items()))}")
    report.append("median phase length (ms; first save after a restart / later saves): " + ", ".join(
        f"{p} {_median_ms(lengths[(p, True)])}/{_median_ms(lengths[(p, False)])}" for p in TARGETS
    ))  # fmt: skip
    report.append(f"restarts that removed leftovers: {cleaned}; steps committed: {acked}; complete now: {complete}")
    report.append(f"workers SIGKILLed by something other than this test: {outside}")
    print("\n".join(report))
    assert landed_total >= kills
    missed = [p for p in TARGETS if not landed[p]]
    assert not missed, f"no kill landed in {missed}\n" + "\n".join(report)
    assert acked >= 10, "the workers made too little progress between kills"


def _fork_with_pid(server: ForkServer, root: Path, want: int) -> int | None:
    """Spawn a worker, steering the kernel to hand it pid ``want`` (``None``: it would not)."""
    for _ in range(20):
        try:
            Path("/proc/sys/kernel/ns_last_pid").write_text(str(want - 1))
        except OSError:
            return None
        pid = server.spawn(root)
        if pid == want:
            return pid
        os.kill(pid, signal.SIGKILL)
        server.reap(pid)
        server.events.pop(pid, None)
    return None


def test_a_reused_pid_is_a_new_worker(tmp_path: Path) -> None:
    """The kernel reuses pids (pid_max is 32768 here, and a long CI forks many processes): a new
    worker with a dead one's pid must not inherit its exit code, or the test takes the new worker
    for one killed before it started and then waits for it to end by itself."""
    root = tmp_path / "ckpt"
    with ForkServer(tmp_path) as server:
        pid = server.spawn(root)
        assert server.event_or_sigkill(pid, "start") is not None
        os.kill(pid, signal.SIGKILL)
        assert server.reap(pid) == -signal.SIGKILL
        server.events.pop(pid, None)
        again = _fork_with_pid(server, root, pid)
        if again is None:
            pytest.skip("could not steer the next pid (needs root and a quiet pid space)")
        assert server.event_or_sigkill(again, "start") is not None, "the new worker was taken for the dead one"
        os.kill(again, signal.SIGKILL)
        assert server.reap(again) == -signal.SIGKILL
