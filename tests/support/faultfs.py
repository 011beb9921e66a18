"""faultfs: a passthrough FUSE file system that injects faults, for tests through the real kernel.

Run it as a process::

    python tests/support/faultfs.py BACKING MOUNT RULES.json [--direct-io]

and drive it from a test with :class:`FaultFS` (mount, change rules at run time, unmount)::

    with FaultFS(backing, mount) as fs:
        fs.set_rules([rule("write", path="rank00000.safetensors", error="EIO", count=1)])
        ...
        assert fs.fired("...") == 1

Every call the kernel sends (getattr, mkdir, create, write, fsync, rename, ...) is passed
through to ``BACKING`` unless a rule matches it first. A rule (a JSON object) matches by

* ``op``: the operation name (``"write"``, ``"fsync"``, ``"rename"``, ``"mkdir"``,
  ``"getattr"``, ``"create"``, ``"open"``, ``"flush"``, ``"release"``, ``"unlink"``,
  ``"rmdir"``, ``"truncate"``, ``"fsyncdir"``, ``"readdir"``, ``"read"``), a list of them,
  or ``"*"``;
* ``path``: a substring, and/or ``glob``: an ``fnmatch`` pattern, of the path inside the
  mount (it starts with ``/``; a rename matches on either name);
* ``pid``: the caller's process id (the thread group of the thread that made the call,
  from ``fuse_get_context``);
* ``t0``/``t1``: a window of wall-clock time (``time.time()``) in which it is active;
* ``count``: it fires at most this many times (default: every time);
* ``skip``: the first this many calls that match otherwise pass through untouched (a read
  of a file's header, say, before its data).

and then does, in this order, what it names:

* ``delay_s``: sleep that long (a number, or ``[lo, hi]`` for uniformly random) first;
* ``hold_s``: block the call for up to that long, or until the rules change (any
  :meth:`FaultFS.set_rules`, ``clear()`` included): a call stuck in the kernel (a hung
  server) that the test can let go at its end, so no process stays unkillable;
* ``error``: fail the call with this errno (a name such as ``"EIO"``, or a number);
* ``short``: (write) write only this fraction of the data and say so (a short write),
  rounded down to a multiple of ``short_align`` bytes when that is set (then a write of
  one block or less is not shortened, as on a block device);
* ``stale_s``: (mkdir) create the directory on the backing store but answer ``EEXIST``,
  and make ``getattr`` of that path answer ``ENOENT`` for ``stale_s`` seconds: the
  signature of a stale negative-dentry / attribute cache on NFS, virtiofs or Lustre, where
  another client created the directory and this one cannot see it yet.

The rules file holds ``{"generation": N, "rules": [...]}``; it is re-read whenever it
changes (checked every 50 ms, and at each ``stat`` of the mount root), and the file
system acknowledges each generation it has loaded in ``RULES.json.ack``. Every firing is
appended as one JSON line to ``RULES.json.events``. The mount asks the kernel to cache nothing (``attr_timeout=0``,
``entry_timeout=0``, ``negative_timeout=0``), so each ``stat``/lookup reaches the rules.

This module imports only the standard library at the top: tests import it for the API
without needing the FUSE bindings (``mfusepy``); only the process that serves the mount
imports them.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import functools
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

#: Every skip reason of a test that needs what this module needs starts with this.
SKIP_PREFIX = "needs root/FUSE:"


# ---------------------------------------------------------------------------------------- rules
def rule(
    op: str | Sequence[str],
    *,
    path: str | None = None,
    glob: str | None = None,
    error: str | int | None = None,
    delay_s: float | tuple[float, float] | None = None,
    short: float | None = None,
    short_align: int | None = None,
    stale_s: float | None = None,
    hold_s: float | None = None,
    pid: int | None = None,
    count: int | None = None,
    skip: int | None = None,
    after_s: float | None = None,
    for_s: float | None = None,
    id: str | None = None,
) -> dict[str, Any]:
    """One rule as the file system reads it; ``after_s``/``for_s`` are from now."""
    r: dict[str, Any] = {"op": op if isinstance(op, str) else list(op)}
    for key, value in (
        ("path", path),
        ("glob", glob),
        ("error", error),
        ("short", short),
        ("short_align", short_align),
        ("stale_s", stale_s),
        ("hold_s", hold_s),
        ("pid", pid),
        ("count", count),
        ("skip", skip),
        ("id", id),
    ):
        if value is not None:
            r[key] = value
    if delay_s is not None:
        r["delay_s"] = list(delay_s) if isinstance(delay_s, (tuple, list)) else delay_s
    if error is not None and _errno_of(error) is None:
        raise ValueError(f"unknown errno {error!r}")
    if after_s is not None or for_s is not None:
        t0 = time.time() + (after_s or 0.0)
        r["t0"] = t0
        if for_s is not None:
            r["t1"] = t0 + for_s
    return r


def _errno_of(e: Any) -> int | None:
    if isinstance(e, int) and not isinstance(e, bool):
        return e
    if isinstance(e, str):
        v = getattr(errno, e, None)
        return v if isinstance(v, int) else None
    return None


# ------------------------------------------------------------------------------ availability
def unavailable_reason() -> str | None:
    """Why this machine cannot mount a faultfs (a skip reason), or ``None`` if it can."""
    if not sys.platform.startswith("linux"):
        return f"{SKIP_PREFIX} FUSE mounts need Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return f"{SKIP_PREFIX} mounting a FUSE file system here needs root (euid {os.geteuid()})"
    if not os.path.exists("/dev/fuse"):
        return f"{SKIP_PREFIX} /dev/fuse is missing (no FUSE in this kernel/container)"
    if importlib.util.find_spec("mfusepy") is None:
        return f"{SKIP_PREFIX} the Python FUSE bindings are missing (pip install mfusepy)"
    if _find_libfuse() is None:
        return f"{SKIP_PREFIX} libfuse is missing (apt-get install fuse3 libfuse3-3)"
    return None


def _find_libfuse() -> str | None:
    import ctypes.util

    # prefer libfuse3 (large writes, maintained); fall back to libfuse2
    return os.environ.get("FUSE_LIBRARY_PATH") or ctypes.util.find_library("fuse3") or ctypes.util.find_library("fuse")


def _mounted(mount: str) -> bool:
    """Whether ``mount`` is a FUSE mount point, from /proc/self/mountinfo (no file-system call)."""
    target = os.path.realpath(mount)
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return os.path.ismount(mount)
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5:
            continue
        point = _unescape(fields[4])
        if point == target and right.split()[:1] and right.split()[0].startswith("fuse"):
            return True
    return False


def _unescape(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 3 < len(s) and s[i + 1 : i + 4].isdigit():
            out.append(chr(int(s[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _quiet(cmd: list[str]) -> bool:
    """Run ``cmd``; whether it succeeded (a missing tool or a hang is a failure, not an error)."""
    if shutil.which(cmd[0]) is None:
        return False
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


class FaultFSUnavailable(RuntimeError):
    """The file system could not be mounted here; ``str()`` is a skip reason."""


# -------------------------------------------------------------------------------- the client
class FaultFS:
    """Mount a faultfs over ``backing`` at ``mount`` in a child process; change its rules.

    ``mount()`` raises :class:`FaultFSUnavailable` (its message starts with
    :data:`SKIP_PREFIX`) where FUSE cannot be used. ``unmount()`` always leaves no mount
    and no process behind (``umount``, then ``umount -l`` and a kill of the child).
    """

    def __init__(self, backing: str | os.PathLike[str], mount: str | os.PathLike[str], *, direct_io: bool = False):
        self.backing = os.path.abspath(os.fspath(backing))
        self.mount_point = os.path.abspath(os.fspath(mount))
        self.direct_io = direct_io
        state = Path(self.mount_point).parent / f".{Path(self.mount_point).name}.faultfs"
        self.state_dir = str(state)
        self.rules_path = os.path.join(self.state_dir, "rules.json")
        self.log_path = os.path.join(self.state_dir, "faultfs.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self._generation = 0

    # -- lifecycle
    def mount(self, timeout: float = 20.0) -> FaultFS:
        reason = unavailable_reason()
        if reason is not None:
            raise FaultFSUnavailable(reason)
        os.makedirs(self.backing, exist_ok=True)
        os.makedirs(self.mount_point, exist_ok=True)
        os.makedirs(self.state_dir, exist_ok=True)
        for stale in (".ack", ".events"):  # left by an earlier mount at this place
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.rules_path + stale)
        self._write_rules([])
        cmd = [sys.executable, os.path.abspath(__file__), self.backing, self.mount_point, self.rules_path]
        if self.direct_io:
            cmd.append("--direct-io")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        end = time.monotonic() + timeout
        while not _mounted(self.mount_point):
            if self.proc.poll() is not None:
                last = (self.log_tail().splitlines() or ["no output"])[-1]
                self.proc = None
                raise FaultFSUnavailable(f"{SKIP_PREFIX} mounting faultfs failed: {last} (log: {self.log_path})")
            if time.monotonic() > end:
                self.unmount()
                raise FaultFSUnavailable(f"{SKIP_PREFIX} faultfs did not mount within {timeout:.0f}s")
            time.sleep(0.02)
        try:
            self.set_rules([], timeout=max(1.0, end - time.monotonic()))  # it answers: it is serving
        except TimeoutError as e:
            self.unmount()
            raise FaultFSUnavailable(f"{SKIP_PREFIX} faultfs mounted but does not answer: {e}") from e
        return self

    def unmount(self) -> None:
        """Unmount and stop the server; idempotent, never raises, leaves nothing behind."""
        proc, self.proc = self.proc, None
        if _mounted(self.mount_point):
            for cmd in (["umount", self.mount_point], ["fusermount3", "-u", self.mount_point]):
                if _quiet(cmd):
                    break
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()  # our own child, by its pid
                proc.wait(timeout=10)
        if _mounted(self.mount_point):  # busy, or the server died: detach it
            _quiet(["umount", "-l", self.mount_point]) or _quiet(["fusermount3", "-uz", self.mount_point])

    def __enter__(self) -> FaultFS:
        return self.mount()

    def __exit__(self, *exc: object) -> None:
        self.unmount()

    def log_tail(self, n: int = 2000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:].strip()
        except OSError:
            return ""

    # -- rules
    def _write_rules(self, rules: Sequence[dict[str, Any]]) -> int:
        self._generation += 1
        tmp = f"{self.rules_path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"generation": self._generation, "rules": list(rules)}, f)
        os.replace(tmp, self.rules_path)  # atomic: the server never reads half a file
        return self._generation

    def set_rules(self, rules: Sequence[dict[str, Any]], timeout: float = 10.0) -> None:
        """Replace the rules and wait until the server has loaded them (counts restart)."""
        gen = self._write_rules(rules)
        end = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                os.stat(self.mount_point)  # any call makes the server look at the rules
            try:
                if int(Path(f"{self.rules_path}.ack").read_text() or -1) >= gen:
                    return
            except (OSError, ValueError):
                pass
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"faultfs exited: {self.log_tail()}")
            if time.monotonic() > end:
                raise TimeoutError(f"faultfs did not load rules generation {gen} within {timeout}s")
            time.sleep(0.01)

    def clear(self) -> None:
        self.set_rules([])

    def events(self) -> list[dict[str, Any]]:
        """Every firing so far: ``{"id", "op", "path", "pid", "t"}`` per line."""
        try:
            text = Path(f"{self.rules_path}.events").read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def fired(self, rule_id: str | None = None) -> int:
        return sum(1 for e in self.events() if rule_id is None or e["id"] == rule_id)

    def reset_events(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.truncate(f"{self.rules_path}.events", 0)

    def path(self, *parts: str) -> str:
        return os.path.join(self.mount_point, *parts)


@contextlib.contextmanager
def mounted(
    backing: str | os.PathLike[str], mount: str | os.PathLike[str], *, skip_unavailable: bool = False, **kw: Any
) -> Iterator[FaultFS]:
    """``with mounted(b, m) as fs:`` - :class:`FaultFS` as a context manager: mounted on entry,
    unmounted (nothing left behind) on exit.

    Where FUSE cannot mount it raises :class:`FaultFSUnavailable`; with
    ``skip_unavailable=True`` (in a test or a fixture) it skips the test instead, with that
    reason (it starts with :data:`SKIP_PREFIX`, which CI refuses to see skipped).
    """
    fs = FaultFS(backing, mount, **kw)
    try:
        fs.mount()
    except FaultFSUnavailable as e:
        if not skip_unavailable:
            raise
        import pytest  # only here: the file system's own process runs without pytest

        pytest.skip(str(e))
    try:
        yield fs
    finally:
        fs.unmount()


# -------------------------------------------------------------------------------- the server
class _Rules:
    """The current rule set, reloaded when the file changes; firing is thread-safe.

    The file is looked at every ``RECHECK_S`` and at every ``getattr`` of the mount root
    (which :meth:`FaultFS.set_rules` makes), so calls that no rule names cost next to nothing.
    """

    RECHECK_S = 0.05

    def __init__(self, path: str) -> None:
        self.path = path
        self._key: tuple[int, int, int] | None = None
        self._rules: list[dict[str, Any]] = []
        self._left: list[int | None] = []
        self._by_op: dict[str, list[int]] = {}
        self._star: list[int] = []
        self._next_check = 0.0
        self._lock = threading.Lock()
        self._events = open(f"{path}.events", "a", buffering=1)
        self._tgid: dict[int, int] = {}
        self.need_pid = False
        self.generation = 0  # of the rules file loaded last (hold_s waits for it to change)

    def _reload(self) -> None:
        self._next_check = time.monotonic() + self.RECHECK_S
        try:
            st = os.stat(self.path)
        except OSError:
            return
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self._key:
            return
        try:
            with open(self.path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return  # keep the old rules; the writer replaces the file atomically
        rules = list(doc.get("rules", []))
        by_op: dict[str, list[int]] = {}
        star: list[int] = []
        for i, r in enumerate(rules):
            r.setdefault("id", f"r{i}")
            ops = r.get("op", "*")
            for op in [ops] if isinstance(ops, str) else ops:
                (star if op == "*" else by_op.setdefault(op, [])).append(i)
            if "error" in r:
                r["_errno"] = _errno_of(r["error"])
        self._by_op = {op: sorted(set(ix + star)) for op, ix in by_op.items()}
        self._star = star
        self._rules = rules
        self._left = [r.get("count") for r in rules]
        self._skip = [r.get("skip") or 0 for r in rules]
        self.need_pid = any("pid" in r for r in rules)
        self._key = key
        self.generation = int(doc.get("generation", 0))
        tmp = f"{self.path}.ack.tmp"
        with open(tmp, "w") as f:
            f.write(str(doc.get("generation", 0)))
        os.replace(tmp, f"{self.path}.ack")

    def _caller(self) -> int:
        from mfusepy import fuse_get_context

        tid = int(fuse_get_context()[2])  # the calling thread; rules name processes
        if tid <= 0:
            return tid
        tgid = self._tgid.get(tid)
        if tgid is None:
            tgid = tid
            with contextlib.suppress(OSError, ValueError):
                with open(f"/proc/{tid}/status") as f:
                    for line in f:
                        if line.startswith("Tgid:"):
                            tgid = int(line.split()[1])
                            break
            if len(self._tgid) > 4096:
                self._tgid.clear()
            self._tgid[tid] = tgid
        return tgid

    def match(self, op: str, *paths: str) -> list[dict[str, Any]]:
        """The rules that fire for this call (their counts are used up here)."""
        if time.monotonic() >= self._next_check:
            self.poke()
        candidates = self._by_op.get(op, self._star)
        if not candidates:
            return []
        with self._lock:
            now = time.time()
            pid = self._caller() if self.need_pid else None
            fired = []
            for i in candidates:
                r = self._rules[i]
                if "path" in r and not any(r["path"] in p for p in paths):
                    continue
                if "glob" in r and not any(fnmatch.fnmatchcase(p, r["glob"]) for p in paths):
                    continue
                if "pid" in r and pid != r["pid"]:
                    continue
                if ("t0" in r and now < r["t0"]) or ("t1" in r and now >= r["t1"]):
                    continue
                if self._skip[i] > 0:
                    self._skip[i] -= 1
                    continue
                left = self._left[i]
                if left is not None:
                    if left <= 0:
                        continue
                    self._left[i] = left - 1
                fired.append(r)
                event = {"id": r["id"], "op": op, "path": paths[0], "pid": pid, "t": now}
                self._events.write(json.dumps(event) + "\n")
            return fired

    def poke(self) -> None:
        with self._lock:
            self._reload()

    def hold(self, seconds: float) -> None:
        """Block this call for ``seconds``, or until the rules change (``hold_s``)."""
        generation, end = self.generation, time.monotonic() + seconds
        while time.monotonic() < end and self.generation == generation:
            time.sleep(0.05)
            self.poke()


def _serve(backing: str, mount: str, rules_path: str, direct_io: bool) -> None:
    if "FUSE_LIBRARY_PATH" not in os.environ:
        lib = _find_libfuse()
        if lib:
            os.environ["FUSE_LIBRARY_PATH"] = lib
    import mfusepy
    from mfusepy import FuseOSError, Operations

    rules = _Rules(rules_path)
    hidden: dict[str, float] = {}
    hidden_lock = threading.Lock()
    o_direct = getattr(os, "O_DIRECT", 0)

    def real(path: str) -> str:
        return os.path.join(backing, path.lstrip("/"))

    def apply(op: str, *paths: str) -> dict[str, Any]:
        """Run the delays and errors of the rules that fire; return the other actions."""
        actions: dict[str, Any] = {}
        for r in rules.match(op, *paths):
            d = r.get("delay_s")
            if d:
                time.sleep(random.uniform(d[0], d[1]) if isinstance(d, list) else float(d))
            if r.get("hold_s"):
                rules.hold(float(r["hold_s"]))
            if r.get("_errno") is not None:
                raise FuseOSError(r["_errno"])
            for key in ("short", "short_align", "stale_s"):
                if key in r:
                    actions[key] = r[key]
        return actions

    def oserror(fn: Any) -> Any:
        # errors of the backing store reach the kernel as the same errno
        @functools.wraps(fn)  # keeps the signature: mfusepy looks at create()'s parameters
        def wrapped(*args: Any, **kw: Any) -> Any:
            try:
                return fn(*args, **kw)
            except FuseOSError:
                raise
            except OSError as e:
                raise FuseOSError(e.errno or errno.EIO) from e

        return wrapped

    class FaultOperations(Operations):  # type: ignore[misc]
        use_ns = True

        @oserror
        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            if path == "/":
                rules.poke()
            apply("getattr", path)
            with hidden_lock:
                until = hidden.get(path)
                if until is not None and until <= time.monotonic():
                    del hidden[path]
                    until = None
            if until is not None:
                raise FuseOSError(errno.ENOENT)  # the stale negative view
            st = os.fstat(fh) if fh is not None else os.lstat(real(path))
            return {
                "st_mode": st.st_mode,
                "st_ino": st.st_ino,
                "st_nlink": st.st_nlink,
                "st_size": st.st_size,
                "st_uid": st.st_uid,
                "st_gid": st.st_gid,
                "st_blocks": st.st_blocks,
                "st_blksize": st.st_blksize,
                "st_atime": st.st_atime_ns,
                "st_mtime": st.st_mtime_ns,
                "st_ctime": st.st_ctime_ns,
            }

        @oserror
        def readdir(self, path: str, fh: int) -> list[str]:
            apply("readdir", path)
            return [".", "..", *os.listdir(real(path))]

        @oserror
        def mkdir(self, path: str, mode: int) -> int:
            act = apply("mkdir", path)
            if "stale_s" in act:
                # another client won the race: the directory exists on the server ...
                with contextlib.suppress(FileExistsError):
                    os.mkdir(real(path), mode)
                with hidden_lock:  # ... but this client's view will not show it for a while
                    hidden[path] = max(hidden.get(path, 0.0), time.monotonic() + float(act["stale_s"]))
                raise FuseOSError(errno.EEXIST)
            os.mkdir(real(path), mode)
            return 0

        @oserror
        def rmdir(self, path: str) -> int:
            apply("rmdir", path)
            os.rmdir(real(path))
            return 0

        @oserror
        def unlink(self, path: str) -> int:
            apply("unlink", path)
            os.unlink(real(path))
            return 0

        @oserror
        def rename(self, old: str, new: str) -> int:
            apply("rename", new, old)
            os.rename(real(old), real(new))
            return 0

        @oserror
        def symlink(self, target: str, source: str) -> int:
            apply("symlink", target)
            os.symlink(source, real(target))
            return 0

        @oserror
        def readlink(self, path: str) -> str:
            apply("readlink", path)
            return os.readlink(real(path))

        @oserror
        def chmod(self, path: str, mode: int) -> int:
            apply("chmod", path)
            os.chmod(real(path), mode)
            return 0

        @oserror
        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            apply("utimens", path)
            if times is None:
                os.utime(real(path))
            else:
                os.utime(real(path), ns=(int(times[0]), int(times[1])))
            return 0

        @oserror
        def create(self, path: str, mode: int, flags: int) -> int:
            apply("create", path)
            # the kernel already dealt with O_DIRECT; the backing store gets ordinary I/O
            return os.open(real(path), (flags & ~o_direct) | os.O_CREAT | os.O_CLOEXEC, mode)

        @oserror
        def open(self, path: str, flags: int) -> int:
            apply("open", path)
            return os.open(real(path), (flags & ~(o_direct | os.O_CREAT | os.O_EXCL)) | os.O_CLOEXEC)

        @oserror
        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            apply("read", path)
            return os.pread(fh, size, offset)

        @oserror
        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            act = apply("write", path)
            if "short" in act and len(data) > 1:
                n = max(1, int(len(data) * float(act["short"])))
                align = int(act.get("short_align") or 0)
                if align:  # like a block device: whole blocks only, so a write of one block is never short
                    n = max(align, n - n % align)
                data = data[: min(n, len(data))] if align else data[: min(n, len(data) - 1)]
            return os.pwrite(fh, data, offset)

        @oserror
        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            apply("truncate", path)
            if fh is not None:
                os.ftruncate(fh, length)
            else:
                os.truncate(real(path), length)
            return 0

        @oserror
        def flush(self, path: str, fh: int) -> int:
            apply("flush", path)
            return 0

        @oserror
        def release(self, path: str, fh: int) -> int:
            try:
                apply("release", path)
            finally:
                os.close(fh)
            return 0

        @oserror
        def fsync(self, path: str, datasync: int, fh: int) -> int:
            apply("fsync", path)
            if datasync:
                os.fdatasync(fh)
            else:
                os.fsync(fh)
            return 0

        @oserror
        def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
            apply("fsyncdir", path)
            fd = os.open(real(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            return 0

        @oserror
        def statfs(self, path: str) -> dict[str, int]:
            apply("statfs", path)
            s = os.statvfs(real(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_frsize")
            return {k: getattr(s, k) for k in (*keys, "f_namemax")}

    options: dict[str, Any] = {
        "foreground": True,
        "nothreads": False,
        "fsname": "faultfs",
        "attr_timeout": 0,
        "entry_timeout": 0,
        "negative_timeout": 0,
        "hard_remove": True,  # unlink of an open file really unlinks (no .fuse_hidden files)
    }
    if mfusepy.fuse_version_major == 2:
        options["big_writes"] = True
        options["max_write"] = 1 << 20
    if direct_io:
        options["direct_io"] = True
    print(f"faultfs: libfuse {mfusepy.fuse_version_major}.{mfusepy.fuse_version_minor}, {backing} -> {mount}")
    sys.stdout.flush()
    mfusepy.FUSE(FaultOperations(), mount, **options)


def main(argv: Sequence[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    if len(args) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    _serve(os.path.abspath(args[0]), os.path.abspath(args[1]), os.path.abspath(args[2]), "--direct-io" in argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
