"""The lease of an object-store root: one writing job per ``s3://bucket/prefix`` (a real
SeaweedFS on loopback, a fault proxy where a fault is needed, real processes for other jobs).

Short TTLs (4-6 s) keep the tests quick; every failure path asserts the exact error type and
what the store holds afterwards: nothing committed lost, nothing half-written complete.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same

sys.path.insert(0, str(Path(__file__).parent / "support"))

from _cli_util import option_args
from _s3_worker import state_for
from s3fixtures import (
    SECRET,
    get,
    kill_when_held,
    leave_upload,
    only_committed,
    opts,
    proxy_fixture,
    put,
    require_s3,
    server_fixture,
)
from s3fixtures import data_keys as keys
from s3proxy import FaultProxy, Rule
from s3server import S3Server

import asyncckpt
from asyncckpt import Checkpointer, RootInUseError, SaveError
from asyncckpt.cli import main as cli_main

require_s3()

HERE = Path(__file__).parent
BUCKET = "lease-bucket"
WORKER = str(HERE / "support" / "_s3_worker.py")
OWNER = ".asyncckpt/owner"
TTL = 4.0
pytestmark = pytest.mark.timeout(150)


s3 = server_fixture(BUCKET)
proxy = proxy_fixture()


@pytest.fixture
def url() -> str:
    return f"s3://{BUCKET}/lease-{uuid.uuid4().hex[:10]}"


def owner(endpoint: str, url: str) -> dict[str, Any]:
    rec: dict[str, Any] = json.loads(get(endpoint, url, OWNER))
    return rec


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))


def no_rule(rule: Rule) -> None:
    rule.times = rule.hits  # a rule that no longer matches


def test_a_second_writer_is_refused_naming_the_owner_and_a_released_lease_is_taken_at_once(
    s3: S3Server, url: str, tmp_path: Path
) -> None:
    o = opts(s3.endpoint)
    ck = Checkpointer(url, storage_options=o, lease_ttl=TTL)
    try:
        ck.save(1, state_for(1)).result(timeout=60)
        rec = owner(s3.endpoint, url)
        assert rec["pid"] == os.getpid() and rec["ttl_s"] == TTL and rec["released"] is False
        # the same process: refused once the lease is seen renewed, well before its TTL
        t0 = time.monotonic()
        with pytest.raises(RootInUseError) as ei:
            Checkpointer(url, storage_options=o, lease_ttl=TTL)
        assert time.monotonic() - t0 < TTL
        msg = str(ei.value)
        assert f"pid {os.getpid()}" in msg and socket.gethostname() in msg and "owner since" in msg, msg
        assert SECRET not in msg and "secret" not in msg.lower()
        # another process, another job
        out = tmp_path / "try.json"
        subprocess.run([sys.executable, WORKER, "try", url, json.dumps(o), str(out)], timeout=120, env=env(),
                       capture_output=True)
        res = json.loads(out.read_text())
        assert res["error_type"] == "RootInUseError", res
        assert f"pid {os.getpid()}" in res["message"] and SECRET not in res["message"]
        ck.save(2, state_for(2)).result(timeout=60)  # the owner is unaffected by both refusals
    finally:
        ck.close()
    assert owner(s3.endpoint, url)["released"] is True
    t0 = time.monotonic()
    with Checkpointer(url, storage_options=o, lease_ttl=TTL) as ck2:  # released: no wait for the TTL
        assert time.monotonic() - t0 < TTL
        assert ck2.steps() == [1, 2]
    only_committed(s3.endpoint, url, [1, 2])


def test_release_follows_a_renewal_of_its_own_that_landed_meanwhile(s3: S3Server, url: str) -> None:
    """A renewal cancelled in flight (or whose outcome was unknown) can still land at the
    store and move the lease's ETag under its holder: the release that follows must see its
    own record there, take its ETag and mark it released, not give up as "no longer ours"."""
    o = opts(s3.endpoint)
    ck = Checkpointer(url, storage_options=o, lease_ttl=TTL)
    try:
        rec = owner(s3.endpoint, url)
        rec["seq"] += 1  # what our own renewal would have written: same token, a new ETag
        put(s3.endpoint, url, OWNER, json.dumps(rec, sort_keys=True).encode())
    finally:
        ck.close()
    after = owner(s3.endpoint, url)
    assert after["released"] is True and after["token"] == rec["token"], after
    t0 = time.monotonic()
    with Checkpointer(url, storage_options=o, lease_ttl=TTL):  # taken at once: released, not waited out
        assert time.monotonic() - t0 < TTL


def test_a_process_that_exits_without_close_releases_its_lease(s3: S3Server, url: str, tmp_path: Path) -> None:
    o = opts(s3.endpoint)
    out = tmp_path / "exit.json"
    r = subprocess.run([sys.executable, WORKER, "exit", url, json.dumps(o), str(out)], timeout=120, env=env(),
                       capture_output=True, text=True)
    assert r.returncode == 0 and json.loads(out.read_text()) == {"saved": True}, r.stderr[-3000:]
    assert owner(s3.endpoint, url)["released"] is True
    t0 = time.monotonic()
    with Checkpointer(url, storage_options=o, lease_ttl=TTL) as ck:
        assert time.monotonic() - t0 < TTL and ck.steps() == [1]


def test_a_sigkilled_owner_is_taken_over_after_its_ttl_and_its_leftovers_are_removed(
    s3: S3Server, proxy: FaultProxy, url: str, tmp_path: Path
) -> None:
    o = opts(proxy.endpoint)
    # the killed job's shard and tree land; its commit (the manifest's create) is held
    held = proxy.add(Rule("delay", method="PUT", header=("if-none-match", "*"), path_contains="manifest.json",
                          delay=60.0, times=10**6))
    pid, killed = kill_when_held([WORKER, "save", url, json.dumps(o), str(tmp_path / "x.json"), "7", str(TTL)],
                                 held, "commit")
    proxy.clear()
    leave_upload(s3, url, "step_00000007/a-0123456789abcdef/rank00000.safetensors")  # what a bigger shard leaves
    assert len(keys(s3.endpoint, url)) == 2 and s3.pending_uploads(BUCKET), keys(s3.endpoint, url)
    assert owner(s3.endpoint, url)["pid"] == pid
    with Checkpointer(url, storage_options=o, lease_ttl=TTL) as ck:
        # never before its TTL since the dead job's last renewal (at most TTL/6 before the kill)
        waited = time.monotonic() - killed
        assert TTL - TTL / 6 - 0.3 <= waited <= TTL + 15, waited
        assert owner(s3.endpoint, url)["pid"] == os.getpid()
        assert keys(s3.endpoint, url) == [] and s3.pending_uploads(BUCKET) == []  # removed at construction
        assert ck.latest() is None
        ck.save(7, state_for(7)).result(timeout=60)
    only_committed(s3.endpoint, url, [7])
    assert_same(asyncckpt.load(url, storage_options=o), state_for(7))


def test_a_job_whose_lease_was_taken_over_fails_every_later_save_on_every_rank(
    s3: S3Server, url: str, tmp_path: Path
) -> None:
    """A paused job (SIGSTOP: a GC pause, a VM migration) loses its lease to a new job; when it
    runs again, its saves fail with RootInUseError on both ranks and commit nothing."""
    from _ranks import free_port, log_tail, run_ranks

    o = opts(s3.endpoint)
    port = free_port()
    out = tmp_path / "lease"
    new: list[Checkpointer] = []

    def argv(r: int) -> list[str]:
        return [WORKER, "lease", url, json.dumps(o), f"{out}{r}", str(r), "2", str(port)]

    def take_over(procs: list[subprocess.Popen[bytes]]) -> None:
        end = time.monotonic() + 90
        while not all(Path(f"{out}{r}.ready{r}").exists() for r in range(2)):
            assert time.monotonic() < end and all(p.poll() is None for p in procs), "step 1 never committed"
            time.sleep(0.05)
        os.kill(procs[0].pid, signal.SIGSTOP)  # rank 0 renews the lease: it stops renewing
        try:
            new.append(Checkpointer(url, storage_options=o, lease_ttl=TTL))  # waits for the TTL, takes over
        finally:
            os.kill(procs[0].pid, signal.SIGCONT)
        for r in range(2):
            Path(f"{out}{r}.go").touch()

    hung = run_ranks(argv, 2, tmp_path, deadline=120, on_started=take_over)
    assert not hung, [log_tail(tmp_path, r) for r in hung]
    assert new, "the new job did not start"
    try:
        res = [json.loads(Path(f"{out}{r}").read_text()) for r in range(2)]
        for r in range(2):
            assert "error" not in res[r], (res[r], log_tail(tmp_path, r))
            for step in ("2", "3"):  # the same typed failure on both ranks, every later save
                assert res[r][step] == {"0": "RootInUseError"}, res[r]
                assert res[r][f"{step}-type"] == "SaveError", res[r]
            assert "lost the lease" in res[r]["message"] and f"pid {os.getpid()}" in res[r]["message"]
        assert keys(s3.endpoint, url)[-1] == "step_00000001/manifest.json"  # nothing of the old job's 2 and 3
        assert asyncckpt.find_latest(url, storage_options=o).step == 1  # type: ignore[union-attr]
        new[0].save(2, state_for(2)).result(timeout=60)  # the new owner saves step 2 itself
    finally:
        new[0].close()
    only_committed(s3.endpoint, url, [1, 2])
    assert owner(s3.endpoint, url)["released"] is True


@pytest.mark.parametrize("guard", [True, False], ids=["guarded", "teeth-guard-off"])
def test_a_lease_taken_over_mid_save_fails_that_save_before_its_commit(
    s3: S3Server, proxy: FaultProxy, url: str, guard: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not guard:  # the lease checks off: the job that lost its lease commits (what the guard prevents)
        from asyncckpt.roots.objstore._lease import Lease

        async def confirm(self: Lease, need: float) -> float:
            return time.monotonic() + 60

        monkeypatch.setattr(Lease, "check", lambda self: None)
        monkeypatch.setattr(Lease, "confirm", confirm)
    old = Checkpointer(url, storage_options=opts(proxy.endpoint), lease_ttl=TTL, timeout=60)
    try:
        old.save(1, state_for(1)).result(timeout=60)
        upload = proxy.add(Rule("delay", method="PUT", path_contains="step_00000002/", delay=TTL + 5, times=1))
        renewals = proxy.add(Rule("status", method="PUT", path_contains=OWNER, status=503, times=10**6))
        handle = old.save(2, state_for(2))
        with Checkpointer(url, storage_options=opts(s3.endpoint), lease_ttl=TTL) as new:
            assert upload.hits == 1 and renewals.hits > 0
            no_rule(renewals)  # the old job hears of the takeover at its next renewal
            if not guard:
                handle.result(timeout=60)
                assert asyncckpt.find_latest(url, storage_options=opts(s3.endpoint)).step == 2  # type: ignore[union-attr]
                return
            with pytest.raises(SaveError) as ei:
                handle.result(timeout=60)
            assert type(ei.value) is SaveError and ei.value.failures[0].exc_type == "RootInUseError", ei.value
            with pytest.raises(SaveError):
                old.flush(timeout=30)
            assert asyncckpt.find_latest(url, storage_options=opts(s3.endpoint)).step == 1  # type: ignore[union-attr]
            only_committed(s3.endpoint, url, [1])  # the old job's attempt removed, nothing committed
            new.save(2, {"other": torch.ones(3)}).result(timeout=60)
            with pytest.raises(SaveError) as ei3:
                old.save(3, state_for(3)).result(timeout=60)
            assert ei3.value.failures[0].exc_type == "RootInUseError"
    finally:
        try:
            old.close()
        except SaveError:
            pass  # step 3's failure, not yet flushed
    assert_same(asyncckpt.load(url, storage_options=opts(s3.endpoint)), {"other": torch.ones(3)})
    only_committed(s3.endpoint, url, [1, 2])
    assert owner(s3.endpoint, url)["released"] is True  # by the new owner: the old one left it alone


def test_renewals_failing_for_less_than_the_ttl_cost_a_healthy_job_nothing(
    s3: S3Server, proxy: FaultProxy, url: str
) -> None:
    ttl = 6.0
    o = opts(proxy.endpoint)
    with Checkpointer(url, storage_options=o, lease_ttl=ttl, timeout=20) as ck:
        ck.save(1, state_for(1)).result(timeout=60)
        busy = proxy.add(Rule("status", method="PUT", path_contains=OWNER, status=503, times=10**6))
        start, step = time.monotonic(), 2
        while time.monotonic() - start < ttl / 2:  # 503s on every renewal for half the TTL
            ck.save(step, state_for(step)).result(timeout=60)  # every save still commits
            step += 1
            time.sleep(0.3)
        assert busy.hits >= 2
        no_rule(busy)
        seq = owner(s3.endpoint, url)["seq"]
        end = time.monotonic() + 10
        while owner(s3.endpoint, url)["seq"] == seq and time.monotonic() < end:
            time.sleep(0.1)
        assert owner(s3.endpoint, url)["seq"] > seq, "renewals did not resume"
        with pytest.raises(RootInUseError):  # still held: refused, not taken over
            Checkpointer(url, storage_options=opts(s3.endpoint), lease_ttl=ttl)
        # teeth: failing past the TTL, a commit is refused (the lease may have been taken) ...
        busy = proxy.add(Rule("status", method="PUT", path_contains=OWNER, status=503, times=10**6))
        time.sleep(ttl + 1)
        with pytest.raises(SaveError) as ei:
            ck.save(step, state_for(step)).result(timeout=60)
        assert ei.value.failures[0].exc_type in ("ObjectStoreTimeoutError", "ObjectStoreUnavailableError"), ei.value
        # ... and once the store answers again, the lease nobody took is renewed and saves commit
        no_rule(busy)
        ck.save(step + 1, state_for(step + 1)).result(timeout=60)
        steps = [s for s in range(1, step + 2) if s != step]
        with pytest.raises(SaveError):
            ck.flush(timeout=30)  # the refused save, reported once more
    only_committed(s3.endpoint, url, steps)
    assert_same(asyncckpt.load(url, storage_options=o), state_for(step + 1))


def test_gc_of_a_url_removes_dead_leftovers_under_the_lease_and_is_refused_while_a_job_holds_it(
    s3: S3Server, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    o = opts(s3.endpoint)
    so = option_args(o)
    with Checkpointer(url, storage_options=o, lease_ttl=TTL) as ck:
        for s in (1, 2, 3):
            ck.save(s, state_for(s)).result(timeout=60)
        # what dead jobs leave: a step prefix with no manifest, a loser's objects beside a
        # commit, an incomplete upload, and a step whose manifest is garbage (never removed)
        put(s3.endpoint, url, "step_00000005/a-0000000000000005/rank00000.safetensors", b"x" * 100)
        put(s3.endpoint, url, "step_00000002/a-00000000000000aa/rank00000.json", b"{}")
        leave_upload(s3, url, "step_00000009/a-0000000000000009/rank00000.safetensors")
        put(s3.endpoint, url, "step_00000008/manifest.json", b"garbage")
        capsys.readouterr()
        assert cli_main(["gc", url, "--min-age", "0", *so]) == 1  # a live job holds the lease
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "asyncckpt gc: error:" in err and "already owned" in err, err
        assert f"pid {os.getpid()}" in err and SECRET not in err
        assert cli_main(["gc", url, "--min-age", "0", "--dry-run", "--json", *so]) == 0  # reads only: no lease
        dry = json.loads(capsys.readouterr().out)
        assert dry["dry_run"] and len(dry["removed"]) == 3, dry
    before = keys(s3.endpoint, url)
    assert "step_00000005/a-0000000000000005/rank00000.safetensors" in before and s3.pending_uploads(BUCKET)
    assert cli_main(["gc", url, "--json", *so]) == 0  # the default --min-age keeps fresh leftovers
    doc = json.loads(capsys.readouterr().out)
    assert doc["removed"] == [] and len(doc["kept"]) == 3 and keys(s3.endpoint, url) == before, doc
    assert cli_main(["gc", url, "--keep-last", "2", "--min-age", "0", *so]) == 0
    text = capsys.readouterr().out
    assert "removed step_00000002/a-00000000000000aa/ (objects of an attempt that lost its step's commit" in text
    assert "removed step_00000005/ (leftover of a save or push that never committed" in text
    assert "removed step_00000009/a-0000000000000009/rank00000.safetensors (incomplete multipart upload" in text
    assert "retired step 1" in text and "keeping 2 complete checkpoint(s): step 2, 3" in text, text
    # a manifest that does not decode proves the step damaged: known bad, kept and reported (issue 26)
    assert "kept step_00000008: known bad" in text  # named as a local gc names it
    assert s3.pending_uploads(BUCKET) == []
    assert keys(s3.endpoint, url) == sorted(
        [k for k in before if k.startswith(("step_00000002/a-", "step_00000003/")) and "a-00000000000000aa" not in k]
        + ["step_00000002/manifest.json", "step_00000008/manifest.json"]
    ), keys(s3.endpoint, url)
    assert owner(s3.endpoint, url)["released"] is True and owner(s3.endpoint, url)["role"] == "asyncckpt gc"
    assert_same(asyncckpt.load(url, storage_options=o), state_for(3))


def test_housekeeping_that_fails_never_fails_construction_or_a_save(
    s3: S3Server, proxy: FaultProxy, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Listing incomplete uploads refused (a 403 for ListMultipartUploads, a 500 through every
    retry): the lease and the saves go on, the bucket's lifecycle rule is the fallback."""
    o = opts(proxy.endpoint)
    refused = proxy.add(Rule("status", method="GET", query_has=("uploads",), status=403, code="AccessDenied",
                             times=10**6))
    with Checkpointer(url, storage_options=o, lease_ttl=TTL) as ck:
        ck.save(1, state_for(1)).result(timeout=60)
        refused.status, refused.code = 500, "InternalError"
        ck.save(2, state_for(2)).result(timeout=60)
    assert refused.hits >= 2
    assert "could not list incomplete uploads" in caplog.text
    only_committed(s3.endpoint, url, [1, 2])


@pytest.mark.parametrize("ttl", [0, 1.5, -1, True, "60", float("nan"), 10**6])
def test_a_bad_lease_ttl_raises_at_construction(url: str, ttl: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lease_ttl"):
        Checkpointer(url, lease_ttl=ttl)
    with pytest.raises(ValueError, match="lease_ttl applies to an object-store root"):
        Checkpointer(tmp_path, lease_ttl=60)
    assert not (tmp_path / ".asyncckpt").exists()
