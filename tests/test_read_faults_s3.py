"""A store that errors or times out during a load is an I/O fault, not corruption (issue 26,
problem 4): ``CheckpointReadError`` naming the object, no fallback to an older step.

A real SeaweedFS on loopback with a fault proxy in front of it (``tests/support/s3proxy.py``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _cli_util import option_args
from s3fixtures import opts, require_s3, shared_server
from s3proxy import FaultProxy, Rule
from s3server import S3Server

require_s3()

from asyncckpt import CheckpointCorruptError, Checkpointer, CheckpointReadError, remote  # noqa: E402

BUCKET = "readfault-bucket"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with shared_server(BUCKET) as server:
        yield server


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[FaultProxy]:
    p = FaultProxy(s3.s3_port, max_lifetime=120).start()
    try:
        yield p
    finally:
        p.stop()


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((4096,), float(step)), "step": step}


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(Rule("status", method="GET", path_contains="/step_00000002/a-", status=503, times=10**6),
                     id="503", marks=pytest.mark.slow),  # 17 s; the timeout and the other faults stay
        pytest.param(Rule("delay", method="GET", path_contains="/step_00000002/a-", delay=30, times=10**6),
                     id="timeout"),
    ],
)
def test_a_store_fault_during_a_load_is_a_read_error_not_corruption(proxy: FaultProxy, fault: Rule) -> None:
    url = f"s3://{BUCKET}/rf-{uuid.uuid4().hex[:10]}"
    o = opts(proxy.endpoint)
    with Checkpointer(url, storage_options=o, timeout=10) as ck:
        for s in (1, 2):
            ck.save(s, state(s)).result(timeout=60)
    proxy.add(fault)
    for step in (None, 2):
        t0 = time.monotonic()
        with pytest.raises(CheckpointReadError) as ei:
            remote.load(url, step, storage_options=o, deadline_s=4)
        assert time.monotonic() - t0 < 20
        e = ei.value
        assert not isinstance(e, CheckpointCorruptError)
        assert e.filename is not None and e.filename.startswith(f"{url}/step_00000002/"), (e.filename, str(e))
    with Checkpointer(url, storage_options=o, timeout=4) as ck, pytest.raises(CheckpointReadError):
        ck.load()
    proxy.clear()
    assert remote.load(url, storage_options=o, deadline_s=30)["step"] == 2


def test_verify_of_a_url_calls_a_store_fault_unreadable_and_marks_nothing(
    proxy: FaultProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    """``asyncckpt verify s3://...`` (the one engine, through the store's step reader): 503s on
    the data GETs are ``unreadable``, exit 1, no bad mark on the store; once the store answers,
    the same step verifies."""
    import json

    from asyncckpt.cli import main as cli_main
    from asyncckpt.roots import open_root

    url = f"s3://{BUCKET}/rf-{uuid.uuid4().hex[:10]}"
    o = opts(proxy.endpoint)
    with Checkpointer(url, storage_options=o, timeout=10) as ck:
        ck.save(2, state(2)).result(timeout=60)
    so = option_args(o)
    proxy.add(Rule("status", method="GET", path_contains="/step_00000002/a-", status=503, times=10**6))
    assert cli_main(["verify", url, "--step", "2", "--deadline", "4", "--json", *so]) == 1
    doc = json.loads(capsys.readouterr().out)
    (got,) = doc["steps"]
    assert got["status"] == "unreadable" and got["problems"], got
    assert all("I/O error, not damage" in p["reason"] for p in got["problems"]), got
    proxy.clear()
    rows = open_root(url, storage_options=o).list_steps()
    assert [(r.step, r.state, r.bad) for r in rows] == [(2, "complete", None)]  # nothing marked
    assert cli_main(["verify", url, "--step", "2", *so]) == 0
