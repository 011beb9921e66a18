"""Power-loss crash states of a real save, enumerated in the style of ALICE / LevelDB's fault FS.

Three parts:

* :class:`RecordingOps` - an ``OsOps`` that performs every real call and logs the ones that
  change the disk (mkdir, create, open, write with the bytes written, ftruncate, fsync,
  fsync_dir, rename, unlink, rmdir). ``start()`` is a ``syncfs`` point: what is on disk then
  is durable (the *base*) and logging begins. ``drop=j`` is the test-only switch that logs
  the j-th fsync/fsync_dir after ``start()`` as ``dropped`` (it never happened as far as
  durability goes; the real call still runs).
* :func:`resolve` turns a path log into operations on inode ids, so a renamed directory
  keeps its contents and a ``fsync_dir`` of ``step_N`` is the same directory as the earlier
  ``step_N.tmp-*``.
* :func:`enumerate_states` / :func:`check_log` build every crash state after the first k
  operations, for every k, materialize each into a real directory and check it with the
  library.

The crash model (conservative, per operation):

* file data: a file is at its content as of its last ``fsync`` (or the base), or at
  everything written, or written-size-but-unsynced-bytes-zero (metadata without data);
  each file independently.
* namespace: mkdir/create/rename/unlink/rmdir are durable once a later ``fsync_dir`` of
  every parent directory they touch happened; until then each may independently be lost
  (every subset, applied in log order; a rename whose source is gone, a link whose name is
  taken, an rmdir of a non-empty directory are skipped). A rename is atomic. Directory
  inodes exist whether or not their link survives: entries of an unreachable directory are
  *leaked* (no clean-up can find them).

Properties of each state (``committed`` = the index after the commit's ``fsync_dir(root)``):

* ``no-checkpoint``: ``find_latest`` is ``None`` although step 1 was durable;
* ``latest-broken``: ``find_latest`` names a step that does not load (verify=True) to
  exactly what was saved at it, or a step never saved;
* ``committed-lost``: at a crash point at or after ``committed``, the latest is not the new
  step (the commit was durable and reported, and vanished);
* ``broken-committed-name``: a directory with a committed name (``step_N``) is present but
  does not load exactly (a half-deleted checkpoint left under a name clean-up never removes);
* ``leaked``: durable entries in a directory no path reaches (an attempt clean-up cannot find).

The first three are the library's core promises; the last two are the stricter properties
of ``test_crash_loop.py`` (every ``step_N`` directory loads) and of ``_commit.py`` ("fsync
the root so the attempt is findable after a crash").

Run as ``python crashsim.py RANK WORLD PORT ROOT OUT`` it is one rank of a real gloo run
that records its log to ``OUT.RANK.json`` (see :func:`record_ranks`).
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncckpt import Checkpointer, CheckpointError, find_latest, load
from asyncckpt.format._layout import parse_step_dir, step_dir_name
from asyncckpt.roots.posix._osops import OsOps

#: kinds that change the namespace, carry data, or are durability barriers
NAMESPACE = ("mkdir", "create", "rename", "unlink", "rmdir")
DATA = ("write", "ftruncate")
BARRIERS = ("fsync", "fsync_dir")
#: bounds on the enumeration at one crash point (beyond them subsets are sampled)
MAX_NS_SUBSETS = 256
MAX_DATA_COMBOS = 81


# --------------------------------------------------------------------------- states saved


def single_state(step: int) -> dict[str, Any]:
    """A small state with several tensors and dtypes; odd sizes so O_DIRECT needs ftruncate."""
    g = torch.Generator().manual_seed(7000 + step)
    return {
        "model": {f"layer{i}.weight": torch.randn(250 + 3 * i, generator=g) for i in range(4)},
        "model_half": torch.randn(33, generator=g).to(torch.bfloat16),
        "optimizer": {"state": {0: {"exp_avg": torch.randn(17, generator=g), "step": torch.tensor(float(step))}}},
        "counts": torch.arange(step, step + 11, dtype=torch.int64),
        "extra": {"step": step, "tag": f"s{step}", "lr": 0.1 / step, "blob": bytes([step]) * 5},
    }


def rank_state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(9000 + 100 * step + rank)
    return {
        "model": {"w": torch.randn(300 + rank, generator=g), "b": torch.randn(7, generator=g)},
        "extra": {"rank": rank, "step": step},
    }


def same(a: Any, b: Any) -> bool:
    """Exact equality of loaded states (container and key types, dtypes, shapes, bytes)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        if [(type(k), k) for k in a] != [(type(k), k) for k in b]:
            return False
        return all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


# --------------------------------------------------------------------------- the recorder


@dataclass(frozen=True)
class Op:
    """One logged operation. ``handle`` names the open file (fds are reused)."""

    kind: str
    path: str
    dst: str = ""
    offset: int = 0
    data: bytes = b""
    length: int = 0
    handle: str = ""
    was: str = ""  # for a dropped barrier: what it was
    t: int = 0  # CLOCK_MONOTONIC ns when the call returned (orders the logs of several ranks)
    who: str = ""  # the recorder's tag (the rank of a multi-process run)

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("kind", "path", "dst", "offset", "length", "handle", "was", "t", "who")}
        d["data"] = base64.b64encode(self.data).decode()
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> Op:
        return Op(**{**d, "data": base64.b64decode(d["data"])})

    def label(self, root: str) -> str:
        p = os.path.relpath(self.path, root)
        who = f" [{self.who}]" if self.who else ""
        if self.kind == "rename":
            return f"rename({p} -> {os.path.relpath(self.dst, root)}){who}"
        if self.kind == "write":
            return f"write({p}, @{self.offset}, {len(self.data)} B){who}"
        return (f"{self.kind}({p})" if not self.was else f"dropped {self.was}({p})") + who


class RecordingOps(OsOps):
    """Performs the real calls and logs, after ``start()``, each one that changes the disk."""

    def __init__(self, drop: int | None = None, tag: str = "") -> None:
        self.log: list[Op] = []
        self.base: dict[str, bytes | None] = {}
        self.root = ""
        self.drop = drop
        self._tag = tag
        self._recording = False
        self._barriers = 0
        self._opens = 0
        self._fds: dict[int, tuple[str, str]] = {}
        self._dirs: dict[int, str] = {}
        self._lock = threading.Lock()

    def start(self, root: str) -> None:
        """A syncfs point: everything under ``root`` now is durable; log from here on."""
        with self._lock:
            self.root = os.path.abspath(root)
            self.base = snapshot(self.root)
            self._recording = True

    def stop(self) -> None:
        with self._lock:
            self._recording = False

    def _add(self, op: Op) -> None:
        with self._lock:
            if not self._recording:
                return
            if op.kind in BARRIERS:
                if self._barriers == self.drop:
                    op = Op("dropped", op.path, was=op.kind, handle=op.handle)
                self._barriers += 1
            self.log.append(Op(**{**op.__dict__, "t": time.monotonic_ns(), "who": self._tag}))

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        super().mkdir(path, mode)
        self._add(Op("mkdir", os.path.abspath(path)))

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        path = os.path.abspath(path)
        creates = bool(flags & os.O_CREAT) and (bool(flags & os.O_EXCL) or not os.path.lexists(path))
        fd = super().open(path, flags, mode)
        with self._lock:
            self._opens += 1
            handle = f"{self._tag}.{self._opens}"
            self._fds[fd] = (path, handle)
        self._add(Op("create" if creates else "open", path, handle=handle))
        if flags & os.O_TRUNC and not creates:
            self._add(Op("ftruncate", path, length=0, handle=handle))
        return fd

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        n = super().pwrite(fd, data, offset)
        path, handle = self._fds[fd]
        self._add(Op("write", path, offset=offset, data=bytes(memoryview(data)[:n]), handle=handle))
        return n

    def ftruncate(self, fd: int, length: int) -> None:
        super().ftruncate(fd, length)
        path, handle = self._fds[fd]
        self._add(Op("ftruncate", path, length=length, handle=handle))

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        path, handle = self._fds[fd]
        self._add(Op("fsync", path, handle=handle))

    def close(self, fd: int) -> None:
        with self._lock:
            self._fds.pop(fd, None)
        super().close(fd)

    def rename(self, src: str, dst: str) -> None:
        super().rename(src, dst)
        self._add(Op("rename", os.path.abspath(src), dst=os.path.abspath(dst)))

    def unlink(self, path: str) -> None:
        super().unlink(path)
        self._add(Op("unlink", os.path.abspath(path)))

    def rmdir(self, path: str) -> None:
        super().rmdir(path)
        self._add(Op("rmdir", os.path.abspath(path)))

    def fsync_dir(self, path: str) -> None:
        super().fsync_dir(path)
        self._add(Op("fsync_dir", os.path.abspath(path)))

    # tree removal works by directory descriptor: map each one back to its path for the log
    def open_dir(self, name: str, dir_fd: int | None = None) -> int:
        fd = super().open_dir(name, dir_fd)
        with self._lock:
            self._dirs[fd] = os.path.abspath(name) if dir_fd is None else os.path.join(self._dirs[dir_fd], name)
        return fd

    def close_dir(self, fd: int) -> None:
        with self._lock:
            self._dirs.pop(fd, None)
        super().close_dir(fd)

    def unlink_at(self, dir_fd: int, name: str) -> None:
        super().unlink_at(dir_fd, name)
        self._add(Op("unlink", os.path.join(self._dirs[dir_fd], name)))

    def rmdir_at(self, dir_fd: int, name: str) -> None:
        super().rmdir_at(dir_fd, name)
        self._add(Op("rmdir", os.path.join(self._dirs[dir_fd], name)))


def without_barrier(log: list[Op], j: int) -> list[Op]:
    """``log`` with its j-th fsync/fsync_dir turned into ``dropped`` (the recorder's switch, after the fact)."""
    out, n = [], 0
    for op in log:
        if op.kind in BARRIERS:
            if n == j:
                op = Op("dropped", op.path, was=op.kind, handle=op.handle, t=op.t, who=op.who)
            n += 1
        out.append(op)
    return out


def barrier_labels(log: list[Op], root: str) -> list[str]:
    """A stable name for each fsync/fsync_dir of a log: the file or directory, the attempt id hidden."""
    out: list[str] = []
    seen: Counter[str] = Counter()
    for op in log:
        kind = op.was or op.kind
        if kind not in BARRIERS:
            continue
        rel = os.path.relpath(op.path, root)
        rel = "root" if rel == "." else rel.split(".tmp-")[0] + ".tmp" if ".tmp-" in rel else rel
        if kind == "fsync":
            rel = os.path.basename(op.path)
        name = f"{kind}({rel})" + (f"[{op.who}]" if op.who else "")
        seen[name] += 1
        out.append(f"{name}#{seen[name]}")
    return out


def snapshot(root: str) -> dict[str, bytes | None]:
    """Relative path -> file bytes, or None for a directory ('.' is the root)."""
    out: dict[str, bytes | None] = {".": None}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            out[os.path.relpath(os.path.join(dirpath, f), root)] = Path(dirpath, f).read_bytes()
    return out


# --------------------------------------------------------------------------- recording real saves


@dataclass
class Recording:
    """A recorded save of step ``new`` on top of durable step ``old``."""

    root: str
    base: dict[str, bytes | None]
    log: list[Op]
    expected: dict[int, list[Any]]  # step -> the state of each rank
    old: int = 1
    new: int = 2

    @property
    def world(self) -> int:
        return len(self.expected[self.new])

    def committed_at(self) -> int:
        """Index after the commit's fsync_dir(root), i.e. when the commit was durable and reported."""
        final = os.path.join(self.root, step_dir_name(self.new))
        renamed = next(i for i, op in enumerate(self.log) if op.kind == "rename" and op.dst == final)
        for i in range(renamed + 1, len(self.log)):
            op = self.log[i]
            if (op.was or op.kind) == "fsync_dir" and op.path == self.root:
                return i + 1
        raise AssertionError("no fsync_dir(root) after the commit rename")


def record_single(root: Path, drop: int | None = None) -> Recording:
    """Save steps 1 and 2 with ``keep_last=1`` in this process; log step 2 after a syncfs point."""
    ops = RecordingOps(drop=drop)
    with Checkpointer(root, keep_last=1, os_ops=ops, timeout=60) as ck:
        ck.save(1, single_state(1)).result(timeout=60)
        os.sync()
        ops.start(str(root))
        ck.save(2, single_state(2)).result(timeout=60)
        ck.flush(60)  # the retired step's files are removed after the save settles
        ops.stop()
    return Recording(ops.root, ops.base, ops.log, {1: [single_state(1)], 2: [single_state(2)]})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def record_ranks(workdir: Path, world: int = 2, deadline: float = 100.0) -> Recording:
    """Run ``world`` real ranks (gloo, localhost) saving steps 1 and 2; merge their step-2 logs by time."""
    root, out = workdir / "ck", workdir / "log"
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    args = [str(world), str(port), str(root), str(out)]
    outs = [open(workdir / f"rank{r}.out", "wb") for r in range(world)]
    procs = [
        subprocess.Popen([sys.executable, __file__, str(r), *args], env=env, stdout=outs[r], stderr=subprocess.STDOUT)
        for r in range(world)
    ]
    end = time.monotonic() + deadline
    try:
        for p in procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in outs:
            f.close()
    logs, base = [], None
    for r in range(world):
        f = Path(f"{out}.{r}.json")
        if procs[r].returncode != 0 or not f.exists():
            text = (workdir / f"rank{r}.out").read_text(errors="replace")[-3000:]
            raise AssertionError(f"rank {r} exited with {procs[r].returncode}:\n{text}")
        doc = json.loads(f.read_text())
        logs.append([Op.from_json(d) for d in doc["log"]])
        if r == 0:
            base = {k: (None if v is None else base64.b64decode(v)) for k, v in doc["base"].items()}
    assert base is not None
    merged = sorted((op for lg in logs for op in lg), key=lambda op: op.t)
    expected = {s: [rank_state(r, s) for r in range(world)] for s in (1, 2)}
    return Recording(str(root.resolve()), base, merged, expected)


def _rank_main(argv: list[str]) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    rank, world, port, root, out = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    ops = RecordingOps(tag=f"r{rank}")
    with Checkpointer(root, keep_last=1, os_ops=ops, timeout=60) as ck:
        ck.save(1, rank_state(rank, 1)).result(timeout=60)
        dist.barrier()
        os.sync()
        ops.start(root)  # every rank, before any of them starts step 2
        dist.barrier()
        ck.save(2, rank_state(rank, 2)).result(timeout=60)
        ck.flush(60)  # the retired step's files are removed after the save settles
        dist.barrier()  # rank 0 has applied retention too
        ops.stop()
        dist.barrier()
    base = {k: (None if v is None else base64.b64encode(v).decode()) for k, v in ops.base.items()}
    Path(f"{out}.{rank}.json").write_text(json.dumps({"log": [op.to_json() for op in ops.log], "base": base}))
    dist.destroy_process_group()


# --------------------------------------------------------------------------- resolving to inodes


@dataclass(frozen=True)
class ROp:
    """An operation on inode ids. Namespace: ``parent``/``name`` (and ``dparent``/``dname`` for
    rename) and ``node``; data: ``node`` with ``offset``/``data``/``length``; barriers: ``node``."""

    kind: str
    node: int
    parent: int = -1
    name: str = ""
    dparent: int = -1
    dname: str = ""
    offset: int = 0
    data: bytes = b""
    length: int = 0

    @property
    def parents(self) -> tuple[int, ...]:
        return (self.parent, self.dparent) if self.kind == "rename" else (self.parent,)


@dataclass
class Model:
    dirs: dict[int, dict[str, int]]  # base entries of every base directory
    files: dict[int, bytes]  # base content of every base file
    new_dirs: set[int]  # directory inodes the log creates
    ops: list[ROp]
    root: int = 0


def resolve(root: str, base: dict[str, bytes | None], log: list[Op]) -> Model:
    """Map the path log onto inode ids, following renames of directories."""
    ids: dict[str, int] = {}
    dirs: dict[int, dict[str, int]] = {}
    files: dict[int, bytes] = {}
    counter = itertools.count()
    for rel in sorted(base, key=lambda p: (0 if p == "." else p.count("/") + 1, p)):
        node = next(counter)
        path = root if rel == "." else os.path.join(root, rel)
        ids[path] = node
        content = base[rel]
        if content is None:
            dirs[node] = {}
        else:
            files[node] = content
        if rel != ".":
            dirs[ids[os.path.dirname(path)]][os.path.basename(path)] = node
    handles: dict[str, int] = {}
    new_dirs: set[int] = set()
    ops: list[ROp] = []

    def split(path: str) -> tuple[int, str]:
        return ids[os.path.dirname(path)], os.path.basename(path)

    for op in log:
        if op.kind in ("mkdir", "create"):
            parent, name = split(op.path)
            node = next(counter)
            ids[op.path] = node
            if op.kind == "mkdir":
                new_dirs.add(node)
            else:
                handles[op.handle] = node
            ops.append(ROp(op.kind, node, parent, name))
        elif op.kind == "open":
            handles[op.handle] = ids[op.path]
        elif op.kind == "rename":
            node = ids[op.path]
            (parent, name), (dparent, dname) = split(op.path), split(op.dst)
            for p in [p for p in ids if p == op.dst or p.startswith(op.dst + "/")]:
                del ids[p]
            for p in [p for p in ids if p == op.path or p.startswith(op.path + "/")]:
                ids[op.dst + p[len(op.path) :]] = ids.pop(p)
            ops.append(ROp("rename", node, parent, name, dparent, dname))
        elif op.kind in ("unlink", "rmdir"):
            parent, name = split(op.path)
            ops.append(ROp(op.kind, ids.pop(op.path), parent, name))
        elif op.kind == "write":
            ops.append(ROp("write", handles[op.handle], offset=op.offset, data=op.data))
        elif op.kind == "ftruncate":
            ops.append(ROp("ftruncate", handles[op.handle], length=op.length))
        elif op.kind == "fsync":
            ops.append(ROp("fsync", handles[op.handle]))
        elif op.kind == "fsync_dir":
            ops.append(ROp("fsync_dir", ids[op.path]))
        elif op.kind == "dropped":
            ops.append(ROp("dropped", -1))
        else:
            raise AssertionError(f"unknown op {op.kind}")
    return Model(dirs, files, new_dirs, ops)


# --------------------------------------------------------------------------- crash states


def _apply_data(content: bytes, op: ROp) -> bytes:
    if op.kind == "write":
        if len(content) < op.offset:
            content += bytes(op.offset - len(content))
        return content[: op.offset] + op.data + content[op.offset + len(op.data) :]
    if len(content) >= op.length:
        return content[: op.length]
    return content + bytes(op.length - len(content))


def _apply_ns(dirs: dict[int, dict[str, int]], op: ROp) -> None:
    entries = dirs[op.parent]
    if op.kind in ("mkdir", "create"):
        if op.name not in entries:
            entries[op.name] = op.node
    elif op.kind == "rename":
        if entries.get(op.name) != op.node:
            return  # the source is gone (an earlier op was lost)
        target = dirs[op.dparent]
        old = target.get(op.dname)
        if old is not None and old != op.node and dirs.get(old):
            return  # cannot replace a non-empty directory
        del entries[op.name]
        target[op.dname] = op.node
    elif op.kind == "unlink":
        if entries.get(op.name) == op.node:
            del entries[op.name]
    elif op.kind == "rmdir":
        if entries.get(op.name) == op.node and not dirs[op.node]:
            del entries[op.name]


def _subsets(n: int, cap: int, rng: random.Random) -> list[tuple[bool, ...]]:
    """Which of ``n`` pending operations survive: every combination, or a sample of ``cap``."""
    if 2**n <= cap:
        return list(itertools.product((False, True), repeat=n))
    picks = {tuple([True] * n), tuple([False] * n)}
    for i in range(n):
        picks.add(tuple(j != i for j in range(n)))
        picks.add(tuple(j == i for j in range(n)))
    while len(picks) < cap:
        picks.add(tuple(rng.random() < 0.5 for _ in range(n)))
    return sorted(picks)


Tree = tuple[tuple[str, bytes | None], ...]


@dataclass
class CrashState:
    k: int  # crash after the first k operations
    tree: Tree  # what the root holds: relative path -> bytes, or None for a directory
    leaked: tuple[str, ...]  # names in unreachable directories


@dataclass
class Stats:
    capped_points: int = 0


def enumerate_states(model: Model, stats: Stats | None = None, seed: int = 0) -> Iterator[CrashState]:
    """Every crash state at every crash point k = 0..len(ops) under the model in the module docstring."""
    rng = random.Random(seed)
    stats = stats if stats is not None else Stats()
    ops = model.ops
    # the index of the barrier that makes each namespace op durable (len(ops) if none does)
    durable_by: dict[int, int] = {}
    for i, op in enumerate(ops):
        if op.kind in NAMESPACE:
            need = set(op.parents)
            j = i + 1
            while j < len(ops) and need:
                if ops[j].kind == "fsync_dir":
                    need.discard(ops[j].node)
                j += 1
            durable_by[i] = j - 1 if not need else len(ops)
    current = dict(model.files)
    durable = dict(model.files)
    for k in range(len(ops) + 1):
        if k:
            op = ops[k - 1]
            if op.kind in ("create",):
                current[op.node] = durable[op.node] = b""
            elif op.kind in DATA:
                current[op.node] = _apply_data(current[op.node], op)
            elif op.kind == "fsync":
                durable[op.node] = current[op.node]
        pending = [i for i in range(k) if ops[i].kind in NAMESPACE and durable_by[i] >= k]
        choices = _subsets(len(pending), MAX_NS_SUBSETS, rng)
        if len(choices) < 2 ** len(pending):
            stats.capped_points += 1
        for keep in choices:
            lost = {i for i, kept in zip(pending, keep, strict=True) if not kept}
            dirs = {d: dict(e) for d, e in model.dirs.items()}
            for d in model.new_dirs:
                dirs[d] = {}
            for i in range(k):
                if ops[i].kind in NAMESPACE and i not in lost:
                    _apply_ns(dirs, ops[i])
            yield from _data_variants(model, k, dirs, current, durable, rng, stats)


def _walk(dirs: dict[int, dict[str, int]], node: int, prefix: str, out: list[tuple[str, int]]) -> None:
    for name, child in sorted(dirs[node].items()):
        rel = f"{prefix}{name}"
        out.append((rel, child))
        if child in dirs:
            _walk(dirs, child, rel + "/", out)


def _data_variants(
    model: Model,
    k: int,
    dirs: dict[int, dict[str, int]],
    current: dict[int, bytes],
    durable: dict[int, bytes],
    rng: random.Random,
    stats: Stats,
) -> Iterator[CrashState]:
    entries: list[tuple[str, int]] = []
    _walk(dirs, model.root, "", entries)
    reachable = {model.root} | {n for _, n in entries}
    leaked = tuple(sorted(f"<dir {d}>/{name}" for d, e in dirs.items() if d not in reachable for name in e))
    files = sorted({n for _, n in entries if n not in dirs})
    options: dict[int, list[bytes]] = {}
    for f in files:
        synced, written = durable[f], current[f]
        variants = [synced]
        if written != synced:
            variants.append(written)
            zeroed = synced[: len(written)] + bytes(max(0, len(written) - len(synced)))
            if zeroed not in variants:
                variants.append(zeroed)
        options[f] = variants
    multi = [f for f in files if len(options[f]) > 1]
    combos = list(itertools.product(*(range(len(options[f])) for f in multi)))
    if len(combos) > MAX_DATA_COMBOS:
        stats.capped_points += 1
        combos = [combos[0], combos[-1], *rng.sample(combos[1:-1], MAX_DATA_COMBOS - 2)]
    for combo in combos:
        chosen = dict(zip(multi, combo, strict=True))
        tree = tuple((rel, None if n in dirs else options[n][chosen.get(n, 0)]) for rel, n in entries)
        yield CrashState(k, tree, leaked)


# --------------------------------------------------------------------------- checking states


@dataclass(frozen=True)
class Verdict:
    latest: int | None
    latest_ok: bool
    committed_names: tuple[tuple[int, bool], ...]  # (step, loads exactly) for each step_N present
    error: str = ""


def materialize(tree: Tree, where: Path) -> None:
    where.mkdir()
    for rel, content in tree:
        p = where / rel
        if content is None:
            p.mkdir()
        else:
            p.write_bytes(content)


def check_tree(tree: Tree, where: Path, expected: dict[int, list[Any]]) -> Verdict:
    """Materialize ``tree`` at ``where`` and ask the library what it finds there."""
    materialize(tree, where)
    try:
        info = find_latest(where)
        latest = None if info is None else info.step
        results: dict[int, bool] = {}
        errors = []
        for name in sorted(os.listdir(where)):
            step = parse_step_dir(name)
            if step is None or name != step_dir_name(step):
                continue
            ok = step in expected
            for rank, want in enumerate(expected.get(step, [])):
                try:
                    ok = ok and same(load(where, step, rank=rank, verify=True), want)
                except CheckpointError as e:
                    ok = False
                    errors.append(f"{name}: {type(e).__name__}: {e}")
            results[step] = ok
        latest_ok = latest is not None and results.get(latest, False)
        return Verdict(latest, latest_ok, tuple(sorted(results.items())), "; ".join(errors))
    finally:
        shutil.rmtree(where)


@dataclass
class Report:
    """What an enumeration found."""

    label: str = ""
    ops: int = 0
    crash_points: int = 0
    states: int = 0
    materialized: int = 0
    capped_points: int = 0
    violations: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.violations.values())

    def line(self) -> str:
        v = ", ".join(f"{k}={n}" for k, n in sorted(self.violations.items())) or "none"
        return (
            f"{self.label}: {self.ops} ops, {self.crash_points} crash points, {self.states} states "
            f"({self.materialized} newly materialized), {self.capped_points} capped points; violations: {v}"
        )


def check_log(rec: Recording, scratch: Path, label: str = "", log: list[Op] | None = None,
              cache: dict[Tree, Verdict] | None = None, max_examples: int = 5) -> Report:  # fmt: skip
    """Enumerate and check every crash state of ``rec`` (or of ``log``, a variant of its log)."""
    log = rec.log if log is None else log
    model = resolve(rec.root, rec.base, log)
    committed = Recording(rec.root, rec.base, log, rec.expected, rec.old, rec.new).committed_at()
    cache = {} if cache is None else cache
    stats = Stats()
    report = Report(label=label, ops=len(log), crash_points=len(log) + 1)
    scratch.mkdir(parents=True, exist_ok=True)
    counter = itertools.count()
    for state in enumerate_states(model, stats):
        report.states += 1
        verdict = cache.get(state.tree)
        if verdict is None:
            verdict = check_tree(state.tree, scratch / f"s{next(counter)}", rec.expected)
            cache[state.tree] = verdict
            report.materialized += 1
        found = []
        if verdict.latest is None:
            found.append("no-checkpoint")
        elif not verdict.latest_ok:
            found.append("latest-broken")
        if state.k >= committed and verdict.latest != rec.new:
            found.append("committed-lost")
        if not all(ok for _, ok in verdict.committed_names):
            found.append("broken-committed-name")
        if state.leaked:
            found.append("leaked")
        for v in found:
            report.violations[v] += 1
        if found and len(report.examples) < max_examples:
            after = log[state.k - 1].label(rec.root) if state.k else "<start>"
            names = [rel for rel, _ in state.tree if "/" not in rel]
            report.examples.append(
                f"{'+'.join(found)} at k={state.k} (after {after}): root holds {names}, latest={verdict.latest}, "
                f"committed names {list(verdict.committed_names)}, leaked {list(state.leaked)} {verdict.error}"
            )
    report.capped_points = stats.capped_points
    return report


def describe_log(rec: Recording, log: list[Op] | None = None) -> str:
    return "\n".join(f"  {i:3d} {op.label(rec.root)}" for i, op in enumerate(rec.log if log is None else log))


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
