"""Copies of committed steps between any two roots (``asyncckpt.roots._transfer``): memory,
a local directory and the real SeaweedFS on loopback, in every direction push, pull and tier
mode use; what a copy refuses (a source that does not verify, another commit at the
destination, a destination someone else owns); and that a copy killed or failed midway
leaves the destination without a committed step and a re-run completes."""

from __future__ import annotations

import os
import threading
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli_util import run_cli, so
from s3fixtures import data_keys, kill_when_held, only_committed, opts, proxy_fixture, put, require_s3, server_fixture
from s3proxy import Rule

import asyncckpt
from asyncckpt import CheckpointCorruptError, Checkpointer, CheckpointError, CheckpointNotFoundError, RootInUseError
from asyncckpt.roots import Root, _memory, open_root
from asyncckpt.roots._transfer import Copied, TransferStopped, choose_steps, copy_step, copy_steps

require_s3()
BUCKET = "transfer"
MiB = 1 << 20
pytestmark = pytest.mark.timeout(120)

s3 = server_fixture(BUCKET)
proxy = proxy_fixture()


def state(step: int, big: int = 3 * MiB // 4 + 17) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(big, generator=g), "b": torch.arange(step, step + 7), "step": step}


def saved(root: Path, steps: list[int], big: int = 3 * MiB // 4 + 17) -> Path:
    with Checkpointer(root, keep_last=None) as ck:
        for s in steps:
            ck.save(s, state(s, big)).result(timeout=60)
    return root


def files_of(root: Root, step: int) -> dict[str, bytes]:
    """Every file of committed ``step`` (its manifest's bytes under ``manifest.json``)."""
    with root.open_reader(step) as r:
        out = {f.name: r.read(f.name) for f in r.manifest.files}
        out["manifest.json"] = r.manifest_raw
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.fixture
def url() -> str:
    return f"s3://{BUCKET}/x-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def mem() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for n in names:
        _memory.drop(n)


def memory_root(names: list[str]) -> Root:
    n = f"transfer-{uuid.uuid4().hex[:8]}"
    names.append(n)
    return open_root(f"memory://{n}")


def test_every_direction_copies_bit_identical_steps(tmp_path: Path, s3: Any, url: str, mem: list[str]) -> None:
    """posix -> memory -> posix, posix -> s3 -> posix and s3 -> memory: every file and the
    manifest byte for byte the source's, and what loads from each is the state saved."""
    src = open_root(saved(tmp_path / "src", [3, 5]))
    want = {s: files_of(src, s) for s in (3, 5)}
    m1 = memory_root(mem)
    assert [c.status for c in copy_steps(src, m1)] == ["copied", "copied"]
    assert {s: files_of(m1, s) for s in (3, 5)} == want
    (tmp_path / "back").mkdir()
    back = open_root(tmp_path / "back")
    assert [(c.step, c.status) for c in copy_steps(m1, back)] == [(3, "copied"), (5, "copied")]  # memory -> posix
    assert files_of(back, 5) == want[5]
    same(asyncckpt.load(tmp_path / "back"), state(5))
    same(asyncckpt.load(tmp_path / "back", step=3), state(3))

    store = open_root(url, storage_options=opts(s3.endpoint), deadline_s=60)
    done = copy_steps(src, store, "latest")  # posix -> s3
    assert [(c.step, c.status, c.where) for c in done] == [(5, "copied", f"{url}/step_00000005")]
    assert done[0].nbytes == sum(len(v) for k, v in want[5].items() if k != "manifest.json")
    only_committed(s3.endpoint, url, [5])
    same(asyncckpt.load(url, storage_options=opts(s3.endpoint)), state(5))

    (tmp_path / "pulled").mkdir()
    pulled = open_root(tmp_path / "pulled")
    assert copy_steps(store, pulled)[0].status == "copied"  # s3 -> posix
    assert files_of(pulled, 5) == want[5]
    same(asyncckpt.load(tmp_path / "pulled"), state(5))
    assert sorted(os.listdir(tmp_path / "pulled")) == [".asyncckpt", "step_00000005"]

    m2 = memory_root(mem)
    assert copy_step(store, m2, 5).status == "copied"  # s3 -> memory
    assert files_of(m2, 5) == want[5]
    store.close()


def test_a_rerun_is_present_and_another_commit_is_never_overwritten(
    tmp_path: Path, mem: list[str]
) -> None:
    a = open_root(saved(tmp_path / "a", [1, 2]))
    b = open_root(saved(tmp_path / "b", [2]))  # the same step, another attempt
    dst = memory_root(mem)
    assert [c.status for c in copy_steps(a, dst)] == ["copied", "copied"]
    assert [c.status for c in copy_steps(a, dst)] == ["present", "present"]
    before = files_of(dst, 2)
    with pytest.raises(CheckpointError, match="another attempt") as ei:
        copy_step(b, dst, 2)
    assert "memory://" in str(ei.value)
    assert files_of(dst, 2) == before and dst.leftovers() == []


@pytest.mark.parametrize("where", ["posix", "memory"])
def test_a_source_file_that_does_not_match_its_manifest_is_never_committed(
    tmp_path: Path, mem: list[str], where: str
) -> None:
    """A flipped byte (the size unchanged, so only the CRC-32C can tell): refused naming the
    source file, nothing committed and nothing left at the destination."""
    src_dir = saved(tmp_path / "src", [4])
    shard = src_dir / "step_00000004" / "rank00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x01
    shard.write_bytes(bytes(raw))
    if where == "posix":
        (tmp_path / "dst").mkdir()
        dst = open_root(tmp_path / "dst")
    else:
        dst = memory_root(mem)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch") as ei:
        copy_steps(open_root(src_dir), dst)
    assert str(shard) in str(ei.value)
    assert dst.list_steps() == [] and dst.leftovers() == []
    if where == "posix":
        assert sorted(os.listdir(tmp_path / "dst")) == [".asyncckpt"]


def test_a_corrupt_object_at_a_store_source_is_never_pulled(tmp_path: Path, s3: Any, url: str) -> None:
    src = open_root(saved(tmp_path / "src", [2]))
    store = open_root(url, storage_options=opts(s3.endpoint), deadline_s=60)
    copy_step(src, store, 2)
    m = store.open_step(2)
    shard = next(f for f in m.files if f.name.endswith(".safetensors"))
    body = bytearray(files_of(store, 2)[shard.name])
    body[100] ^= 0xFF
    put(s3.endpoint, url, f"step_00000002/a-{m.attempt}/{shard.name}", bytes(body))
    (tmp_path / "dst").mkdir()
    dst = open_root(tmp_path / "dst")
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        copy_steps(store, dst)
    assert dst.list_steps() == [] and sorted(os.listdir(tmp_path / "dst")) == [".asyncckpt"]
    store.close()


def test_a_destination_another_writer_owns_is_refused(tmp_path: Path, mem: list[str]) -> None:
    src = open_root(saved(tmp_path / "src", [1]))
    (tmp_path / "dst").mkdir()
    with Checkpointer(tmp_path / "dst"):
        with pytest.raises(RootInUseError):
            copy_steps(src, open_root(tmp_path / "dst"))
    assert copy_steps(src, open_root(tmp_path / "dst"))[0].status == "copied"  # released: it goes


def test_a_store_prefix_a_live_checkpointer_writes_is_refused(tmp_path: Path, s3: Any, url: str) -> None:
    src = open_root(saved(tmp_path / "src", [1]))
    o = opts(s3.endpoint)
    with Checkpointer(url, storage_options=o) as ck:
        ck.save(0, state(0)).result(timeout=60)
        busy = open_root(url, storage_options=o, deadline_s=3)  # gives up on the live lease in 3 s
        with pytest.raises(RootInUseError):
            copy_steps(src, busy)
        assert [r.step for r in busy.list_steps() if r.resumable] == [0]
    assert copy_steps(src, open_root(url, storage_options=o))[0].status == "copied"  # released: it goes


def test_which_steps_a_copy_takes(tmp_path: Path) -> None:
    src = open_root(saved(tmp_path / "src", [1, 2, 5, 9]))
    assert choose_steps(src) == [1, 2, 5, 9]
    assert choose_steps(src, newest=2) == [5, 9]
    assert choose_steps(src, "latest") == [9]
    assert choose_steps(src, [5, 1, 5]) == [1, 5]
    assert choose_steps(src, 2) == [2]
    for bad in ("newest", -1):
        with pytest.raises((ValueError, TypeError)):
            choose_steps(src, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        choose_steps(src, newest=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError):
        choose_steps(open_root(tmp_path / "empty"), "latest")
    (tmp_path / "dst").mkdir()
    with pytest.raises(CheckpointNotFoundError):
        copy_step(src, open_root(tmp_path / "dst"), 3)
    out = copy_steps(src, open_root(tmp_path / "dst"), newest=3, keep_last=2)
    assert [c.step for c in out] == [2, 5, 9]
    assert [r.step for r in open_root(tmp_path / "dst").list_steps() if r.resumable] == [5, 9]


def test_a_stopped_copy_commits_nothing(tmp_path: Path, mem: list[str]) -> None:
    src = open_root(saved(tmp_path / "src", [1]))
    dst = memory_root(mem)
    stop = threading.Event()
    stop.set()
    with pytest.raises(TransferStopped):
        copy_step(src, dst, 1, stop=stop)
    assert dst.list_steps() == [] and dst.leftovers() == []


def test_a_big_file_is_copied_through_bounded_memory(tmp_path: Path) -> None:
    """64 MiB across two local roots with Python's allocations traced: the copy holds one
    window (16 MiB), never the file."""
    src = open_root(saved(tmp_path / "src", [1], big=16 * MiB))  # 64 MiB of float32
    (tmp_path / "dst").mkdir()
    dst = open_root(tmp_path / "dst")
    tracemalloc.start()
    try:
        out = copy_step(src, dst, 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.status == "copied" and out.nbytes > 64 * MiB
    assert peak < 24 * MiB, peak
    assert files_of(dst, 1) == files_of(src, 1)


# ---------------------------------------------------------------- faults and kills midway


def test_a_store_fault_mid_push_leaves_no_step_and_a_rerun_completes(
    tmp_path: Path, s3: Any, proxy: Any, url: str
) -> None:
    src = open_root(saved(tmp_path / "src", [7]))
    proxy.add(Rule("status", method="PUT", path_contains="rank00000.safetensors", status=503, times=10**6))
    store = open_root(url, storage_options=opts(proxy.endpoint), deadline_s=5)
    with pytest.raises(asyncckpt.ObjectStoreError):
        copy_steps(src, store, deadline_s=5)
    assert store.newest_resumable() is None
    assert not any(k.endswith("manifest.json") for k in data_keys(s3.endpoint, url))
    proxy.clear()
    assert copy_steps(src, store)[0].status == "copied"
    only_committed(s3.endpoint, url, [7])
    same(asyncckpt.load(url, storage_options=opts(s3.endpoint)), state(7))
    store.close()


def test_a_store_fault_mid_pull_leaves_no_step_and_a_rerun_completes(
    tmp_path: Path, s3: Any, proxy: Any, url: str
) -> None:
    src = open_root(saved(tmp_path / "src", [7]))
    copy_step(src, open_root(url, storage_options=opts(s3.endpoint)), 7)
    proxy.add(Rule("status", method="GET", path_contains="rank00000.safetensors", status=503, times=10**6))
    store = open_root(url, storage_options=opts(proxy.endpoint), deadline_s=4)
    (tmp_path / "dst").mkdir()
    dst = open_root(tmp_path / "dst")
    with pytest.raises(asyncckpt.CheckpointReadError):
        copy_steps(store, dst)
    assert dst.list_steps() == [] and sorted(os.listdir(tmp_path / "dst")) == [".asyncckpt"]
    proxy.clear()
    assert copy_steps(store, dst)[0].status == "copied"
    same(asyncckpt.load(tmp_path / "dst"), state(7))
    store.close()


_COPY = """
import sys
from asyncckpt.roots import open_root
from asyncckpt.roots._transfer import copy_steps
src, dst, endpoint = sys.argv[1:4]
so = dict(endpoint=endpoint, access_key_id="asyncckpt-test-key", secret_access_key="asyncckpt-test-secret",
          region="us-east-1")
kw = lambda w: {"storage_options": so} if w.startswith("s3://") else {}
copy_steps(open_root(src, **kw(src)), open_root(dst, **kw(dst)))
"""


# the push's re-run waits out the killed writer's lease (its TTL, about a minute): slow
@pytest.mark.parametrize("direction", [pytest.param("push", marks=pytest.mark.slow), "pull"])
def test_a_copy_killed_midway_leaves_no_step_and_a_rerun_completes(
    tmp_path: Path, s3: Any, proxy: Any, url: str, direction: str
) -> None:
    """SIGKILL while the shard's bytes are in flight (the proxy holds them): the destination
    has no committed step; a re-run commits it, bit-identical, and leaves nothing behind."""
    local = saved(tmp_path / "src", [8])
    if direction == "push":
        held = proxy.add(Rule("delay", method="PUT", path_contains="rank00000.safetensors", delay=30.0, times=1))
        src, dst = str(local), url
    else:
        copy_step(open_root(local), open_root(url, storage_options=opts(s3.endpoint)), 8)
        held = proxy.add(Rule("delay", method="GET", path_contains="rank00000.safetensors", delay=30.0, times=1))
        (tmp_path / "dst").mkdir()
        src, dst = url, str(tmp_path / "dst")
    script = tmp_path / "transfer_job.py"  # not copy.py: that would shadow the stdlib
    script.write_text(_COPY)
    kill_when_held([str(script), src, dst, proxy.endpoint], held, direction)
    proxy.clear()
    so = {"storage_options": opts(s3.endpoint)}
    d = open_root(dst, **(so if dst.startswith("s3://") else {}))
    assert d.newest_resumable() is None
    s = open_root(src, **(so if src.startswith("s3://") else {}))
    assert copy_steps(s, d)[0].status == "copied"
    if direction == "push":
        only_committed(s3.endpoint, url, [8])
        assert d.leftovers() == []  # the killed run's upload was aborted after the commit
        same(asyncckpt.load(url, storage_options=opts(s3.endpoint)), state(8))
    else:
        assert sorted(os.listdir(dst)) == [".asyncckpt", "step_00000008"]
        same(asyncckpt.load(dst), state(8))
    s.close()
    d.close()


def test_the_command_line_push_and_pull_are_the_copy(tmp_path: Path, s3: Any, url: str) -> None:
    """``asyncckpt push``/``pull --json`` over the copy: the same records as before."""
    import json

    local = saved(tmp_path / "src", [1, 2])

    def cli(*argv: str) -> Any:
        r = run_cli(*argv, "--json", *so(s3.endpoint), timeout=90)
        assert r.code == 0, r.err[-2000:]
        return json.loads(r.out)

    rows = cli("push", str(local), url)
    assert [(r["step"], r["status"], r["url"]) for r in rows] == [
        (1, "pushed", f"{url}/step_00000001"), (2, "pushed", f"{url}/step_00000002")]
    assert set(rows[0]) == {"step", "status", "url", "bytes", "seconds"}
    assert [r["status"] for r in cli("push", str(local), url)] == ["present", "present"]
    into = tmp_path / "into"
    assert cli("pull", url, str(into)) == {"step": 2, "status": "pulled", "root": str(into)}
    assert cli("pull", url, str(into)) == {"step": 2, "status": "present", "root": str(into)}
    assert isinstance(copy_step(open_root(local), open_root(into), 2), Copied)
