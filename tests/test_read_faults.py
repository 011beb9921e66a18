"""I/O errors are not corruption (issue 26, problem 4).

An EIO (or ETIMEDOUT, ENOSPC, ...) while a checkpoint is read is retried within the load's
deadline and then raised as ``CheckpointReadError`` naming the file; it never marks the step
bad and never makes ``load()`` fall back to an older step. A store that answers 503 is the
same. A stale mark is dropped by a later full verification of the same attempt that passes.

The faults are real: the FUSE fault file system (``tests/support/faultfs.py``, through the kernel;
skipped with ``needs root/FUSE:`` where it cannot mount), a fault proxy in front of a real
SeaweedFS for the store, real gloo processes for two ranks.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli_util import run_cli
from _ranks import free_port, log_tail, run_ranks
from faultfs import FaultFS, mounted, rule

import asyncckpt
from asyncckpt import CheckpointCorruptError, Checkpointer, CheckpointError, CheckpointReadError
from asyncckpt.format._manifest import MANIFEST, decode
from asyncckpt.roots import _readfault
from asyncckpt.roots._badmarks import bad_mark, mark_name, record_bad

WORKER = str(Path(__file__).parent / "support" / "_readfault_worker.py")
SHARD = "rank00000.safetensors"


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((64 * 1024,), float(step)), "b": torch.arange(8) + step, "step": step}


def attempt_of(root: str | Path, step: int) -> str:
    return decode((Path(root) / f"step_{step:08d}" / MANIFEST).read_bytes(), "").attempt


def marks(root: str | Path) -> list[str]:
    d = Path(root) / ".asyncckpt" / "bad"
    return sorted(os.listdir(d)) if d.is_dir() else []


# ------------------------------------------------------------------------------ a FUSE mount
@pytest.fixture(scope="module")
def mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFS]:
    base = tmp_path_factory.mktemp("readfault")
    # direct I/O: every read reaches the file system (the page cache would retry a failed
    # readahead by itself, hiding a single EIO)
    with mounted(base / "backing", base / "mnt", direct_io=True, skip_unavailable=True) as fs:
        yield fs


@pytest.fixture
def fs(mount: FaultFS) -> Iterator[FaultFS]:
    mount.clear()
    mount.reset_events()
    yield mount
    mount.clear()


def _saved(fs: FaultFS, name: str) -> tuple[str, str]:
    """Steps 1 and 2 saved under the mount; (the root through FUSE, its backing directory)."""
    root = fs.path(name)
    with Checkpointer(root) as ck:
        for s in (1, 2):
            ck.save(s, state(s)).result(timeout=60)
    return root, os.path.join(fs.backing, name)


def _shard_rule(step: int, name: str = SHARD, **kw: Any) -> dict[str, Any]:
    return rule("read", glob=f"*/step_{step:08d}/{name}", error=kw.pop("error", "EIO"), id="f", **kw)


@pytest.mark.needs_root
@pytest.mark.parametrize("how", ["module-load", "checkpointer-load", "explicit-step"])
def test_a_transient_eio_is_retried_and_the_step_loads_without_a_mark(fs: FaultFS, how: str) -> None:
    root, backing = _saved(fs, f"once-{how}")
    fs.set_rules([_shard_rule(2, count=1)])
    if how == "module-load":
        got = asyncckpt.load(root)
    elif how == "explicit-step":
        got = asyncckpt.load(root, 2)
    else:
        with Checkpointer(root, timeout=10) as ck:
            got = ck.load()
    assert fs.fired("f") == 1, "the fault did not fire"
    assert got["step"] == 2 and torch.equal(got["w"], state(2)["w"])  # no fallback to step 1
    assert marks(backing) == [] and bad_mark(backing, 2, attempt_of(backing, 2)) is None
    fs.clear()
    assert asyncckpt.load(root)["step"] == 2  # and the next load of the step is fine too


@pytest.mark.needs_root
@pytest.mark.parametrize(
    ("name", "err"),
    [(SHARD, "EIO"), (SHARD, "ETIMEDOUT"), (SHARD, "ENOSPC"), ("rank00000.json", "EIO"), (MANIFEST, "EIO")],
)
def test_a_persistent_read_error_raises_typed_naming_the_file_without_fallback_or_mark(
    fs: FaultFS, name: str, err: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    if (name, err) != (SHARD, "EIO"):  # the real pauses once (that case checks the time), short ones here
        monkeypatch.setattr(_readfault, "BACKOFF_S", 0.02)
    root, backing = _saved(fs, f"always-{name}-{err}")
    fs.set_rules([_shard_rule(2, name, error=err)])
    where = os.path.join(root, "step_00000002", name)
    loads = (lambda: asyncckpt.load(root), lambda: asyncckpt.load(root, 2), lambda: asyncckpt.load(root, into=state(0)))
    for i, load in enumerate(loads):
        t0 = time.monotonic()
        with pytest.raises(CheckpointReadError) as ei:
            load()
        took = time.monotonic() - t0
        e = ei.value
        assert not isinstance(e, CheckpointCorruptError)
        assert isinstance(e, OSError) and isinstance(e, CheckpointError)
        assert e.errno == getattr(errno, err) and e.filename == where, (e.errno, e.filename, str(e))
        assert where in str(e) and "tries" in str(e), str(e)
        # a one-pass read into the targets that failed says they may be partly overwritten
        assert ("verify_first=True" in str(e)) == (i == 2 and name != MANIFEST), str(e)
        assert took < 10, took  # a few tries with backoff, then the error
        assert took >= 1.7 or (name, err) != (SHARD, "EIO"), took  # 0.25 + 0.5 + 1 s of pauses
    fired = fs.fired("f")
    assert fired >= 2 * 3, fired  # retried on every load
    with pytest.raises(CheckpointReadError), Checkpointer(root, timeout=10) as ck:
        ck.load()  # (an unreadable manifest already stops the construction, which lists the steps)
    assert marks(backing) == []
    assert not any("falling back" in r.getMessage() for r in caplog.records)
    fs.clear()
    assert asyncckpt.load(root)["step"] == 2


@pytest.mark.needs_root
def test_verify_cli_reports_an_io_error_as_unreadable_not_corrupt_and_marks_nothing(fs: FaultFS) -> None:
    root, backing = _saved(fs, "verify-cli")
    fs.set_rules([_shard_rule(2)])
    run = run_cli("verify", root, "--step", "2")
    assert run.code == 1, run
    assert "corrupt" not in run.err and "I/O error" in run.err, run.err
    assert os.path.join(root, "step_00000002", SHARD) in run.err
    run = run_cli("verify", root, "--step", "2", "--json")
    doc = json.loads(run.out)
    assert run.code == 1 and doc["steps"][0]["status"] == "unreadable", doc
    assert marks(backing) == []
    fs.clear()
    assert run_cli("verify", root, "--step", "2").code == 0


@pytest.mark.needs_root
@pytest.mark.timeout(150)
def test_two_ranks_both_raise_the_io_error_of_rank_1_and_neither_falls_back(fs: FaultFS, tmp_path: Path) -> None:
    root, backing = fs.path("two-ranks"), os.path.join(fs.backing, "two-ranks")
    out = tmp_path / "result"
    port = free_port()

    def arm(_: Any) -> None:
        end = time.monotonic() + 90
        while not Path(f"{out}.ready").exists() and time.monotonic() < end:
            time.sleep(0.05)
        fs.set_rules([_shard_rule(2, "rank00001.safetensors")])
        Path(f"{out}.go").write_text("1")

    hung = run_ranks(lambda r: [WORKER, str(r), "2", str(port), root, str(out)], 2, tmp_path, 120, on_started=arm)
    assert not hung, f"ranks {hung} hung: {log_tail(tmp_path, hung[0])}"
    where = os.path.join(root, "step_00000002", "rank00001.safetensors")
    for r in range(2):
        f = Path(f"{out}.{r}.json")
        assert f.exists(), log_tail(tmp_path, r)
        got = json.loads(f.read_text())
        assert "crash" not in got, got["crash"]
        assert got["load1"] == 10.0 + r and got["mark1"] is False, got  # the stale mark was dropped
        for what in ("newest", "explicit"):
            o = got[what]
            assert o.get("type") == "CheckpointReadError", (r, what, o)  # no fallback to step 1
            assert o["errno"] == errno.EIO and o["filename"] == where and where in o["msg"], (r, o)
            assert r == 1 or "rank 1" in o["msg"], (r, o)  # rank 0 names the rank that failed
        assert got["took"] < 40, got
    assert fs.fired("f") >= 2
    assert marks(backing) == []


# ------------------------------------------------------------------------------ stale marks
@pytest.fixture
def saved(tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        for s in (1, 2):
            ck.save(s, state(s)).result(timeout=60)
    return root


def _stale_mark(root: Path, step: int) -> str:
    attempt = attempt_of(root, step)
    shard = str(root / f"step_{step:08d}" / SHARD)
    assert record_bad(root, step, attempt, shard, "cannot read shard (Input/output error)")
    assert bad_mark(root, step, attempt) is not None
    return attempt


def test_a_stale_mark_is_dropped_by_a_full_verifying_load_of_that_attempt(saved: Path) -> None:
    attempt = _stale_mark(saved, 2)
    asyncckpt.load(saved, 2, verify=False)  # not a verification: the mark stays
    assert bad_mark(saved, 2, attempt) is not None
    assert asyncckpt.load(saved, 2)["step"] == 2
    assert bad_mark(saved, 2, attempt) is None and marks(saved) == []
    attempt = _stale_mark(saved, 2)
    with Checkpointer(saved) as ck:
        assert ck.load(2)["step"] == 2
    assert bad_mark(saved, 2, attempt) is None


def test_a_mark_of_another_attempt_is_not_dropped(saved: Path) -> None:
    shard = str(saved / "step_00000002" / SHARD)
    assert record_bad(saved, 2, "0" * 32, shard, "checksum mismatch")
    asyncckpt.load(saved, 2)
    assert marks(saved) == [mark_name(2, "0" * 32)]  # the other attempt's mark stays


def test_a_stale_mark_is_dropped_by_a_passing_verify(saved: Path) -> None:
    attempt = _stale_mark(saved, 2)
    run = run_cli("verify", saved, "--step", "2")
    assert run.code == 0, run
    assert bad_mark(saved, 2, attempt) is None


def test_a_real_checksum_mismatch_still_marks_and_falls_back(saved: Path) -> None:
    shard = saved / "step_00000002" / SHARD
    data = bytearray(shard.read_bytes())
    data[-5] ^= 1
    shard.write_bytes(bytes(data))
    assert asyncckpt.load(saved)["step"] == 1
    mark = bad_mark(saved, 2, attempt_of(saved, 2))
    assert mark is not None and mark["path"] == str(shard)
    asyncckpt.load(saved, 1)  # a verification of another step leaves it
    assert bad_mark(saved, 2, attempt_of(saved, 2)) is not None


# ------------------------------------------------------------------------------ into= errors
def test_a_shape_mismatch_in_into_carries_no_verify_first_appendix(saved: Path) -> None:
    target = state(0)
    target["w"] = torch.zeros(5)
    with pytest.raises(ValueError, match="shape") as ei:
        asyncckpt.load(saved, into=target)
    assert "verify_first" not in str(ei.value) and "partly overwritten" not in str(ei.value)


def test_a_missing_key_in_into_is_a_checkpoint_error_with_a_plain_message(saved: Path) -> None:
    target = {**state(0), "extra": torch.zeros(3)}
    with pytest.raises(CheckpointError) as ei:
        asyncckpt.load(saved, into=target)
    assert str(ei.value) == "extra is not in the checkpoint", str(ei.value)
    with Checkpointer(saved) as ck, pytest.raises(CheckpointError) as ei:
        ck.load(into={"step": 0, "nested": {"x": 1}})
    assert str(ei.value) == "nested is not in the checkpoint", str(ei.value)


@pytest.mark.timing  # a 2 s bound
@pytest.mark.needs_root
def test_a_refused_permission_is_a_read_error_raised_at_once(fs: FaultFS) -> None:
    root, backing = _saved(fs, "eacces")
    fs.set_rules([rule("open", glob="*/step_00000002/" + SHARD, error="EACCES", id="f")])
    t0 = time.monotonic()
    with pytest.raises(CheckpointReadError) as ei:
        asyncckpt.load(root)
    assert time.monotonic() - t0 < 2 and fs.fired("f") == 1  # no retry can fix it
    assert ei.value.errno == errno.EACCES and "after 1 try" in str(ei.value), str(ei.value)
    assert marks(backing) == []
