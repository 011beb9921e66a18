"""Measurement helpers: statistics, durability, page cache, memory, and the training loop."""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

_ODIRECTORY = getattr(os, "O_DIRECTORY", 0)


# ---------------------------------------------------------------------- statistics
def summary(samples: Iterable[float]) -> dict[str, Any]:
    """Median, min and max of ``samples`` (all kept, in run order)."""
    xs = [float(x) for x in samples]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0, "samples": []}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "samples": xs}


def cpu_seconds() -> float:
    """User + system CPU time of this process so far (every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def raise_fd_limit(want: int = 1 << 18) -> int:
    """Raise this process's open-files limit towards ``want``; returns the soft limit now.

    DCP's process-based save passes every tensor storage to its daemon as file descriptors
    (a shared-memory fd plus a duplicate held until the daemon picks it up), so 10,000
    tensors need more than 20,000 descriptors. Raising the hard limit needs privileges;
    without them the soft limit goes up to the hard one.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        with open("/proc/sys/fs/nr_open") as f:
            want = min(want, int(f.read()))
    except (OSError, ValueError):
        pass
    for new in ((max(want, hard), max(want, hard)), (hard, hard)):
        if new[0] <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, new)
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ---------------------------------------------------------------------- durability
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | _ODIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path`` and ``path``'s parent.

    Used after methods whose own durability guarantee does not cover everything that
    asyncckpt's commit covers (directory entries in particular), so that "durable" means the
    same for every method.
    """
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return [os.path.join(d, n) for d, _, names in os.walk(path) for n in names]


def drop_cache(paths: Iterable[str]) -> None:
    """Evict the (clean) page-cache pages of ``paths`` (files or directories, recursively)."""
    for p in paths:
        for f in files_under(p):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)  # only clean pages can be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ---------------------------------------------------------------------- memory
def _status_kb(pid: int | str, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(field.encode() + b":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _pss_kb(pid: int | str) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return _status_kb(pid, "VmRSS")


def descendants(pid: int | None = None) -> list[int]:
    """All live descendant process ids of ``pid`` (default: this process)."""
    root = pid or os.getpid()
    out: list[int] = []
    todo = [root]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except (OSError, ValueError):
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def rss_bytes() -> int:
    return _status_kb("self", "VmRSS") * 1024


def trim_heap() -> None:
    """Give freed heap memory back to the OS so the next baseline is honest."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak extra memory of this process and its children while the ``with`` block runs.

    This process: VmHWM after resetting it (exact, no sampling). Children (e.g. DCP's
    checkpoint daemon process): PSS sampled every ``period`` s, so memory they share with
    this process is not counted twice.
    """

    def __init__(self, period: float = 0.01) -> None:
        self.period = period
        self.base_self = 0
        self.base_children = 0
        self.peak_self = 0
        self.peak_children = 0
        self.exact = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _children_kb(self) -> int:
        return sum(_pss_kb(p) for p in descendants())

    def _sample(self) -> None:
        while not self._stop.wait(self.period):
            self.peak_children = max(self.peak_children, self._children_kb())
            self.peak_self = max(self.peak_self, _status_kb("self", "VmRSS"))

    def __enter__(self) -> PeakMemory:
        trim_heap()
        self.base_self = _status_kb("self", "VmRSS")
        self.base_children = self._children_kb()
        self.peak_self = self.base_self
        self.peak_children = self.base_children
        self.exact = _reset_peak()
        self._thread = threading.Thread(target=self._sample, name="bench-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.exact:
            self.peak_self = max(self.peak_self, _status_kb("self", "VmHWM"))
        self.peak_children = max(self.peak_children, self._children_kb())

    @property
    def extra_bytes(self) -> int:
        return 1024 * max(0, self.peak_self - self.base_self + self.peak_children - self.base_children)

    def to_json(self) -> dict[str, Any]:
        return {
            "extra_bytes": self.extra_bytes,
            "self_extra_bytes": 1024 * max(0, self.peak_self - self.base_self),
            "children_extra_bytes": 1024 * max(0, self.peak_children - self.base_children),
            "baseline_rss_bytes": 1024 * self.base_self,
            "exact_self_peak": self.exact,
        }


# ---------------------------------------------------------------------- training loop
class TrainStep:
    """A fixed compute step standing in for training: ``y = tanh(x @ w)`` with 512x1024x1024.

    On CUDA it runs on the device and synchronizes every step (so step times are real).
    """

    def __init__(self, device: str = "cpu", m: int = 512, k: int = 1024, n: int = 1024) -> None:
        gen = torch.Generator().manual_seed(1)
        self.device = torch.device(device)
        self.x = torch.empty(m, k).uniform_(-1, 1, generator=gen).to(self.device)
        self.w = torch.empty(k, n).uniform_(-0.05, 0.05, generator=gen).to(self.device)
        self.y = torch.empty(m, n, device=self.device)

    def __call__(self) -> None:
        torch.mm(self.x, self.w, out=self.y)
        self.y.tanh_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def run_steps(step: Callable[[], None], n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def interference_once(
    step: Callable[[], None],
    start_save: Callable[[], Any],
    is_done: Callable[[Any], bool],
    finish: Callable[[Any], None],
    baseline_steps: int = 30,
    max_s: float = 600.0,
) -> dict[str, Any]:
    """One save with training steps running in this thread until it is durable.

    ``start_save()`` blocks for the method's blocking part and returns a pending object;
    steps run while ``is_done(pending)`` is false; ``finish(pending)`` completes it (result,
    extra fsyncs) and is counted as blocking too. Returns the step-time baseline (median of
    ``baseline_steps`` steps right before and as many right after), the in-flight step
    times, and the training time lost: blocking + sum(in-flight step time - baseline).
    """
    run_steps(step, 3)
    before = run_steps(step, baseline_steps)
    t0 = time.perf_counter()
    pending = start_save()
    blocking = time.perf_counter() - t0
    in_flight: list[float] = []
    deadline = time.monotonic() + max_s
    while not is_done(pending) and time.monotonic() < deadline:
        s0 = time.perf_counter()
        step()
        in_flight.append(time.perf_counter() - s0)
    f0 = time.perf_counter()
    finish(pending)
    blocking += time.perf_counter() - f0
    wall = time.perf_counter() - t0
    # the baseline brackets the save (steps right before and right after) to cancel slow drift
    # of the machine's speed; on a shared machine single runs are still noisy
    after = run_steps(step, baseline_steps)
    base = statistics.median(before + after)
    extra = sum(in_flight) - base * len(in_flight)
    return {
        "baseline_step_s": base,
        "blocking_s": blocking,
        "in_flight_steps": len(in_flight),
        "in_flight_mean_step_s": statistics.fmean(in_flight) if in_flight else None,
        "slowdown": (statistics.fmean(in_flight) / base) if in_flight and base > 0 else None,
        "extra_step_s": extra,
        "lost_s": blocking + extra,
        "wall_s": wall,
        "baseline_before_s": statistics.median(before),
        "baseline_after_s": statistics.median(after),
    }


# ---------------------------------------------------------------------- small side-by-side scripts
def report_medians(
    what: str, samples: dict[str, list[float]], base: str, args: Any, out: str | None
) -> dict[str, Any]:
    """Print a markdown table of the medians of ``samples`` (seconds, in order), each against
    ``samples[base]``'s, and write ``results.json`` (machine, args, medians, ratios, samples)
    to ``out`` when given; returns that record."""
    import json
    import platform

    med = {k: statistics.median(v) for k, v in samples.items()}
    ratio = {k: v / med[base] for k, v in med.items()}
    print(f"| {what} | median s | × {base} |")
    print("|---|---|---|")
    for k in med:
        print(f"| {k} | {med[k]:.4f} | {ratio[k]:.2f}× |")
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "args": vars(args),
        "median_s": med,
        f"ratio_to_{base.replace(' ', '_')}": ratio,
        "samples_s": samples,
    }
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


class GcPasses:
    """Every pass of the cyclic garbage collector while installed: (start, end, generation).

    A collection runs under the GIL on one thread at a time, so a start is always followed by
    its own stop.
    """

    def __init__(self) -> None:
        self.passes: list[tuple[float, float, int]] = []
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._t0 = now
        else:
            self.passes.append((self._t0, now, int(info.get("generation", -1))))

    def __enter__(self) -> GcPasses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Passes that started in ``[t0, t1)``: how many, per generation, their total and longest time."""
        inside = [(b - a, g) for a, b, g in self.passes if t0 <= a < t1]
        by_gen = {str(g): sum(1 for _, x in inside if x == g) for g in (0, 1, 2)}
        return {
            "passes": len(inside),
            "full": by_gen["2"],
            "by_generation": by_gen,
            "total_s": sum(d for d, _ in inside),
            "max_s": max((d for d, _ in inside), default=0.0),
        }
