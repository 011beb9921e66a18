"""Attacks on the node-local tiers from outside the brief's list: a restart with another world size
or another rank placement over the nodes' disks and memory tiers, two Checkpointers of one job
on one memory tier. Simulated nodes as in ``test_node_memory`` (each rank's node's disk and tmpfs
directory bind-mounted in its private mount namespace; node ``a`` and node ``b``), any number of
ranks. Needs root.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _ranks import free_port, rank_results, run_ranks
from test_node_memory import WORKER, Cluster, _needs_root, _resumed, _steps
from test_node_replica import shm_dir


class Nodes(Cluster):
    """:class:`Cluster` run with any placement of ranks on its two nodes (``names``: each rank's
    node, ``a`` or ``b``), any scenario of the worker; keeps each rank's exit status (``codes``)."""

    codes: list[int | None]

    def run_as(self, tag: str, names: str, scenario: str = "run", **env: str) -> dict[int, dict[str, Any]]:
        out, logs = self.tmp / f"{tag}-result", self.tmp / tag
        logs.mkdir()
        port, nodes = free_port(), names.split(":")
        disks = ":".join(str(self.a if n == "a" else self.b) for n in nodes)
        mems = ":".join(str(self.ma if n == "a" else self.mb) for n in nodes)
        procs: list[subprocess.Popen[bytes]] = []
        hung = run_ranks(
            lambda r: [WORKER, scenario, str(r), str(len(nodes)), str(port), str(self.mount), str(out)], len(nodes),
            logs, 200, on_started=procs.extend,
            extra_env={"NODE_DIRS": disks, "NODE_NAMES": names, "HOST_STORE_S": "60", "MEMORY": str(self.mem),
                       "MEMORY_DIRS": mems, **env},
        )  # fmt: skip
        self.codes = [p.returncode for p in procs]
        self.logs = [(logs / f"rank{r}.log").read_text(errors="replace") for r in range(len(nodes))]
        return rank_results(out, logs, hung, len(nodes))

    def run(self, tag: str, **env: str) -> tuple[dict[int, dict[str, Any]], list[str]]:
        """:meth:`run_as` 2 nodes x 2 ranks (``a:a:b:b``) the worker's ``run``; the results and logs."""
        return self.run_as(tag, "a:a:b:b", **env), self.logs


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    _needs_root()
    with shm_dir() as shm:
        yield Nodes(tmp_path, shm)


def _tiers(c: Cluster) -> dict[str, list[int]]:
    return {d.name: _steps(d) for d in (c.a, c.b, c.ma, c.mb)}


@pytest.mark.needs_root
@pytest.mark.slow  # five runs of 2-6 ranks
@pytest.mark.timeout(600)
def test_a_restart_with_another_world_size_or_placement_loads_nothing_removes_nothing_and_the_job_resumes_after(
    nodes: Nodes,
) -> None:
    c = nodes
    res, _ = c.run("first", STEPS="1,2", KEEP_LAST="2", MEMORY_KEEP_LAST="2", KILL_AFTER_FLUSH="1")
    before = _tiers(c)
    assert before == {"nodeA": [1, 2], "nodeB": [1, 2], "memA": [1, 2], "memB": [1, 2]}
    env = {"KEEP_LAST": "1", "MEMORY_KEEP_LAST": "1", "KILL_AFTER_FLUSH": "1", "CK_TIMEOUT": "30"}
    for tag, names in (("two-ranks", "a:b"), ("one-node", "a:a"), ("six-ranks", "a:a:a:b:b:b"),
                       ("swapped", "a:b:a:b")):  # fmt: skip
        res = c.run_as(tag, names, **env)
        for r, got in res.items():
            assert got.get("init_error") is None, (tag, r, got)
            assert "loaded" not in got and got["load_error"]["type"] in (
                "CheckpointNotFoundError", "CheckpointError", "ValueError"), (tag, r, got)  # fmt: skip
        if tag == "one-node":  # ranks 0 and 1 find their parts of a 4-rank step: before, they loaded them
            assert all("saved by 4 rank(s) but this job has 2" in got["load_error"]["msg"] for got in res.values())
        assert _tiers(c) == before, tag  # a job that resumed nothing removed nothing
    res, _ = c.run("back", KILL_AFTER_FLUSH="1")
    _resumed(res, 2)


@pytest.mark.needs_root
@pytest.mark.slow  # one run of 4 ranks
@pytest.mark.timeout(300)
def test_a_second_checkpointer_of_the_job_on_the_same_memory_tier_is_refused_and_the_first_goes_on(
    nodes: Nodes,
) -> None:
    c = nodes
    res = c.run_as("two", "a:a:b:b", scenario="two", CK_TIMEOUT="20")
    for r, got in res.items():
        assert got.get("second_error") is not None, (r, got)
        assert got["second_error"]["type"] in ("RootInUseError", "CheckpointError", "AgreeTimeout"), (r, got)
        assert got.get("first_error") is None and got["saved"] == [1], (r, got)
    assert _steps(c.a) == [1] and _steps(c.b) == [1] and _steps(c.ma) == [1] and _steps(c.mb) == [1]
