"""Tier mode's upload round keeps one deadline: the upload, its manifest and the remote
retention after it all end by the Checkpointer's ``timeout`` counted from the round's start
(``saving._mirror``). A retention that runs out of that time never fails or undoes the
committed upload: it is logged and done by the next round.

Real SeaweedFS on loopback behind the fault proxy (its ``hang``: a store that accepts the
retention's request and never answers); skips (with a reason CI refuses) when the server or
obstore is missing. The test failed on the code before the fix (the retention got a fresh
``timeout`` after the upload: a round of ~1.5x the timeout here).
"""

from __future__ import annotations

import logging
import time

import pytest
from s3fixtures import data_keys, opts, proxy_fixture, require_s3, server_fixture

require_s3()

from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from s3proxy import FaultProxy, Rule  # noqa: E402

import asyncckpt  # noqa: E402
from asyncckpt import Checkpointer, remote  # noqa: E402

BUCKET = "deadline-mirror"
T = 3.0  # the Checkpointer's timeout: one upload round's bound
SLACK = 0.9  # what a loaded 2-core machine may add to a deadline

s3 = server_fixture(BUCKET)

proxy = proxy_fixture(max_lifetime=120)  # its stop() also lets every held request go


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64 * 1024,), float(step))}


def _remote_steps(url: str, o: dict[str, str]) -> list[int]:
    return [s.step for s in remote.scan(url, storage_options=o) if s.complete]


@pytest.mark.timing
@pytest.mark.timeout(120)
def test_a_stalled_remote_retention_ends_with_the_upload_round_and_is_done_by_the_next_round(
    tmp_path: Path, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    # step 2's upload takes half the timeout (its data PUT held at the proxy); then the
    # retention of step 1 (keep_last_remote=1) sends the delete of its manifest, which the
    # store never answers. The round must end by its one deadline, with step 2 committed on
    # the store and step 1 still whole (the delete never reached it); the next round retires
    # both older steps
    url = f"s3://{BUCKET}/run-{time.monotonic_ns()}"
    o = opts(proxy.endpoint)
    with Checkpointer(tmp_path / "ck", mirror=url, storage_options=o, keep_last_remote=1, timeout=T) as ck:
        ck.save(1, _state(1))
        ck.flush(30)
        assert _remote_steps(url, o) == [1]
        slow = proxy.add(Rule("delay", method="PUT", path_regex=r"step_00000002/a-[^/]+/rank00000\.safetensors",
                              delay=0.5 * T, times=1))  # fmt: skip
        stalled = proxy.add(Rule("hang", method="POST", query_has=("delete",),
                                 body_regex=rb"step_00000001/manifest\.json", times=10**6))  # fmt: skip
        caplog.set_level(logging.INFO, logger="asyncckpt")
        t0 = time.monotonic()
        ck.save(2, _state(2)).result(30)
        ck.flush(30)  # the upload committed: nothing to raise, whatever the retention did
        took = time.monotonic() - t0
        print(f"\nupload round with a stalled retention: {took:.2f} s (timeout {T} s)")
        assert slow.hits == 1 and stalled.hits >= 1, (slow.hits, stalled.hits)
        assert took < T + SLACK, took  # was ~1.5 T: the retention had a fresh timeout of its own
        assert _remote_steps(url, o) == [1, 2]  # the upload stands; step 1 was not half-removed
        said = [r.getMessage() for r in caplog.records if "remote retention" in r.getMessage()]
        assert said and "next upload" in said[-1], said
        proxy.clear()  # the store answers again
        ck.save(3, _state(3))
        ck.flush(30)
    assert _remote_steps(url, o) == [3]  # the next round retired what this one could not
    assert torch.equal(asyncckpt.load(url, storage_options=o)["w"], _state(3)["w"])


@pytest.mark.timing
@pytest.mark.timeout(120)
def test_a_retirement_cut_after_its_manifest_is_finished_by_the_next_round(
    tmp_path: Path, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    # the retention of step 1 deletes its manifest (step 1 is no longer a commit), then the
    # delete of its objects never gets an answer: the round ends by its deadline with step 1's
    # objects left. No retention would ever count step 1 again (it is not a commit), so its
    # objects stayed on the store until a gc: the next round must finish the retirement
    url = f"s3://{BUCKET}/cut-{time.monotonic_ns()}"
    o = opts(proxy.endpoint)
    with Checkpointer(tmp_path / "ck", mirror=url, storage_options=o, keep_last_remote=1, timeout=T) as ck:
        ck.save(1, _state(1))
        ck.flush(30)
        stalled = proxy.add(Rule("hang", method="POST", query_has=("delete",), body_regex=rb"step_00000001/a-",
                                 times=10**6))  # fmt: skip
        caplog.set_level(logging.INFO, logger="asyncckpt")
        t0 = time.monotonic()
        ck.save(2, _state(2))
        ck.flush(30)  # the upload committed
        took = time.monotonic() - t0
        assert stalled.hits >= 1 and took < T + SLACK, (stalled.hits, took)
        assert _remote_steps(url, o) == [2]
        left = [k for k in data_keys(proxy.endpoint, url) if k.startswith("step_00000001/")]
        assert left and "step_00000001/manifest.json" not in left, left  # cut between the manifest and the objects
        proxy.clear()
        ck.save(3, _state(3))
        ck.flush(30)
    assert _remote_steps(url, o) == [3]
    assert not [k for k in data_keys(proxy.endpoint, url) if not k.startswith("step_00000003/")], data_keys(
        proxy.endpoint, url
    )  # nothing of steps 1 and 2 is left
    assert torch.equal(asyncckpt.load(url, storage_options=o)["w"], _state(3)["w"])
