"""The peer replica with the persistent tier (``memory=..., replicate=True, mirror="s3://..."``):
a corrupt replica falls back to the same step and attempt on the store. A real SeaweedFS on
loopback, 2 nodes x 2 ranks (``test_node_replica``). Needs root and the s3 extra."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3fixtures import opts, require_s3, running_server
from s3server import S3Server
from test_node_memory import FROM_MEMORY, _resumed
from test_node_replica import FROM_PEER, _replica, _wipe, flip, saved, shm_dir

require_s3()
BUCKET = "node-replica"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with running_server(BUCKET) as server:
        yield server


@pytest.fixture
def shm() -> Iterator[Path]:
    with shm_dir() as d:
        yield d


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(400)
def test_a_corrupt_replica_falls_back_to_the_same_step_on_the_store(tmp_path: Path, shm: Path, s3: S3Server) -> None:
    env = {"MIRROR": f"s3://{BUCKET}/run-{uuid.uuid4().hex[:10]}", "S3OPTS": json.dumps(opts(s3.endpoint)),
           "CK_TIMEOUT": "30"}  # fmt: skip
    c = saved(tmp_path, shm, "1,2", **env)
    _wipe(c.b, c.mb)  # node b replaced
    flip(_replica(c.ma, 2) / "step_00000002" / "rank00002.safetensors")
    res, logs = c.run("corrupt", REPLICATE="1", KILL_AFTER_FLUSH="1", **env)
    _resumed(res, 2)  # bit-exact everywhere, one step
    assert "falling back to the same step from the store" in logs[2], logs[2][-3000:]
    assert "loading step 2 from the store" in logs[2]
    assert f"loading step 2 {FROM_PEER}" in logs[3] and "loading step 2 from the store" not in logs[3]
    for r in (0, 1):
        assert f"loading step 2 {FROM_MEMORY}" in logs[r]
