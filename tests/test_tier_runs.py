"""A run is an identity across tiers (issue 26, problem 5), against a real SeaweedFS.

A prefix that holds an older run's higher steps (900, 1000): a tier job refuses lower steps at
``save()`` (before: accepted, then retired on the store at once, and the old run's step 1000
loaded at the next start); ``keep_last_remote`` never retires the step just uploaded nor another
run's steps; a restart resumes its own run's step, never the other run's newer one; an ``s3://``
root carries its run through resumes, and a load asked for one commit refuses another.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same

sys.path.insert(0, str(Path(__file__).parent / "support"))

from s3fixtures import get, opts, require_s3, shared_server
from s3server import S3Server

require_s3()

import asyncckpt  # noqa: E402 - after the skip
from asyncckpt import Checkpointer, CheckpointError, remote  # noqa: E402

BUCKET = "runs-bucket"
pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with shared_server(BUCKET) as server:
        yield server


@pytest.fixture
def url() -> str:
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:10]}"


def state_for(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4096, generator=g), "step": step}


def remote_steps(url: str, o: dict[str, str]) -> list[int]:
    return [s.step for s in remote.scan(url, storage_options=o) if s.complete]


def older_run(root: Path, url: str, o: dict[str, str], steps: tuple[int, ...]) -> str | None:
    """Another job (its own local root) mirrors ``steps`` to ``url``; returns its run id."""
    with Checkpointer(root, mirror=url, storage_options=o) as ck:
        for s in steps:
            ck.save(s, state_for(s))
            ck.flush(timeout=60)  # each one uploaded (a waiting step would be superseded)
        return getattr(ck, "run_id", None)


def test_a_tier_job_on_a_prefix_holding_higher_steps_refuses_lower_steps_at_save(
    tmp_path: Path, s3: S3Server, url: str
) -> None:
    """The outsiders' reproduction: an empty local root, the prefix holds 900 and 1000.
    Nothing says this is not a resume of that run, so it is one: latest() says 1000, and a
    lower step is refused at save() with ValueError (before: accepted, then retired remotely)."""
    o = opts(s3.endpoint)
    old = older_run(tmp_path / "old", url, o, (900, 1000))
    with Checkpointer(tmp_path / "new", mirror=url, keep_last_remote=1, storage_options=o) as ck:
        latest = ck.latest()
        assert isinstance(latest, remote.RemoteCheckpointInfo) and latest.step == 1000
        for s in (1, 2, 999):
            with pytest.raises(ValueError, match="lower than step 1000, the newest committed checkpoint on the store"):
                ck.save(s, state_for(s))
        with pytest.raises(ValueError, match="already committed on the store"):
            ck.save(1000, state_for(1000))
        ck.flush(timeout=60)
        assert remote_steps(url, o) == [900, 1000]  # nothing uploaded, nothing retired
        assert ck.run_id == old and latest.run == old  # a resume of the store's run
        assert_same(ck.load(), state_for(1000))
        ck.save(1001, state_for(1001))  # the run goes on above it
        ck.flush(timeout=60)
    assert remote_steps(url, o) == [1001]  # keep_last_remote=1, within the run
    assert json.loads(get(s3.endpoint, url, "step_00001001/manifest.json"))["run"] == old


def test_a_local_run_resumes_its_own_step_never_the_stores_newer_step_of_another_run(
    tmp_path: Path, s3: S3Server, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The local root holds this run's steps 1-2, the prefix another run's 900-1000: the local
    run wins (the job continues it), load() restores step 2 (before: the other run's 1000),
    a WARNING names the other run, save(3) is refused (the store's steps count), and only an
    explicit load(step=1000) reads the other run's step."""
    o = opts(s3.endpoint)
    other = older_run(tmp_path / "other", url, o, (900, 1000))
    root = tmp_path / "mine"
    with Checkpointer(root) as ck:  # this run's steps are on the local disk only
        ck.save(1, state_for(1))
        ck.save(2, state_for(2))
        mine = getattr(ck, "run_id", None)
    with caplog.at_level("WARNING", logger="asyncckpt"), \
            Checkpointer(root, mirror=url, storage_options=o) as ck:
        assert_same(ck.load(), state_for(2))
        latest = ck.latest()
        assert isinstance(latest, asyncckpt.CheckpointInfo) and latest.step == 2 and latest.run == mine
        assert ck.run_id == mine != other
        with pytest.raises(ValueError, match="another run"):
            ck.save(3, state_for(3))
        assert_same(ck.load(step=1000), state_for(1000))  # asked for by step: loaded, and said
        ck.flush(timeout=60)  # the construction uploaded the local newest step
    text = caplog.text
    assert f"run {other[:12]}" in text and "another run" in text, text
    assert remote_steps(url, o) == [2, 900, 1000]  # the other run's steps stay


def test_keep_last_remote_never_retires_the_step_just_uploaded_nor_another_runs_steps(
    tmp_path: Path, s3: S3Server, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Another run's 900-1000 land on the prefix after this job was built (its construction saw
    an empty store, so save(1) is accepted): the upload of step 1 stays (before: keep_last_remote=1
    retired it at once, 1000 being newer), a WARNING says the store holds a higher step, and a
    restart resumes step 2 of this run, never the other run's 1000."""
    o = opts(s3.endpoint)
    root = tmp_path / "mine"
    with caplog.at_level("WARNING", logger="asyncckpt"), \
            Checkpointer(root, mirror=url, keep_last_remote=1, storage_options=o) as ck:
        mine = getattr(ck, "run_id", None)
        older_run(tmp_path / "other", url, o, (900, 1000))  # before this job's first upload (its lease)
        ck.save(1, state_for(1))
        ck.flush(timeout=60)
        assert remote_steps(url, o) == [1, 900, 1000]
        ck.save(2, state_for(2))
        ck.flush(timeout=60)
        assert remote_steps(url, o) == [2, 900, 1000]  # this run's older step goes, another run's never
    assert "already holds step 1000" in caplog.text
    with Checkpointer(root, mirror=url, keep_last_remote=1, storage_options=o) as ck:
        assert ck.run_id == mine
        latest = ck.latest()
        assert latest is not None and latest.step == 2
        assert_same(ck.load(), state_for(2))
        with pytest.raises(ValueError, match="lower than step 1000"):
            ck.save(3, state_for(3))


def test_an_object_store_root_carries_its_run_and_a_load_of_one_commit_refuses_another(
    tmp_path: Path, s3: S3Server, url: str
) -> None:
    from asyncckpt.loading import _resume
    from asyncckpt.roots import open_root

    o = opts(s3.endpoint)
    with Checkpointer(url, storage_options=o, timeout=60) as ck:
        run = ck.run_id
        ck.save(1, state_for(1))
    assert json.loads(get(s3.endpoint, url, "step_00000001/manifest.json"))["run"] == run
    with Checkpointer(url, storage_options=o, timeout=60) as ck:
        assert ck.run_id == run  # resumed: the same run
        latest = ck.latest()
        assert latest is not None and latest.run == run
        ck.save(2, state_for(2))
    found = asyncckpt.find_latest(url, storage_options=o)
    assert isinstance(found, remote.RemoteCheckpointInfo) and found.step == 2 and found.run == run
    assert [s.run for s in remote.scan(url, storage_options=o)] == [run, run]
    store = open_root(url, storage_options=o)
    assert_same(_resume.load_step(store, 2, rank=0, verify=True, expect=found.attempt), state_for(2))
    with pytest.raises(CheckpointError, match="rank 0 chose") as ei:
        _resume.load_step(store, 2, rank=0, verify=True, expect="0" * 16)
    assert type(ei.value) is CheckpointError  # not corrupt: nothing marked, no fallback
