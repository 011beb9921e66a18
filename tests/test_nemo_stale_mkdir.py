"""NeMo Automodel 0.7.0's own directory creation under the stale-mkdir FUSE fault, with and
without the asyncckpt patch (``_nemo.patch``: ``ensure_dir`` + ``on_every_rank``).

The fault is the seed's: ``mkdir`` answers EEXIST (another client made the directory)
while ``stat`` cannot see it for a while (a stale attribute / negative-dentry cache on
virtiofs, NFS, Lustre). NeMo's ``_create_dirs`` (``os.makedirs(exist_ok=True)`` plus one
``isdir`` re-check) raises the seed's ``FileExistsError`` even for a 10 ms window; its
``_ensure_dirs`` then leaves the healthy ranks in a barrier for as long as the failed rank
lives. Patched, the same calls succeed (the window is ridden out), or every rank raises the
same ``RanksFailedError`` naming the failed rank within the deadline.

NeMo's functions come from the real package (see ``_nemo``); without it these tests skip
with a reason starting ``needs nemo-automodel/``.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import _nemo
import pytest
from _ranks import free_port, log_tail, run_ranks
from faultfs import FaultFS, mounted, rule

import asyncckpt

WORKER = str(Path(__file__).parent / "support" / "_nemo_worker.py")
WORLD = 4


@pytest.fixture(scope="module")
def nemo() -> SimpleNamespace:
    ns = _nemo.load()
    if ns is None:
        pytest.skip(_nemo.SKIP)
    return ns


@pytest.fixture(scope="module")
def mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFS]:
    base = tmp_path_factory.mktemp("nemofuse")
    with mounted(base / "backing", base / "mnt", skip_unavailable=True) as fs:
        yield fs


@pytest.fixture
def fs(mount: FaultFS) -> Iterator[FaultFS]:
    mount.clear()
    mount.reset_events()
    yield mount
    mount.clear()


@pytest.mark.needs_root
@pytest.mark.parametrize("stale_s", [0.01, 0.5])
def test_nemo_create_dirs_raises_the_seed_error_and_the_patch_rides_it_out(
    nemo: SimpleNamespace, fs: FaultFS, stale_s: float
) -> None:
    base = fs.path(f"nemo-{stale_s}")
    os.mkdir(base)
    fs.set_rules([rule("mkdir", glob=f"/nemo-{stale_s}/*/epoch_1_step_297/rng", stale_s=stale_s, id="stale")])
    plain = os.path.join(base, "plain", "epoch_1_step_297", "rng")
    with pytest.raises(FileExistsError) as ei:
        nemo.module._create_dirs(plain)
    assert ei.value.errno == errno.EEXIST and ei.value.filename == plain  # the seed's error, verbatim
    print(f"\nnemo-automodel {_nemo.VERSION} ({nemo.source}) _create_dirs, {stale_s * 1000:.0f} ms stale window: "
          f"{ei.value!r}")

    patched = SimpleNamespace(module=SimpleNamespace(is_cloud_path=nemo.module.is_cloud_path))
    _nemo.patch(patched, mkdir_timeout=10.0)
    target = os.path.join(base, "patched", "epoch_1_step_297", "rng")
    t0 = time.monotonic()
    patched.module._create_dirs(target)
    took = time.monotonic() - t0
    print(f"patched _create_dirs: ok after {took:.3f}s")
    assert fs.fired("stale") == 2  # both calls met the fault
    assert os.path.isdir(target) and took >= stale_s * 0.9
    assert took < stale_s + 2.0


def _events(tmp_path: Path) -> list[dict[str, Any]]:
    out = []
    for r in range(WORLD):
        p = tmp_path / f"events{r}.jsonl"
        if p.exists():
            out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return out


def _launch(tmp_path: Path, fs: FaultFS, mode: str, deadline: float) -> list[dict[str, Any]]:
    port = free_port()
    base = fs.path(f"ranks-{mode}")
    os.mkdir(base)
    hung = run_ranks(
        lambda r: [WORKER, mode, str(r), str(WORLD), str(port), base, str(tmp_path / f"events{r}.jsonl")],
        WORLD,
        tmp_path,
        deadline,
    )
    assert not hung, f"ranks {hung} hung: {log_tail(tmp_path, hung[0])}"
    return _events(tmp_path)


def _one(events: list[dict[str, Any]], rank: int, kind: str, step: str) -> dict[str, Any]:
    found = [e for e in events if e["rank"] == rank and e["event"] == kind and e.get("step") == step]
    assert len(found) == 1, (rank, kind, step, events)
    return found[0]


@pytest.mark.needs_root
def test_nemo_ensure_dirs_leaves_healthy_ranks_in_the_barrier_while_the_failed_rank_lives(
    nemo: SimpleNamespace, fs: FaultFS, tmp_path: Path
) -> None:
    from _nemo_worker import HOLD_S

    fs.set_rules([rule("mkdir", glob="/ranks-plain/epoch_1_step_297/rank2", stale_s=0.5, id="stale")])
    ev = _launch(tmp_path, fs, "plain", deadline=60)
    step = "epoch_1_step_297"
    failed = _one(ev, 2, "raised", step)
    assert failed["type"] == "FileExistsError", failed
    gone = next(e for e in ev if e["rank"] == 2 and e["event"] == "exit")["t"]
    for r in (0, 1, 3):
        # healthy ranks: never returned while rank 2 lived; they fell out of the barrier only
        # when it exited, with an error that names no rank and no cause
        assert not [e for e in ev if e["rank"] == r and e["event"] == "returned"], ev
        out = _one(ev, r, "raised", step)
        assert out["t"] >= gone - 0.05 and out["t"] - failed["t"] >= HOLD_S - 0.5, (out, failed)
        assert "FileExistsError" not in out["msg"] and "rank 2" not in out["msg"], out
    waited = min(_one(ev, r, "raised", step)["t"] for r in (0, 1, 3)) - failed["t"]
    print(f"\nnemo _ensure_dirs: rank 2 raised FileExistsError; ranks 0,1,3 sat in the barrier {waited:.1f}s "
          f"(as long as rank 2 lived), then: {_one(ev, 0, 'raised', step)['msg'].splitlines()[0][:120]}")


@pytest.mark.needs_root
def test_patched_nemo_ensure_dirs_succeeds_or_fails_on_every_rank_naming_rank_2(
    nemo: SimpleNamespace, fs: FaultFS, tmp_path: Path
) -> None:
    fs.set_rules([
        rule("mkdir", glob="/ranks-patched/epoch_1_step_297/rank2", stale_s=0.5, id="stale"),
        rule("mkdir", glob="/ranks-patched/epoch_1_step_298/rank2", stale_s=3600, id="never"),
    ])  # fmt: skip
    ev = _launch(tmp_path, fs, "patched", deadline=90)
    assert fs.fired("stale") == 1 and fs.fired("never") == 1
    # a stale window: ensure_dir rides it out, every rank returns
    ok = [_one(ev, r, "returned", "epoch_1_step_297") for r in range(WORLD)]
    assert all(os.path.isdir(fs.path("ranks-patched", "epoch_1_step_297", f"rank{r}")) for r in range(WORLD))
    # a directory that never appears: every rank raises the same RanksFailedError naming rank 2
    # (StaleDirectoryError, EEXIST, its path) within the mkdir deadline (1 s) plus a little
    bad = [_one(ev, r, "raised", "epoch_1_step_298") for r in range(WORLD)]
    for b in bad:
        assert b["type"] == "RanksFailedError", b
        assert list(b["failures"]) == ["2"], b
        exc_type, err, path = b["failures"]["2"]
        assert exc_type == "StaleDirectoryError" and err == errno.EEXIST, b
        assert path == fs.path("ranks-patched", "epoch_1_step_298", "rank2"), b
        assert b["s"] < 1.0 + 5.0, b
    print(f"\npatched: stale window ridden out in {max(o['s'] for o in ok):.2f}s on every rank; "
          f"never-visible directory: RanksFailedError on all 4 ranks after {max(b['s'] for b in bad):.2f}s "
          f"naming rank 2")
    assert isinstance(asyncckpt.RanksFailedError("x", {}), asyncckpt.CheckpointError)
