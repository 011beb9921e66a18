"""The memory tier of node-local roots (``memory=``): 2 nodes x 2 ranks, real processes.

Each rank runs in a private mount namespace with its node's disk directory bind-mounted at the
job's root and its node's directory on /dev/shm (tmpfs) bind-mounted at the memory tier's one
path (``_node_worker``); ranks 0-1 are node "a", ranks 2-3 node "b". "Killed" runs end every
process with ``os._exit`` after ``flush()``: no close. Needs root (mount namespaces).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _ranks import free_port, log_tail, rank_results, run_ranks

from asyncckpt import Checkpointer, CheckpointError, RootInUseError
from asyncckpt.roots.posix._ownership import Ownership
from asyncckpt.saving._memtier import fs_type, start_memory
from asyncckpt.saving._memwrite import MemoryWrite

WORKER = str(Path(__file__).parent / "support" / "_node_worker.py")
FROM_MEMORY = "from its node's memory tier"
FROM_DISK = "from its node's disk"


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory on /dev/shm (tmpfs) for this test, removed after it."""
    d = Path("/dev/shm") / f"asyncckpt-test-{uuid.uuid4().hex[:12]}"
    d.mkdir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip(f"needs root/mount namespaces: bind mounts in a private mount namespace (euid {os.geteuid()})")


class Cluster:
    """Two simulated nodes: disks ``a``/``b`` under ``tmp``, memory ``ma``/``mb`` on /dev/shm."""

    def __init__(self, tmp: Path, shm: Path) -> None:
        self.tmp, self.shm = tmp, shm
        self.a, self.b = tmp / "nodeA", tmp / "nodeB"
        self.ma, self.mb = shm / "memA", shm / "memB"
        self.mount, self.mem = tmp / "ck", shm / "mem"  # the one path of each tier on every node
        for d in (self.a, self.b, self.ma, self.mb, self.mount, self.mem):
            d.mkdir()

    def run(self, tag: str, **env: str) -> tuple[dict[int, dict[str, Any]], list[str]]:
        out, logs = self.tmp / f"{tag}-result", self.tmp / tag
        logs.mkdir()
        port = free_port()
        disks = ":".join(map(str, [self.a, self.a, self.b, self.b]))
        mems = ":".join(map(str, [self.ma, self.ma, self.mb, self.mb]))
        hung = run_ranks(
            lambda r: [WORKER, "run", str(r), "4", str(port), str(self.mount), str(out)], 4, logs, 150,
            extra_env={"NODE_DIRS": disks, "NODE_NAMES": "a:a:b:b", "HOST_STORE_S": "30", "MEMORY": str(self.mem),
                       "MEMORY_DIRS": mems, **env},
        )  # fmt: skip
        res = rank_results(out, logs, hung, 4)
        assert os.listdir(self.mount) == [] and os.listdir(self.mem) == []  # the mounts stayed in the namespaces
        return res, [(logs / f"rank{r}.log").read_text(errors="replace") for r in range(4)]

    def save(self, tag: str, steps: list[int], **env: str) -> tuple[dict[int, dict[str, Any]], list[str]]:
        """:meth:`run` saving ``steps``: every rank must have saved them all and flushed."""
        res, logs = self.run(tag, STEPS=",".join(map(str, steps)), **env)
        for r, got in res.items():
            assert got["saved"] == steps and got.get("flush_error") is None, (r, got)
        return res, logs


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "20k") -> Iterator[None]:
    """A tmpfs of ``size`` mounted on ``path`` while the block runs (a node's memory that fills up)."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=False)


@pytest.fixture
def cluster(tmp_path: Path, shm: Path) -> Cluster:
    """A :class:`Cluster` for a test of 4 real ranks (needs root: mount namespaces)."""
    _needs_root()
    return Cluster(tmp_path, shm)


def _steps(d: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in d.iterdir() if p.name.startswith("step_") and p.name[5:].isdigit())


def _files(d: Path, step: int) -> set[str]:
    return {x.name for x in (d / f"step_{step:08d}").iterdir()}


def _resumed(res: dict[int, dict[str, Any]], step: int) -> None:
    for r, got in res.items():
        assert got.get("load_error") is None, (r, got["load_error"])
        assert got["loaded"] == step and got["equal"], (r, got)


@pytest.mark.needs_root
@pytest.mark.slow  # four runs of 4 ranks
@pytest.mark.timeout(600)
def test_killed_nodes_resume_from_memory_and_a_corrupt_or_wiped_memory_copy_falls_back_to_the_same_step(
    tmp_path: Path, cluster: Cluster
) -> None:
    c = cluster
    c.save("first", [1, 2, 3], KEEP_LAST="2", KILL_AFTER_FLUSH="1")
    # each node's memory tier: the newest step only (memory_keep_last=1), its own ranks' files,
    # the disk step's very manifest (one attempt in both tiers)
    assert _steps(c.ma) == [3] and _steps(c.mb) == [3]
    assert _files(c.ma, 3) == {"manifest.json", "rank00000.safetensors", "rank00000.json",
                               "rank00001.safetensors", "rank00001.json"}  # fmt: skip
    assert _files(c.mb, 3) == {"manifest.json", "rank00002.safetensors", "rank00002.json",
                               "rank00003.safetensors", "rank00003.json"}  # fmt: skip
    for disk, mem in ((c.a, c.ma), (c.b, c.mb)):
        for name in _files(disk, 3):
            assert (mem / "step_00000003" / name).read_bytes() == (disk / "step_00000003" / name).read_bytes()
    # every process was killed: the restart resumes step 3 from each node's memory, bit-exact
    res, logs = c.run("restart", KILL_AFTER_FLUSH="1")
    _resumed(res, 3)
    for r in range(4):
        assert f"loading step 3 {FROM_MEMORY}" in logs[r], log_tail(tmp_path / "restart", r)
    # rank 2's memory copy corrupt (same size, one byte flipped): it falls back to its disk, same step
    shard = c.mb / "step_00000003" / "rank00002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    res, logs = c.run("corrupt", KILL_AFTER_FLUSH="1")
    _resumed(res, 3)
    assert "falling back to the same step from its node's disk" in logs[2], logs[2][-3000:]
    assert f"loading step 3 {FROM_DISK}" in logs[2]
    for r in (0, 1, 3):
        assert f"loading step 3 {FROM_MEMORY}" in logs[r] and FROM_DISK not in logs[r]
    # node b's memory wiped (a reboot empties tmpfs): its ranks read their disk, node a its memory
    shutil.rmtree(c.mb)
    c.mb.mkdir()
    res, logs = c.run("wiped", STEPS="4")
    _resumed(res, 3)
    for r in (2, 3):
        assert f"loading step 3 {FROM_DISK}" in logs[r] and FROM_MEMORY not in logs[r]
    for r in (0, 1):
        assert f"loading step 3 {FROM_MEMORY}" in logs[r]
    assert _steps(c.ma) == [4] and _steps(c.mb) == [4]  # and the next save fills both again


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(300)
def test_the_budget_keeps_fewer_steps_and_never_fails_a_save(cluster: Cluster) -> None:
    c = cluster
    # a node's part of a step is ~33 KB: 50 KB holds one step although memory_keep_last is 3
    c.save("fits-one", [1, 2, 3], MEMORY_KEEP_LAST="3", MEMORY_BUDGET="50000")
    assert _steps(c.ma) == [3] and _steps(c.mb) == [3]
    assert sum(p.stat().st_size for p in (c.ma / "step_00000003").iterdir()) <= 50000
    # 10 KB holds no step at all: every save commits on the disks, the memory tier stays empty
    shutil.rmtree(c.ma)
    shutil.rmtree(c.mb)
    c.ma.mkdir()
    c.mb.mkdir()
    res, logs = c.save("fits-none", [4, 5], MEMORY_BUDGET="10000")
    for got in res.values():
        assert got["loaded"] == 3 and got["equal"], got  # from the disks: no memory copy is there
    assert _steps(c.ma) == [] and _steps(c.mb) == []
    assert _steps(c.a)[-1] == 5 and _steps(c.b)[-1] == 5
    assert "exceeds memory_budget=10000" in logs[0] and "exceeds memory_budget=10000" in logs[2]


@pytest.mark.needs_root
@pytest.mark.slow  # one run of 4 ranks
@pytest.mark.timeout(300)
def test_memory_every_copies_every_nth_commit_and_the_disks_take_every_save(cluster: Cluster) -> None:
    c = cluster
    c.save("every-2", [1, 2, 3, 4, 5], MEMORY_EVERY="2", MEMORY_KEEP_LAST="5", KEEP_LAST="5")
    assert _steps(c.ma) == [1, 3, 5] and _steps(c.mb) == [1, 3, 5]  # the 1st, 3rd and 5th commits
    assert _steps(c.a) == [1, 2, 3, 4, 5]


@pytest.mark.needs_root
@pytest.mark.slow  # one run of 4 ranks
@pytest.mark.timeout(300)
def test_the_memory_tier_is_filled_from_the_saves_bytes_not_from_the_disk(tmp_path: Path, shm: Path) -> None:
    """Every read of a rank file on a node's disk is refused (an audit hook) once the job saves:
    the memory tier still gets every step, byte for byte the disk's, and nobody read the disk."""
    _needs_root()
    c = Cluster(tmp_path, shm)
    res, _ = c.run("no-reads", STEPS="1,2", NO_DISK_READS="1", MEMORY_KEEP_LAST="2")
    assert {r: (got["saved"], got.get("flush_error"), got["disk_reads"]) for r, got in res.items()} == {
        r: ([1, 2], None, []) for r in range(4)
    }
    assert _steps(c.ma) == [1, 2] and _steps(c.mb) == [1, 2]
    for disk, mem, step in [(d, m, s) for d, m in ((c.a, c.ma), (c.b, c.mb)) for s in (1, 2)]:
        assert _files(mem, step) == _files(disk, step)
        assert all(
            (mem / f"step_{step:08d}" / n).read_bytes() == (disk / f"step_{step:08d}" / n).read_bytes()
            for n in _files(disk, step)
        )


@pytest.mark.parametrize(
    ("kw", "error", "words"),
    [
        ({"memory": "/dev/shm/x"}, ValueError, "needs node_local=True"),
        ({"memory": 7, "node_local": True}, TypeError, "memory must be a path"),
        ({"memory": "", "node_local": True}, ValueError, "memory must be a directory"),
        ({"memory": "s3://b/p", "node_local": True}, ValueError, "memory must be a directory"),
        ({"memory": "/dev/shm/x", "node_local": True, "memory_keep_last": 0}, ValueError, "at least 1"),
        ({"memory": "/dev/shm/x", "node_local": True, "memory_keep_last": "2"}, TypeError, "must be an int"),
        ({"memory": "/dev/shm/x", "node_local": True, "memory_keep_last": True}, TypeError, "must be an int"),
        ({"memory": "/dev/shm/x", "node_local": True, "memory_budget": -1}, ValueError, "positive number of bytes"),
        ({"memory": "/dev/shm/x", "node_local": True, "memory_budget": 1.5}, TypeError, "must be an int (bytes)"),
        ({"memory_budget": 100}, ValueError, "apply to a memory tier"),
        ({"memory_keep_last": 2}, ValueError, "apply to a memory tier"),
        ({"memory": "/dev/shm/x", "node_local": True, "memory_every": 0}, ValueError, "at least 1"),
        ({"memory": "/dev/shm/x", "node_local": True, "memory_every": 2.0}, TypeError, "must be an int"),
        ({"node_local": True, "memory_every": 2}, ValueError, "(memory=...), which is not set"),
        ({"node_local": True, "mirror_every": 3}, ValueError, "(mirror=...), which is not set"),
        ({"memory_every": 3}, ValueError, "(memory=...), which is not set"),
    ],
)
def test_bad_memory_options_raise_typed_errors_at_the_call(
    tmp_path: Path, kw: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=None) as e:
        Checkpointer(tmp_path / "ck", **kw)
    assert words in str(e.value)
    assert not (tmp_path / "ck").exists()  # nothing made


def test_the_memory_tier_and_the_root_must_be_apart_and_need_a_process_group(tmp_path: Path, shm: Path) -> None:
    with pytest.raises(ValueError, match="two separate directories"):
        Checkpointer(shm / "ck", node_local=True, memory=shm / "ck" / "mem")
    with pytest.raises(ValueError, match="needs a process group"):
        Checkpointer(tmp_path / "ck", node_local=True, memory=shm / "mem")


def _write(memory: Path, budget: int | None, files: dict[str, bytes]) -> MemoryWrite:
    """A due save's memory write of ``files`` (from buffers larger than the files), ended."""

    async def run(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def go() -> MemoryWrite:
        w = MemoryWrite(str(memory), 7, budget, run)
        w.begin("a1b2")
        for name, data in files.items():
            w.write(name, memoryview(data + b"not this"), len(data), None, time.monotonic() + 30)
        await w.settle()
        return w

    return asyncio.run(go())


def test_a_memory_write_holds_the_buffers_bytes_and_a_failed_save_removes_it(shm: Path) -> None:
    files = {"rank00003.safetensors": os.urandom(3 << 20), "rank00003.json": b'{"tree": 1}'}
    w = _write(shm, None, files)
    assert w.outcome() == {"ok": True, "bytes": (3 << 20) + 11}
    assert {n: (shm / "step_00000007.tmp-a1b2" / n).read_bytes() for n in files} == files
    w.discard()  # the save failed: its files leave the memory tier
    assert os.listdir(shm) == []
    # a file over the budget is not written: the round drops the step (never the save)
    w = _write(shm, 1000, files)
    assert w.outcome() == {
        "ok": False,
        "bytes": (3 << 20) + 11,
        "error": f"OSError: rank00003.safetensors ({3 << 20} bytes) exceeds memory_budget=1000",
    }
    assert not (shm / "step_00000007.tmp-a1b2" / "rank00003.safetensors").exists()


def test_a_memory_tier_not_on_tmpfs_is_refused_and_leftovers_on_tmpfs_are_removed(tmp_path: Path, shm: Path) -> None:
    assert fs_type(str(shm)) == "tmpfs"
    if fs_type(str(tmp_path)) in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on tmpfs here: no other file system to refuse")
    with pytest.raises(CheckpointError, match="not tmpfs"):
        start_memory(str(tmp_path / "mem"))
    leftover = shm / "mem" / "step_00000007.tmp-0123456789abcdef"
    leftover.mkdir(parents=True)
    (leftover / "rank00000.safetensors").write_bytes(b"half")
    start_memory(str(shm / "mem"))
    assert os.listdir(shm / "mem") == []  # a killed process's half copy is gone
    # taken as a root is: a second job's leader on this node is refused, nothing removed
    mine = Ownership(str(shm / "mem"), None)
    start_memory(str(shm / "mem"), mine, (0, 1))
    leftover.mkdir()
    with pytest.raises(RootInUseError):
        start_memory(str(shm / "mem"), Ownership(str(shm / "mem"), None), (0, 1))
    assert leftover.exists()
    mine.release()
    start_memory(str(shm / "mem"), Ownership(str(shm / "mem"), None), (0, 1))  # free again
    assert not leftover.exists()


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(300)
def test_a_full_tmpfs_fails_the_copies_never_a_save_and_the_restart_reads_the_disks(cluster: Cluster) -> None:
    c = cluster
    with small_tmpfs(c.mb):  # node b's memory too small for its part (~33 KB): a real ENOSPC
        res, logs = c.save("full", [1, 2], KEEP_LAST="2")
        assert "No space left on device" in logs[2], logs[2][-3000:]  # named by node b's leader
        assert _steps(c.ma) == [2] and _steps(c.mb) == []  # node a's memory holds its part, node b's none
        assert not [p for p in c.mb.iterdir() if ".tmp-" in p.name]  # the failed attempt is removed
        res, logs = c.run("after", KILL_AFTER_FLUSH="1")
        _resumed(res, 2)  # the same step everywhere: node a from memory, node b from its disk
        for r in (0, 1):
            assert f"loading step 2 {FROM_MEMORY}" in logs[r]
        for r in (2, 3):
            assert f"loading step 2 {FROM_DISK}" in logs[r]


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(400)
def test_a_tensor_every_rank_holds_resumes_bit_exact_from_each_nodes_own_tiers(
    tmp_path: Path, cluster: Cluster
) -> None:
    # DDP's model: a tensor equal on every rank. Dedupe (on by default) writes it once, by one
    # rank: on a node-local root that rank's node alone would hold it, and the other node could
    # not load the step it committed from its own disk or memory
    c = cluster
    c.save("first", [1], SHARED="1", KILL_AFTER_FLUSH="1")
    res, _ = c.run("from-memory", SHARED="1")
    _resumed(res, 1)
    for d in (c.ma, c.mb):  # the memory tiers gone: each node's disk alone
        shutil.rmtree(d)
        d.mkdir()
    res, _ = c.run("from-disk", SHARED="1")
    _resumed(res, 1)


@pytest.mark.needs_root
@pytest.mark.slow  # a run of 4 ranks
@pytest.mark.timeout(300)
def test_a_dtensor_state_on_a_node_local_root_is_refused_at_save_on_every_rank_and_nothing_commits(
    tmp_path: Path, cluster: Cluster
) -> None:
    # its global index (rank 0's node) and replicated boxes would span nodes: a node could not
    # load the step it committed. Refused at the call, typed, on every rank; nothing committed
    c = cluster
    res, _ = c.run("dtensor", STEPS="1", DTENSOR="1")
    for r, got in res.items():
        err = got.get("save_error") or {}
        assert err.get("type") == "ValueError" and "node_local=True does not save DTensors" in err["msg"], (r, got)
    for d in (c.a, c.b, c.ma, c.mb):
        assert _steps(d) == [], d
