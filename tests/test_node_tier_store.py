"""The node-local tier with its persistent tier (``node_local=True, mirror="s3://..."``): every
rank uploads its own files, rank 0 commits on the store; a real SeaweedFS on loopback, 2 nodes
x 2 ranks in private mount namespaces (``test_node_tier``). Needs root and the s3 extra."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _ranks import free_port
from s3fixtures import keys, opts, proxy_fixture, require_s3, running_server
from s3proxy import FaultProxy, Rule
from s3server import S3Server
from test_node_tier import _nodes, _run, _steps

require_s3()
BUCKET = "node-tier"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with running_server(BUCKET) as server:
        yield server


@pytest.fixture(autouse=True)
def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip(f"needs root/mount namespaces: bind mounts in a private mount namespace (euid {os.geteuid()})")


def _log(tmp_path: Path, tag: str, rank: int) -> str:
    return (tmp_path / tag / f"rank{rank}.log").read_text(errors="replace")


def _tier(endpoint: str, timeout: int, **more: str) -> tuple[str, dict[str, str]]:
    """A fresh prefix of the bucket and the ranks' environment for a store at ``endpoint``."""
    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:10]}"
    return url, {"MIRROR": url, "S3OPTS": json.dumps(opts(endpoint)), "CK_TIMEOUT": str(timeout), **more}


def _saved(res: dict[int, dict[str, Any]], steps: list[int]) -> dict[int, dict[str, Any]]:
    """``res`` of a run in which every rank saved ``steps`` and flushed without an error."""
    for r, got in res.items():
        assert got["saved"] == steps and got.get("flush_error") is None, (r, got)
    return res


@pytest.mark.needs_root
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_wiped_node_resumes_its_ranks_from_the_store_and_the_others_from_their_disk(
    tmp_path: Path, s3: S3Server
) -> None:
    a, b = _nodes(tmp_path)
    url, env = _tier(s3.endpoint, 30)
    _saved(_run(tmp_path, "first", (a, b), STEPS="1,2", KEEP_LAST="1", **env), [1, 2])
    stored = keys(s3.endpoint, url)
    assert "step_00000002/manifest.json" in stored, stored
    for r in range(4):  # every rank's files landed, under the committed attempt
        assert any(k.startswith("step_00000002/a-") and k.endswith(f"rank{r:05d}.safetensors") for k in stored)
    shutil.rmtree(b)
    b.mkdir()
    res = _run(tmp_path, "wiped", (a, b), **env)
    for r, got in res.items():
        assert got["loaded"] == 2 and got["equal"], got
        # same step, same attempt: node a's ranks read their own disk, node b's the store
        where = "the store" if r >= 2 else "its node's disk"
        assert f"rank {r}: loading step 2 from {where}" in _log(tmp_path, "wiped", r)


@pytest.mark.needs_root
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_store_outage_during_uploads_fails_them_on_every_rank_and_loses_no_save(
    tmp_path: Path, s3: S3Server
) -> None:
    a, b = _nodes(tmp_path)
    url, down = _tier(f"http://127.0.0.1:{free_port()}", 20)
    res = _run(tmp_path, "outage", (a, b), STEPS="1,2,3", KEEP_LAST="1", **down)
    for r, got in res.items():
        assert got["saved"] == [1, 2, 3], got  # the node-local commits went on
        err = got["flush_error"]
        assert err["type"] == "SaveError", (r, err)  # named on every rank
        assert f"upload to {url} failed" in err["msg"], (r, err)
    # no step left the disks before it was on the store: keep_last=1 kept all three
    assert _steps(a) == [1, 2, 3] and _steps(b) == [1, 2, 3]
    up = {**down, "S3OPTS": json.dumps(opts(s3.endpoint)), "CK_TIMEOUT": "30"}
    for got in _saved(_run(tmp_path, "back", (a, b), STEPS="4", KEEP_LAST="1", **up), [4]).values():
        assert got["loaded"] == 3 and got["equal"], got
    assert "step_00000004/manifest.json" in keys(s3.endpoint, url)


proxy = proxy_fixture()


@pytest.mark.slow  # > 15 s on a quiet 2-core machine: make test-slow (and CI) runs it
@pytest.mark.needs_root
@pytest.mark.timing
@pytest.mark.timeout(400)
def test_a_store_that_stops_answering_uploads_fails_the_round_naming_every_ranks_timeout(
    tmp_path: Path, s3: S3Server, proxy: FaultProxy
) -> None:
    # every rank's PUT of its files hangs: each upload gives up before the round's deadline (the
    # client's retries stop when another try cannot fit), so the exchange of outcomes still hears
    # every rank's own timeout, not "a rank did not take part" (passed before: a regression guard)
    a, b = _nodes(tmp_path)
    url, env = _tier(proxy.endpoint, 8)
    proxy.add(Rule("hang", method="PUT", path_regex=r"rank\d+\.(safetensors|json)$", times=1000))
    res = _run(tmp_path, "hung", (a, b), STEPS="1", **env)
    for r, got in res.items():
        assert got["saved"] == [1], got  # the node-local commit went on
        err = got["flush_error"]
        assert err["type"] == "SaveError" and f"upload to {url} failed" in err["msg"], (r, err)
        assert sorted(err["failures"]) == ["0", "1", "2", "3"], (r, err)  # every rank's own error, heard by all
        for f in err["failures"].values():
            assert "Timeout" in f["exc_type"], (r, err)
    assert _steps(a) == [1] and _steps(b) == [1]


@pytest.mark.slow  # > 15 s on a quiet 2-core machine: make test-slow (and CI) runs it
@pytest.mark.needs_root
@pytest.mark.timing
@pytest.mark.timeout(400)
def test_a_slow_remote_retention_never_fails_the_upload_round_on_the_other_ranks(
    tmp_path: Path, s3: S3Server, proxy: FaultProxy
) -> None:
    # rank 0 ran remote retention (keep_last_remote=1: step 1 retired after step 2 landed)
    # before it published the round's outcome; the others wait for it only until the round's
    # deadline + 5 s, and retention had a fresh timeout of its own: with slow uploads (6 s) and
    # a store slow to delete (25 s, 20 s deadline), the others failed step 2's upload that rank 0
    # committed; and while rank 0 was still retiring, the others' round of step 3 ran out
    a, b = _nodes(tmp_path)
    url, env = _tier(proxy.endpoint, 20, KEEP_LAST_REMOTE="1")
    proxy.add(Rule("delay", method="PUT", path_regex=r"rank\d+\.(safetensors|json)$", delay=6.0, times=1000))
    proxy.add(Rule("delay", query_has=("delete",), body_regex=rb"step_00000001/", delay=25.0, times=1000))
    proxy.add(Rule("delay", method="DELETE", path_contains="step_00000001", delay=25.0, times=1000))
    _saved(_run(tmp_path, "slow", (a, b), STEPS="1,2,3", **env), [1, 2, 3])
    assert "step_00000003/manifest.json" in keys(s3.endpoint, url)


@pytest.mark.needs_root
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_mirror_every_uploads_every_nth_commit_and_the_disks_keep_the_steps_not_uploaded(
    tmp_path: Path, s3: S3Server
) -> None:
    a, b = _nodes(tmp_path)
    url, env = _tier(s3.endpoint, 30, MIRROR_EVERY="2")
    # killed after flush() (no close()): the 1st and 3rd commits only
    _saved(_run(tmp_path, "every-2", (a, b), STEPS="1,2,3,4", KEEP_LAST="1", KILL_AFTER_FLUSH="1", **env),
           [1, 2, 3, 4])  # fmt: skip
    assert _stored(s3, url) == [1, 3]
    # keep_last=1, but step 4 is on no store: the disks keep it (retention runs at the next commit)
    assert {3, 4} <= set(_steps(a)) and {3, 4} <= set(_steps(b))
    # close() uploads the newest commit mirror_every skipped: a run's last step reaches the store
    # (a prefix of its own: the killed job's lease on the first one is not expired yet)
    url, env = _tier(s3.endpoint, 30, MIRROR_EVERY="2")
    _saved(_run(tmp_path, "closed", (a, b), STEPS="5,6", KEEP_LAST="1", **env), [5, 6])
    assert _stored(s3, url) == [5, 6]


@pytest.mark.needs_root
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_sigterm_uploads_the_newest_commit_mirror_every_skipped(tmp_path: Path, s3: S3Server) -> None:
    # a preempted job (SIGTERM to every rank, no flush() or close() of its own): the handler's
    # flush uploaded nothing mirror_every had skipped, and the node's disk goes with the node
    a, b = _nodes(tmp_path)
    url, env = _tier(s3.endpoint, 30, MIRROR_EVERY="3")
    res = _run(tmp_path, "preempted", (a, b), STEPS="1,2,3", SIGTERM_AT_END="1", **env)
    for r, got in res.items():
        assert got["saved"] == [1, 2, 3] and got.get("sigterm_flushed"), (r, got)
    assert _stored(s3, url) == [1, 3]


@pytest.mark.needs_root
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_mirror_every_by_time_uploads_the_commits_rank_0s_clock_picks_and_close_the_last_one(
    tmp_path: Path, s3: S3Server
) -> None:
    from test_every_time import EVERY_S, GAPS, decided, margin

    a, b = _nodes(tmp_path)  # node a's ranks and node b's sleep differently before each save
    gaps = ";".join([GAPS["a"]] * 2 + [GAPS["b"]] * 2)
    url, env = _tier(s3.endpoint, 30, MIRROR_EVERY_S=str(EVERY_S), SAVE_GAPS=gaps)
    res = _saved(_run(tmp_path, "by-time", (a, b), STEPS="1,2,3,4,5", **env), [1, 2, 3, 4, 5])
    calls0 = res[0]["calls"]
    assert margin(calls0, EVERY_S) > 0.05, calls0  # (else the test itself could not tell)
    assert decided(calls0, EVERY_S) == [True, True, False, True, False], calls0  # rank 0's clock
    assert decided(res[2]["calls"], EVERY_S) != decided(calls0, EVERY_S), res[2]["calls"]  # rank 2's would differ
    # every rank uploaded its files of the same commits (the rounds stayed aligned); close()
    # uploaded the newest one the rule skipped, step 5
    assert _stored(s3, url) == [1, 2, 4, 5]


@pytest.mark.needs_root
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_final_save_on_sigterm_goes_to_every_tier_whatever_the_frequencies(tmp_path: Path, s3: S3Server) -> None:
    # disk_every=5: the handler's final save (the 3rd) was due for memory only; a preempted node's
    # memory and disk go with it, so the final save reached neither the disks nor the store
    from test_node_memory import Cluster
    from test_node_replica import shm_dir

    with shm_dir() as shm:
        c = Cluster(tmp_path, shm)
        url, env = _tier(s3.endpoint, 30, DISK_EVERY="5", MIRROR_EVERY="5")
        res, _ = c.run("preempted", STEPS="1,2", SIGTERM_AT_END="1", FINAL_STEP="3", **env)
        for r, got in res.items():
            assert got["saved"] == [1, 2] and got.get("sigterm_flushed"), (r, got)
        assert _steps(c.a) == [1, 3] and _steps(c.b) == [1, 3]  # step 2: memory only, as due
        assert _stored(s3, url) == [1, 3]


def _stored(s3: S3Server, url: str) -> list[int]:
    """The steps committed on the store under ``url``."""
    return sorted(int(k[5:13]) for k in keys(s3.endpoint, url) if k.endswith("/manifest.json"))


@pytest.mark.needs_root
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_corrupt_memory_copy_on_a_wiped_disk_falls_back_to_the_store_of_the_same_step(
    tmp_path: Path, s3: S3Server
) -> None:
    from test_node_memory import Cluster

    shm = Path("/dev/shm") / f"asyncckpt-test-{uuid.uuid4().hex[:12]}"
    shm.mkdir()
    try:
        c = Cluster(tmp_path, shm)
        url, env = _tier(s3.endpoint, 30, KILL_AFTER_FLUSH="1")
        c.save("first", [1, 2], **env)
        assert "step_00000002/manifest.json" in keys(s3.endpoint, url)
        shutil.rmtree(c.b)  # node b's disk replaced, its memory kept (the processes restarted)
        c.b.mkdir()
        shard = c.mb / "step_00000002" / "rank00002.safetensors"
        raw = bytearray(shard.read_bytes())
        raw[-100] ^= 0xFF  # and rank 2's memory copy corrupt: same size, one byte flipped
        shard.write_bytes(bytes(raw))
        res, logs = c.run("restart", **env)
        for r, got in res.items():
            assert got.get("load_error") is None and got["loaded"] == 2 and got["equal"], (r, got)
        assert "falling back to the same step from the store" in logs[2], logs[2][-3000:]
        assert "rank 2: loading step 2 from the store" in logs[2]
        for r in (0, 1, 3):
            assert f"rank {r}: loading step 2 from its node's memory tier" in logs[r], logs[r][-3000:]
            assert "from the store" not in logs[r]
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.needs_root
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_with_disk_every_mirror_every_counts_the_disk_commits_and_no_memory_only_step_is_uploaded(
    tmp_path: Path, s3: S3Server
) -> None:
    from test_node_memory import Cluster
    from test_node_replica import shm_dir

    with shm_dir() as shm:
        c = Cluster(tmp_path, shm)
        url, env = _tier(s3.endpoint, 30, DISK_EVERY="2", MIRROR_EVERY="2")
        c.save("first", [1, 2, 3, 4, 5], **env)  # the disks take 1, 3, 5; the store their 1st and 3rd
        assert _steps(c.a) == [1, 3, 5] and _steps(c.b) == [1, 3, 5]
        assert _stored(s3, url) == [1, 5]
