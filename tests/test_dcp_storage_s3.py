"""The DCP storage layer on an object store: ``dcp.save``/``async_save``/``load`` on ``s3://``.

Against a real SeaweedFS on loopback: a round trip in one process is a normal step on the store
(``find_latest``, ``asyncckpt.load``, ``Checkpointer.load(into=...)``, ``asyncckpt ls``/``verify``
read it; exactly the attempt's objects and the manifest are there), a step is never
overwritten, a flipped byte in an object makes ``dcp.load`` raise, a job holding the prefix
refuses the commit, SIGKILL at random points of a save never leaves a step a reader takes;
FSDP2 saved on 4 gloo ranks loads on 2 bit for bit (``dcp.load`` and a Checkpointer).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

sys.path.insert(0, str(Path(__file__).parent / "support"))

from _cli_util import option_args
from _ranks import free_port, log_tail, run_ranks
from s3fixtures import data_keys, get, opts, put, require_s3, server_fixture
from s3proxy import FaultProxy, Rule
from s3server import S3Server
from test_dcp_storage import _blank, _only_failure, _same, _state

import asyncckpt
from asyncckpt import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConditionalWriteUnsupportedError,
    RootInUseError,
)
from asyncckpt.cli import main as cli_main
from asyncckpt.integrations.dcp import StorageReader, StorageWriter

require_s3()

BUCKET = "dcp-bucket"
WORKER = str(Path(__file__).parent / "support" / "_dcp_worker.py")
pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]
s3 = server_fixture(BUCKET)


@pytest.fixture
def url() -> str:
    return f"s3://{BUCKET}/dcp-{uuid.uuid4().hex[:10]}"


def test_round_trip_on_a_store_is_a_normal_step(s3: S3Server, url: str, capsys: pytest.CaptureFixture[str]) -> None:
    o = opts(s3.endpoint)
    src = _state()
    src["model"]["big"] = torch.randn(5 << 20, generator=torch.Generator().manual_seed(1))  # 20 MiB: 2 parts
    dcp.save(src, storage_writer=StorageWriter(url, step=3, storage_options=o))
    dcp.async_save(src, storage_writer=StorageWriter(url + "/step_00000004", storage_options=o)).result(60)
    dcp.save(src, checkpoint_id=url + "/step_00000005", storage_writer=StorageWriter(url, step=99, storage_options=o))
    for step in (3, 4, 5):
        out = _blank()
        out["model"]["big"] = torch.zeros(5 << 20)
        dcp.load(out, storage_reader=StorageReader(url, step=step, storage_options=o))
        assert _same(out, src), step
    # on the store: the manifest and exactly the attempt's objects it names (no pickle anywhere)
    keys = [k for k in data_keys(s3.endpoint, url) if k.startswith("step_00000003/")]
    attempt = json.loads(get(s3.endpoint, url, "step_00000003/manifest.json"))["attempt"]
    assert keys == sorted(["step_00000003/manifest.json"] + [
        f"step_00000003/a-{attempt}/{n}"
        for n in ("dcp.json", "index.json", "rank00000.json", "rank00000.safetensors")
    ]), keys  # fmt: skip
    # a step like any other: found, loaded without DCP, into a Checkpointer's targets, listed, verified
    assert asyncckpt.find_latest(url, storage_options=o).step == 5  # type: ignore[union-attr]
    assert _same(asyncckpt.load(url, step=3, storage_options=o), src)
    into = _blank()
    into["model"]["big"] = torch.zeros(5 << 20)
    with asyncckpt.Checkpointer(url, storage_options=o) as ck:
        ck.load(4, into=into)
    assert _same(into["model"], src["model"]) and _same(into["ints"], src["ints"])
    assert cli_main(["verify", url, "--all", *option_args(o)]) == 0
    assert "3 of 3 checkpoints ok" in capsys.readouterr().out
    assert cli_main(["ls", url, *option_args(o)]) == 0
    listed = capsys.readouterr().out
    assert all(f"{s}" in listed for s in (3, 4, 5)) and "step_00000005" in listed, listed
    # a step is never overwritten: refused before anything is uploaded
    before = data_keys(s3.endpoint, url)
    with pytest.raises(CheckpointException) as ei:
        dcp.save(_state(1), storage_writer=StorageWriter(url, step=3, storage_options=o))
    err = _only_failure(ei.value)
    assert isinstance(err, FileExistsError) and "never overwrites" in str(err), err
    assert data_keys(s3.endpoint, url) == before


def test_a_flipped_byte_in_an_object_makes_dcp_load_raise(s3: S3Server, url: str) -> None:
    o = opts(s3.endpoint)
    dcp.save(_state(), storage_writer=StorageWriter(url, step=1, storage_options=o))
    attempt = json.loads(get(s3.endpoint, url, "step_00000001/manifest.json"))["attempt"]
    key = f"step_00000001/a-{attempt}/rank00000.safetensors"
    raw = bytearray(get(s3.endpoint, url, key))
    raw[-3] ^= 0x10  # inside the last tensor's bytes; the size stays, so the step still lists complete
    put(s3.endpoint, url, key, bytes(raw))
    with pytest.raises(CheckpointException) as ei:
        dcp.load(_blank(), storage_reader=StorageReader(url, step=1, storage_options=o))
    err = _only_failure(ei.value)
    assert isinstance(err, CheckpointCorruptError) and "checksum mismatch" in str(err), err
    assert err.path == f"{url}/{key}"
    assert cli_main(["verify", url, "--step", "1", *option_args(o)]) == 1


def test_the_commit_is_refused_while_another_job_holds_the_prefix(s3: S3Server, url: str) -> None:
    o = opts(s3.endpoint)
    with asyncckpt.Checkpointer(url, storage_options=o, lease_ttl=3) as ck:
        ck.save(1, {"w": torch.ones(3)}).result(60)
        with pytest.raises(CheckpointException) as ei:
            dcp.save(_state(), storage_writer=StorageWriter(url, step=2, storage_options=o, timeout=30))
        err = _only_failure(ei.value)
        assert isinstance(err, RootInUseError) and "already owned" in str(err), err
    assert "step_00000002/manifest.json" not in data_keys(s3.endpoint, url)
    # released: the same save commits, and the Checkpointer's step is still there beside it
    dcp.save(_state(), storage_writer=StorageWriter(url, step=2, storage_options=o))
    out = _blank()
    dcp.load(out, storage_reader=StorageReader(url, step=2, storage_options=o))
    assert _same(out, _state())
    assert [i.step for i in asyncckpt.remote.scan(url, storage_options=o) if i.complete] == [1, 2]


_KILL_CHILD = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed.checkpoint as dcp
    from asyncckpt.integrations.dcp import StorageWriter
    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(1 << 20, generator=g) for i in range(8)}  # 32 MiB: 2 parts
    state["meta"] = {"n": 8}
    w = StorageWriter(sys.argv[1], step=1, storage_options=json.loads(sys.argv[2]), lease_ttl=2)
    print("ready", flush=True)
    dcp.save(state, storage_writer=w)
    print("saved", flush=True)
    """
)


def _child(url: str, o: dict[str, str]) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, url, json.dumps(o)], stdout=subprocess.PIPE, text=True,
                         env=env)  # fmt: skip
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _blank_kill() -> dict[str, Any]:
    state: dict[str, Any] = {f"t{i}": torch.zeros(1 << 20) for i in range(8)}
    state["meta"] = {}
    return state


def test_a_store_that_ignores_conditional_creates_is_refused_before_any_upload(s3: S3Server, url: str) -> None:
    proxy = FaultProxy(s3.s3_port, max_lifetime=120).start()
    try:
        proxy.add(Rule("strip_header", method="PUT", header=("if-none-match", "*"), times=10**6))
        o = opts(proxy.endpoint)
        with pytest.raises(CheckpointException) as ei:
            dcp.save(_state(), storage_writer=StorageWriter(url, step=1, storage_options=o))
        assert isinstance(_only_failure(ei.value), ConditionalWriteUnsupportedError), ei.value
        assert data_keys(s3.endpoint, url) == []  # nothing uploaded: two commits could both "win"
    finally:
        proxy.stop()


@pytest.mark.slow  # 4 kills of 2 ranks; the POSIX twin in test_dcp_storage.py stays
def test_a_kill_mid_save_never_leaves_a_step_dcp_would_load(s3: S3Server) -> None:
    o = opts(s3.endpoint)
    whole = f"s3://{BUCKET}/kill-{uuid.uuid4().hex[:8]}"
    p = _child(whole, o)
    t0 = time.monotonic()
    assert p.stdout is not None and p.stdout.readline().strip() == "saved"
    took = time.monotonic() - t0
    assert p.wait(60) == 0
    p.stdout.close()
    ref = _blank_kill()
    dcp.load(ref, storage_reader=StorageReader(whole, step=1, storage_options=o))
    rng = random.Random(29)
    outcomes = []
    for _ in range(4):
        url = f"s3://{BUCKET}/kill-{uuid.uuid4().hex[:8]}"
        p = _child(url, o)
        time.sleep(rng.uniform(0.0, took * 1.3))
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        assert p.stdout is not None
        p.stdout.close()
        try:
            StorageReader(url, step=1, storage_options=o).read_metadata()
        except CheckpointNotFoundError:
            left = [k for k in data_keys(s3.endpoint, url) if k.startswith("step_00000001/")]
            outcomes.append(f"none ({len(left)} objects left)")
            assert "step_00000001/manifest.json" not in left
            assert asyncckpt.find_latest(url, storage_options=o) is None
            continue
        out = _blank_kill()
        dcp.load(out, storage_reader=StorageReader(url, step=1, storage_options=o))
        outcomes.append("committed")  # the kill came after the commit: the whole state, exactly
        assert _same(out, ref)
    print(f"\nSIGKILL at 4 random points of a {took:.2f}s save: {outcomes}")


@pytest.mark.slow  # a 4-rank and a 2-rank run; its POSIX twin in tests/test_dcp_storage.py stays
def test_fsdp2_saved_on_4_ranks_loads_on_2_bit_for_bit(s3: S3Server, url: str, tmp_path: Path) -> None:
    env = {"DCP_S3_URL": url, "DCP_S3_OPTIONS": json.dumps(opts(s3.endpoint))}

    def launch(scenario: str, world: int) -> dict[int, dict[str, Any]]:
        port = free_port()
        logs = tmp_path / f"logs-{scenario}"
        logs.mkdir()
        outs = [logs / f"out{r}.json" for r in range(world)]
        argv = lambda r: [WORKER, scenario, str(r), str(world), str(port), str(tmp_path), str(outs[r])]  # noqa: E731
        hung = run_ranks(argv, world, logs, 180, extra_env=env)
        assert not hung, f"ranks {hung} hung: {log_tail(logs, hung[0])}"
        res = {}
        for r in range(world):
            assert outs[r].exists(), log_tail(logs, r)
            res[r] = json.loads(outs[r].read_text())
            assert "crash" not in res[r], res[r]["crash"]
        return res

    saved = launch("s3save", 4)
    assert saved[0]["keys"] > 0
    m = json.loads(get(s3.endpoint, url, "step_00000001/manifest.json"))
    assert m["world_size"] == 4 and sorted(f["name"] for f in m["files"] if f["name"].endswith(".safetensors")) == [
        f"rank{r:05d}.safetensors" for r in range(4)
    ]  # fmt: skip
    loaded = launch("s3load", 2)
    for r, res in loaded.items():
        for what in ("dcp1", "dcp2", "checkpointer"):
            assert res[what]["bad"] == [], (r, what, res[what]["bad"])
            assert res[what]["meta"] == {"epoch": 3, "rank0": "yes"}, (r, what)
