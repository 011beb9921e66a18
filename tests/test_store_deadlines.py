"""Every deadline holds against an object store that accepts connections and never answers
(the fault proxy's ``hang``): the ``s3://`` constructor, a save on an ``s3://`` root, tier
mode's ``flush()``, and a committed save whose clean-up afterwards hangs.

Real SeaweedFS on loopback behind the fault proxy; skips (with a reason CI refuses) when the
server or obstore is missing.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from s3fixtures import opts, proxy_fixture, require_s3, server_fixture

require_s3()

from conftest import make_state  # noqa: E402
from s3proxy import FaultProxy, Rule  # noqa: E402

from asyncckpt import Checkpointer, ObjectStoreTimeoutError, SaveError, SaveTimeoutError  # noqa: E402

BUCKET = "deadlines"
T = 3.0  # the Checkpointer's timeout in these tests
SLACK = 1.0  # what a loaded 2-core machine may add to a deadline

s3 = server_fixture(BUCKET)

proxy = proxy_fixture(max_lifetime=120)  # its stop() also lets every held request go


def _url(name: str) -> str:
    return f"s3://{BUCKET}/{name}-{time.monotonic_ns()}"


def test_the_constructor_gives_up_within_its_timeout(proxy: FaultProxy) -> None:
    import asyncckpt.checkpointer._facade  # noqa: F401 - imported before the clock starts

    proxy.add(Rule("hang", times=10**6))
    t0 = time.monotonic()
    with pytest.raises(ObjectStoreTimeoutError):
        Checkpointer(_url("ctor"), storage_options=opts(proxy.endpoint), timeout=T)
    took = time.monotonic() - t0
    print(f"\ns3:// constructor against a store that never answers: {took:.2f} s (timeout {T} s)")
    assert took < T + SLACK, took  # was timeout + 5 s: the probe's scratch delete ran past the deadline


@pytest.mark.slow  # > 15 s on a quiet 2-core machine: make test-slow (and CI) runs it
def test_a_save_on_a_store_root_fails_within_its_timeout(proxy: FaultProxy) -> None:
    ck = Checkpointer(_url("save"), storage_options=opts(proxy.endpoint), timeout=T)
    try:
        ck.save(1, make_state(1)).result(30)
        proxy.add(Rule("hang", times=10**6))
        t0 = time.monotonic()
        err = ck.save(2, make_state(2)).exception(60)
        took = time.monotonic() - t0
        print(f"\nsave on an s3:// root whose store stopped answering: failed after {took:.2f} s (timeout {T} s)")
        assert isinstance(err, SaveTimeoutError), err
        assert took < T + SLACK, took  # was timeout + 5 s: rank 0's backstop, blaming itself
        assert list(err.failures) == [0] and err.failures[0].exc_type != "TimeoutError", err  # the phase that hung
    finally:
        with pytest.raises(SaveError):
            ck.close(timeout=30)


def test_a_committed_save_is_not_made_late_by_its_clean_up(proxy: FaultProxy) -> None:
    # every LIST hangs: the commit itself needs none, the sweep and retention after it do
    url = _url("retire")
    with Checkpointer(url, storage_options=opts(proxy.endpoint), timeout=T, keep_last=1) as ck:
        ck.save(1, make_state(1)).result(30)
        proxy.add(Rule("hang", method="GET", query_has=("list-type",), times=10**6))
        t0 = time.monotonic()
        info = ck.save(2, make_state(2)).result(60)  # committed, and reported so
        took = time.monotonic() - t0
        print(f"\ncommitted save whose retention hangs: its outcome after {took:.2f} s (timeout {T} s)")
        assert info.step == 2 and took < T + SLACK, took
        proxy.clear()
    with Checkpointer(url, storage_options=opts(proxy.endpoint), timeout=30) as again:
        assert again.steps()[-1] == 2


def test_tier_flush_fails_within_its_timeout(proxy: FaultProxy, tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ck", mirror=_url("tier"), storage_options=opts(proxy.endpoint), timeout=T)
    try:
        proxy.add(Rule("hang", times=10**6))
        t0 = time.monotonic()
        ck.save(1, make_state(1)).result(30)  # the local save commits
        with pytest.raises(SaveError) as got:
            ck.flush()  # the upload cannot
        took = time.monotonic() - t0
        print(f"\ntier flush() against a store that never answers: {took:.2f} s (timeout {T} s)")
        assert took < T + SLACK, took  # was timeout + 5 s: the probe's scratch delete
        assert "ObjectStoreTimeoutError" in str(got.value)
    finally:
        proxy.clear()
        try:
            ck.close(timeout=30)
        except SaveError:
            pass
