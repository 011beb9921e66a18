"""Store traffic per save on an ``s3://`` root does not grow with the run (issue 32).

A real SeaweedFS on loopback, a counting proxy in between. The writer's look after each
commit (``_remote_view``) lists the marks and what lies above its floor, reads no manifest it
knows, and removes the empty "directories" of what it deletes; so the requests of a save are
the same at save 60 as at save 5, on a store that keeps empty prefixes (SeaweedFS, with those
removals refused) or not. What the cache must never hide is checked too: a leftover that
appears between two saves, a bad mark a reader records between two saves. And a store that is
out of space: the save fails naming that, nothing committed is lost, ``close()`` gives the
lease back within its deadline.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "support"))

from s3fixtures import get, opts, proxy_fixture, put, require_s3, running_server, server_fixture, store_for
from s3fixtures import keys as all_keys
from s3proxy import FaultProxy, Rule, Seen
from s3server import S3Server

require_s3()

import asyncckpt  # noqa: E402 - after the skip: obstore may be missing
from asyncckpt import Checkpointer, ObjectStoreFullError, SaveError  # noqa: E402
from asyncckpt._errors import CheckpointCorruptError  # noqa: E402

BUCKET = "traffic-bucket"
s3 = server_fixture(BUCKET)
proxy = proxy_fixture()
pytestmark = pytest.mark.timeout(240)

STATE = {"w": torch.arange(1000, dtype=torch.float32)}


@pytest.fixture
def url() -> str:
    return f"s3://{BUCKET}/traffic-{uuid.uuid4().hex[:10]}"


def _kind(x: Seen) -> str:
    q = set(x.query)
    what = ("list" if "list-type" in q else "uploads" if "uploads" in q else "bulk-delete" if "delete" in q
            else "manifest" if x.path.endswith("/manifest.json") else "object")
    return f"{x.method} {what}"


def _saves(proxy: FaultProxy, ck: Checkpointer, steps: range) -> list[Counter[str]]:
    """The requests each save of ``steps`` sent (but the lease's renewals, timed by a clock),
    ``save().result()`` returning after its retention and clean-up."""
    out = []
    for step in steps:
        n0 = len(proxy.seen)
        ck.save(step, STATE).result(timeout=60)
        out.append(Counter(_kind(x) for x in proxy.seen[n0:] if not x.path.endswith("/.asyncckpt/owner")))
    return out


def _prefixes(endpoint: str, url: str) -> list[str]:
    """The "directories" right below ``url`` as the store lists them (a LIST with a delimiter)."""
    import obstore

    return sorted(str(p).rstrip("/").rsplit("/", 1)[-1]
                  for p in obstore.list_with_delimiter(store_for(endpoint, url), None)["common_prefixes"])


def _total(counts: list[Counter[str]]) -> Counter[str]:
    out: Counter[str] = Counter()
    for c in counts:
        out += c
    return out


def test_requests_per_save_do_not_grow_with_the_run_and_no_empty_prefix_is_left(
    s3: S3Server, proxy: FaultProxy, url: str
) -> None:
    with Checkpointer(url, storage_options=opts(proxy.endpoint), keep_last=2, max_pending=1) as ck:
        counts = _saves(proxy, ck, range(1, 61))
    first, last = _total(counts[4:14]), _total(counts[50:60])
    assert last == first, (first, last)
    # a save: its objects, its manifest, one look (two LISTs), one retirement, one LIST of uploads
    assert counts[-1]["GET list"] == 2 and sum(counts[-1].values()) <= 16, counts[-1]
    assert _prefixes(s3.endpoint, url) == [".asyncckpt", "step_00000059", "step_00000060"]
    ks = [k for k in all_keys(s3.endpoint, url) if not k.startswith(".asyncckpt/")]
    assert sorted({k.split("/")[0] for k in ks}) == ["step_00000059", "step_00000060"], ks


def test_a_store_that_keeps_empty_prefixes_is_listed_above_the_writers_floor(
    s3: S3Server, proxy: FaultProxy, url: str
) -> None:
    # a store that keeps the empty "directories" of deleted objects: their removal refused (the
    # bulk delete of keys that name a step or an attempt, not an object)
    proxy.add(Rule("status", method="POST", query_has=("delete",), body_regex=rb"/(step_\d+|a-[0-9a-f]+)</Key>",
                   times=10**6, status=400, code="InvalidArgument"))
    prefix = url.split("/", 3)[3]
    with Checkpointer(url, storage_options=opts(proxy.endpoint), keep_last=2, max_pending=1) as ck:
        n0 = len(proxy.seen)
        counts = _saves(proxy, ck, range(1, 41))
        flat = [x for x in proxy.seen[n0:] if "list-type" in x.query and x.params.get("prefix") == f"{prefix}/"]
    assert _total(counts[4:14]) == _total(counts[30:40])
    assert len(_prefixes(s3.endpoint, url)) >= 40  # the store kept them ...
    # ... and no look after the first listed (or made the store walk) the steps retired long ago
    assert len(flat) == 40 and all("start-after" in x.params for x in flat[1:]), [x.params for x in flat[:3]]
    after = [x.params["start-after"][len(prefix) + 1:] for x in flat[1:]]
    assert all(a >= f"step_{step - 3:08d}"[:-1] for step, a in zip(range(2, 41), after, strict=True)), after


def test_a_new_job_removes_leftovers_anywhere_once_then_lists_only_above_its_floor(
    s3: S3Server, proxy: FaultProxy, url: str
) -> None:
    import obstore

    raw = store_for(s3.endpoint, url)
    for step in range(0, 60):  # an earlier run's retired steps: empty prefixes on SeaweedFS
        obstore.put(raw, f"step_{step:08d}/a-old/rank00000.json", b"{}")
        obstore.delete(raw, f"step_{step:08d}/a-old/rank00000.json")
    put(s3.endpoint, url, "step_00000030/a-dead/rank00000.safetensors", b"x" * 100)  # a crashed save's leftover
    prefix = url.split("/", 3)[3]
    with Checkpointer(url, storage_options=opts(proxy.endpoint), keep_last=2, max_pending=1) as ck:
        assert not [k for k in all_keys(s3.endpoint, url) if k.startswith("step_00000030/")]
        n0 = len(proxy.seen)
        counts = _saves(proxy, ck, range(1000, 1020))
        flat = [x for x in proxy.seen[n0:] if "list-type" in x.query and x.params.get("prefix") == f"{prefix}/"]
    assert _total(counts[4:9]) == _total(counts[15:20])
    # the job's construction looked at everything once (and its writer starts from what it
    # found); every later look lists only the steps the writer may still hold
    assert all("start-after" in x.params for x in flat)
    assert all(x.params["start-after"][len(prefix) + 1:] >= "step_0000099" for x in flat[1:]), \
        [x.params for x in flat[:3]]


def test_a_leftover_that_appears_between_two_saves_is_removed_by_the_next(s3: S3Server, url: str) -> None:
    with Checkpointer(url, storage_options=opts(s3.endpoint), keep_last=2, max_pending=1) as ck:
        for step in (1, 2, 3):
            ck.save(step, STATE).result(timeout=60)
        # a zombie's late writes: a dead attempt in a committed step, a step without a manifest
        put(s3.endpoint, url, "step_00000003/a-zombie/rank00000.json", b"{}")
        put(s3.endpoint, url, "step_00000009/a-zombie/rank00000.json", b"{}")
        ck.save(4, STATE).result(timeout=60)
    ks = [k for k in all_keys(s3.endpoint, url) if not k.startswith(".asyncckpt/")]
    assert not [k for k in ks if "zombie" in k], ks
    assert sorted({k.split("/")[0] for k in ks}) == ["step_00000003", "step_00000004"]
    assert "step_00000009" not in _prefixes(s3.endpoint, url)


def test_a_bad_mark_recorded_between_two_saves_is_honoured_by_the_next_retention(s3: S3Server, url: str) -> None:
    o = opts(s3.endpoint)
    with Checkpointer(url, storage_options=o, keep_last=2, max_pending=1) as ck:
        for step in (1, 2, 3):
            ck.save(step, STATE).result(timeout=60)
        shard = next(k for k in all_keys(s3.endpoint, url) if k.startswith("step_00000003/a-")
                     and k.endswith(".safetensors"))
        data = bytearray(get(s3.endpoint, url, shard))
        data[-8:] = b"\xff" * 8  # same size, other bytes: only a content check finds it
        put(s3.endpoint, url, shard, bytes(data))
        with pytest.raises(CheckpointCorruptError):
            asyncckpt.load(url, step=3, storage_options=o)  # a reader: records a bad mark on the store
        assert [k for k in all_keys(s3.endpoint, url) if k.startswith(".asyncckpt/bad/step_00000003.")]
        ck.save(4, STATE).result(timeout=60)
        # 3 is known bad: it does not count, so 2 is still one of the two newest resumable steps
        assert ck.steps() == [2, 4]
        ck.save(5, STATE).result(timeout=60)
        assert ck.steps() == [4, 5]
    manifests = sorted(k for k in all_keys(s3.endpoint, url) if k.endswith("/manifest.json"))
    assert manifests == [f"step_{s:08d}/manifest.json" for s in (3, 4, 5)]  # the bad one is left alone


# ------------------------------------------------------------------------------ out of space


@pytest.fixture(scope="module")
def small_s3() -> Iterator[S3Server]:
    """A server with room for about 16 MiB (one volume): it fills after a few saves, and the
    space of deleted objects is not reclaimed (no vacuum in the test's time)."""
    from s3server import S3Server as Server

    server = Server(volumes=1, volume_size_mb=16)
    try:
        try:
            server.start()
            server.create_bucket(BUCKET)
        except Exception as e:  # noqa: BLE001 - CI fails on this skip
            pytest.skip(f"needs s3/server: SeaweedFS did not start ({e})")
        yield server
    finally:
        server.close()


@pytest.mark.slow  # > 15 s on a quiet 2-core machine: make test-slow (and CI) runs it
@pytest.mark.timing  # "out of space" needs the read probe to answer in time (failed under parallel load)
def test_a_store_out_of_space_fails_the_save_naming_it_and_close_gives_the_lease_back(
    small_s3: S3Server, url: str
) -> None:
    o = opts(small_s3.endpoint)
    state = {"w": torch.randn(512 * 1024)}  # 2 MiB
    committed: list[int] = []
    # the diagnosis runs in what the save's deadline leaves after the refused upload's retries
    # (up to ~16 s of backoff): 60 s leaves it room whatever the random pauses were
    ck = Checkpointer(url, storage_options=o, keep_last=2, max_pending=1, timeout=60)
    try:
        failure: SaveError | None = None
        for step in range(1, 40):
            try:
                ck.save(step, state).result(timeout=120)
            except SaveError as e:
                failure = e
                break
            committed.append(step)
        assert failure is not None, "the store never filled up"
        f = failure.failures[0]
        assert f.exc_type == "ObjectStoreFullError" and "out of space" in str(failure), str(failure)[:2000]
        assert isinstance(failure.__cause__, ObjectStoreFullError) and failure.__cause__.errno == 28
    finally:
        t0 = time.monotonic()
        with pytest.raises(SaveError):
            ck.close()  # the failed save is raised once more, and the lease given back
        took = time.monotonic() - t0
    assert took < 15.0, took
    ks = all_keys(small_s3.endpoint, url)
    assert ".asyncckpt/owner" not in ks, ks  # not markable as released (no room): deleted while surely ours
    # nothing committed was lost: the newest two load
    assert committed[-2:] == [s for s in (int(k[5:13]) for k in ks if k.endswith("/manifest.json"))]
    got: Any = asyncckpt.load(url, storage_options=o)
    assert torch.equal(got["w"], state["w"])


def test_reads_are_not_taken_for_a_full_store_when_the_store_is_down() -> None:
    """The diagnosis names a full store only when reads answer: a store that stops answering
    altogether keeps its own error (``ObjectStoreUnavailableError``/timeout), never ENOSPC."""
    import asyncio
    import errno

    from asyncckpt import ObjectStoreUnavailableError
    from asyncckpt.roots.objstore._remote import open_store
    from asyncckpt.roots.objstore._storefull import explain

    with running_server("downbucket") as server:
        store = open_store("s3://downbucket/x", opts(server.endpoint))
        server.kill()
        err = ObjectStoreUnavailableError(errno.EIO, "upload failed (status code: 500)", "s3://downbucket/x/k")

        async def go() -> Any:
            return await explain(store, err, time.monotonic() + 5.0)

        assert asyncio.run(go()) is err


@pytest.mark.parametrize(("status", "code", "named"), [
    pytest.param(500, "InternalError", True, marks=pytest.mark.slow),  # the store-out-of-space test above stays
    pytest.param(503, "SlowDown", False, marks=pytest.mark.slow)])
@pytest.mark.timing  # the same probe (failed under parallel load)
def test_every_write_refused_is_named_out_of_space_only_for_a_plain_refusal(
    proxy: FaultProxy, url: str, status: int, code: str, named: bool
) -> None:
    """Every PUT refused (the proxy answers for the store): a plain 500 while reads answer is a
    store out of space (SeaweedFS's answer); 503 is throttling and keeps its own name."""
    ck = Checkpointer(url, storage_options=opts(proxy.endpoint), keep_last=2, max_pending=1, timeout=60)  # as above
    try:
        ck.save(1, STATE).result(timeout=60)
        proxy.add(Rule("status", method="PUT", status=status, code=code, times=10**6))
        with pytest.raises(SaveError) as info:
            ck.save(2, STATE).result(timeout=120)
        want = "ObjectStoreFullError" if named else "ObjectStoreUnavailableError"
        assert info.value.failures[0].exc_type == want, str(info.value)[:1500]
        assert ("out of space" in str(info.value)) == named
    finally:
        t0 = time.monotonic()
        with pytest.raises(SaveError):
            ck.close()
        assert time.monotonic() - t0 < 15.0
    # the lease record could not be marked released: deleted while surely ours
    assert ".asyncckpt/owner" not in all_keys(proxy.endpoint, url)
    assert asyncckpt.load(url, storage_options=opts(proxy.endpoint))["w"].equal(STATE["w"])
