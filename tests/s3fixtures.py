"""What the object-store test modules share: a started SeaweedFS with one bucket, the
storage options that reach it, and an independent listing of what a prefix holds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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


def keys(endpoint: str, url: str) -> list[str]:
    """Every object under ``url``, relative to it, listed with obstore directly (not through
    the code under test)."""
    import obstore
    from obstore.store import S3Store

    bucket, _, prefix = url[len("s3://"):].partition("/")
    st = S3Store(bucket, prefix=prefix, config=opts(endpoint),  # type: ignore[arg-type]
                 client_options={"allow_http": True})
    return sorted(str(m["path"]).removeprefix(prefix + "/") for chunk in obstore.list(st) for m in chunk)
