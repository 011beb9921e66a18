"""``find_latest`` and ``Checkpointer.latest()`` are one look for every root (issue 27): what
the local root always promised, a store keeps too.

"None means no complete checkpoint was there across a stable listing": a writer that commits
a step and retires the older ones (``keep_last=1``) while a reader looks must never make the
reader answer ``None``, on a directory or on a store. The race is made exact with the real
SeaweedFS and a proxy that holds the reader's GET of the older step's manifest until the
writer has committed the newer step and retired the older one (the writer talks to the
server directly).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from s3fixtures import opts, proxy_fixture, require_s3, server_fixture
from s3proxy import FaultProxy, Rule

require_s3()

import asyncckpt  # noqa: E402 - after the skip: obstore may be missing
from asyncckpt.format._checksum import crc32c  # noqa: E402
from asyncckpt.format._manifest import FileEntry, encode, shard_name, tree_name  # noqa: E402
from asyncckpt.remote import RemoteCheckpointInfo  # noqa: E402
from asyncckpt.roots import Root, open_root  # noqa: E402

pytestmark = pytest.mark.timeout(120)

BUCKET = "find-latest"
s3 = server_fixture(BUCKET)
proxy = proxy_fixture()


def save(root: Root, step: int) -> None:
    """Commit ``step`` through the root's own attempt (what a one-rank save does)."""
    files = {shard_name(0): b"S" * 64 + step.to_bytes(4, "little"), tree_name(0): b'{"step": %d}' % step}
    a = root.begin(step)
    for name, data in files.items():
        a.write(name, data)
    entries = [FileEntry(n, len(d), crc32c(d), 0) for n, d in files.items()]
    a.commit(encode(step, a.attempt, 1, sum(len(d) for d in files.values()), time.time(), entries, {}))


@pytest.fixture
def url() -> str:
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def writer(s3: Any, url: str) -> Iterator[Root]:
    root = open_root(url, storage_options=opts(s3.endpoint), deadline_s=60.0)
    try:
        yield root
    finally:
        root.close()


def held_until_replaced(proxy: FaultProxy, writer: Root, look: Any) -> Any:
    """Run ``look()`` in a thread while the proxy holds its GET of step 3's manifest; commit
    step 5 and retire step 3 meanwhile (directly, not through the proxy); then let the GET
    through (it now finds step 3 retired) and return what ``look()`` answered."""
    proxy.add(Rule("hang", method="GET", path_contains="step_00000003/manifest.json", times=10**6))
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["found"] = look()
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread below
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    try:
        end = time.monotonic() + 60
        while not any(s.method == "GET" and s.path.endswith("step_00000003/manifest.json") for s in proxy.seen):
            assert time.monotonic() < end and t.is_alive(), f"the reader never asked for step 3: {out}"
            time.sleep(0.02)
        save(writer, 5)
        assert writer.retire(1) == [3]  # keep_last=1: the manifest first, then its objects
        assert t.is_alive()  # still held: its answer comes from after the retirement
    finally:
        proxy.clear()  # the held GET is dropped; the reader's retry finds step 3 gone
        t.join(60)
    assert not t.is_alive()
    if "error" in out:
        raise out["error"]
    return out["found"]


def test_a_store_reader_racing_retention_never_answers_none(
    s3: Any, proxy: FaultProxy, url: str, writer: Root
) -> None:
    """Before issue 27, ``find_latest("s3://...")`` looked once: step 3 listed, retired before
    its manifest was read, and ``None`` answered, though step 5 was committed before step 3
    went. A local root looks again (two identical listings before "none"); a store now too."""
    save(writer, 3)
    o = opts(proxy.endpoint)
    found = held_until_replaced(proxy, writer, lambda: asyncckpt.find_latest(url, storage_options=o))
    assert isinstance(found, RemoteCheckpointInfo) and found.step == 5, found
    assert found.url == f"{url}/step_00000005"


def test_checkpointer_latest_on_a_store_racing_retention_never_answers_none(
    s3: Any, proxy: FaultProxy, url: str, writer: Root
) -> None:
    """``Checkpointer.latest()`` on an ``s3://`` root takes the same look (``RootSession``)."""
    save(writer, 3)
    with asyncckpt.Checkpointer(url, storage_options=opts(proxy.endpoint), timeout=60) as ck:
        found = held_until_replaced(proxy, writer, ck.latest)
    assert isinstance(found, RemoteCheckpointInfo) and found.step == 5, found
