"""What the object-store test modules share: a started SeaweedFS with one bucket, the
storage options that reach it, and an independent listing of what a prefix holds."""

from __future__ import annotations

import contextlib
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


def put(endpoint: str, url: str, key: str, data: bytes) -> None:
    """Overwrite object ``key`` under ``url`` (a hostile or broken writer)."""
    import obstore

    obstore.put(store_for(endpoint, url), key, data)
