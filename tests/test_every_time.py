"""Tier frequencies by time (``disk_every``/``mirror_every``/``memory_every`` as a
``datetime.timedelta``): rank 0 decides with its clock at its ``save()`` call, and every rank
takes that decision from the save's start word (``saving._frequency``). The node-local tests run
2 nodes x 2 ranks, real processes (``test_node_memory.Cluster``), whose clocks disagree: each
rank sleeps its own amounts before its saves. The store's is in ``test_tier.py``.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from test_node_disk_every import nodes  # noqa: F401 - the fixture: two simulated nodes (needs root)
from test_node_memory import FROM_DISK, FROM_MEMORY, Cluster, _resumed, _steps
from test_node_replica import _wipe

from asyncckpt.saving._frequency import TierClock, Tiers


def decided(calls: list[float], every_s: float) -> list[bool]:
    """The time rule applied to one clock's ``save()`` calls: a save goes to the tier when at
    least ``every_s`` passed since the call of the last save that went there (the first always)."""
    out, last = [], None
    for t in calls:
        out.append(last is None or t - last >= every_s)
        if out[-1]:
            last = t
    return out


def margin(calls: list[float], every_s: float) -> float:
    """How far from ``every_s`` the gaps the rule compared were (the test's slack)."""
    gaps, last = [], None
    for t, due in zip(calls, decided(calls, every_s), strict=True):
        if last is not None:
            gaps.append(abs(t - last - every_s))
        if due:
            last = t
    return min(gaps, default=1.0)


def test_the_clock_sends_a_save_to_a_tier_once_the_time_passed_and_a_failed_save_gives_it_back() -> None:
    # rank 0's decision, at the times of its calls (seconds); the disks every 1 s, the rest the memory tier
    clock = TierClock(1, timedelta(seconds=1), 1, split=True, memory=True)
    got = [clock.decide(n, t) for n, t in enumerate([0.0, 0.4, 1.1, 1.5, 2.0, 2.2], 1)]
    assert [d.disk for d in got] == [True, False, True, False, False, True]
    assert all(d.memory for d in got)  # a disk save writes its memory copy too (memory_every=1)
    clock.failed(got[5])  # the disk save at 2.2 failed: the next save goes to the disks
    assert clock.decide(7, 2.3).disk
    assert not clock.decide(8, 2.4).disk
    # the store by time counts only the saves that go to the disks; by count it is decided at settle
    clock = TierClock(1, 2, timedelta(seconds=1), split=True, memory=True)
    assert [(d.disk, d.mirror) for d in (clock.decide(n, t) for n, t in enumerate([0, 1.5, 1.6, 1.7, 1.8], 1))] \
        == [(True, True), (False, False), (True, True), (False, False), (True, False)]  # fmt: skip
    assert TierClock(1, 1, 3, split=False, memory=False).decide(2, 9.0).mirror is None
    # another rank's provisional route takes every time-based tier (rank 0's word replaces it)
    assert TierClock(1, timedelta(hours=1), 1, split=True, memory=True).decide(5, provisional=True).disk
    assert Tiers.from_json(Tiers(False, True, None).to_json()) == Tiers(False, True, None)
    # a save made in the SIGTERM handler goes to every tier, and restarts the clocks
    clock = TierClock(1, timedelta(hours=1), timedelta(hours=1), split=True, memory=True)
    assert clock.decide(1, 0.0).disk and not clock.decide(2, 1.0).disk
    final = clock.decide(3, 2.0, final=True)
    assert (final.disk, final.memory, final.mirror) == (True, True, True)
    assert not clock.decide(4, 3.0).disk
    by_count = TierClock(1, 5, 5, split=True, memory=True).decide(3, final=True)
    assert (by_count.disk, by_count.mirror) == (True, None)  # (the skipped upload: the handler's flush)
    assert TierClock(1, 5, 1, split=True, memory=True).tiered  # the others follow rank 0's word
    assert not TierClock(1, 1, 3, split=False, memory=False).tiered


#: each node's sleeps before its saves: node a's ranks and node b's disagree on every gap
GAPS = {"a": "0,3,0,3,0", "b": "0,0,3,0,3"}
#: the frequency by time: the short gaps (a save's commit on a busy machine) stay well under it
EVERY_S = 2.0


@pytest.mark.needs_root
@pytest.mark.slow  # two runs of 4 ranks
@pytest.mark.timeout(600)
def test_disk_every_by_time_is_rank_0s_choice_on_every_node(nodes: Cluster) -> None:  # noqa: F811 - the fixture
    """Every node writes the steps rank 0's clock sent to the disks, though the ranks' clocks
    disagree; a restart after a kill resumes one step on every rank, bit-exact."""
    c = nodes
    res, logs = c.save("first", [1, 2, 3, 4, 5], DISK_EVERY_S=str(EVERY_S), MEMORY_KEEP_LAST="5",
                       SAVE_GAPS=";".join([GAPS["a"], GAPS["a"], GAPS["b"], GAPS["b"]]),
                       KILL_AFTER_FLUSH="1")  # fmt: skip
    calls0 = res[0]["calls"]
    assert margin(calls0, EVERY_S) > 0.05, calls0  # (else the test itself could not tell)
    want = decided(calls0, EVERY_S)  # rank 0's decisions, by its clock
    assert want == [True, True, False, True, False], calls0
    # rank 2's clock would have decided otherwise: the ranks disagreed, and rank 0's word counted
    assert decided(res[2]["calls"], EVERY_S) != want, res[2]["calls"]
    tiers = ["local" if d else "memory" for d in want]
    for r, got in res.items():
        assert [t for t, _ in got["tiers"]] == tiers, (r, got["tiers"], got["calls"])
    disk_steps = [s for s, d in zip([1, 2, 3, 4, 5], want, strict=True) if d]
    assert _steps(c.a) == disk_steps and _steps(c.b) == disk_steps  # every node wrote exactly those
    assert _steps(c.ma) == [1, 2, 3, 4, 5] and _steps(c.mb) == [1, 2, 3, 4, 5]
    for d in (c.a, c.b, c.ma, c.mb):
        assert not [p.name for p in d.iterdir() if ".tmp-" in p.name], list(d.iterdir())
    # every process killed, node b rebooted (its memory empty): step 5 is in node a's memory
    # alone, so every rank resumes step 4, bit-exact (node b's ranks from their disk): never a mix
    _wipe(c.mb)
    res, logs = c.run("b-rebooted", KILL_AFTER_FLUSH="1")
    _resumed(res, 4)
    for r in range(4):
        assert f"loading step 4 {FROM_MEMORY if r < 2 else FROM_DISK}" in logs[r], logs[r][-3000:]


@pytest.mark.needs_root
@pytest.mark.slow  # one run of 4 ranks
@pytest.mark.timeout(300)
def test_memory_every_by_time_keeps_rank_0s_picks_in_every_nodes_memory(nodes: Cluster) -> None:  # noqa: F811
    c = nodes
    res, _ = c.save("memory", [1, 2, 3, 4, 5], MEMORY_EVERY_S=str(EVERY_S), MEMORY_KEEP_LAST="5", KEEP_LAST="5",
                    SAVE_GAPS=";".join([GAPS["a"], GAPS["a"], GAPS["b"], GAPS["b"]]))  # fmt: skip
    calls0 = res[0]["calls"]
    assert margin(calls0, EVERY_S) > 0.05, calls0
    want = decided(calls0, EVERY_S)
    assert want == [True, True, False, True, False] and decided(res[2]["calls"], EVERY_S) != want, res
    kept = [s for s, d in zip([1, 2, 3, 4, 5], want, strict=True) if d]
    assert _steps(c.ma) == kept and _steps(c.mb) == kept  # every node's memory: rank 0's picks
    assert _steps(c.a) == [1, 2, 3, 4, 5] and _steps(c.b) == [1, 2, 3, 4, 5]  # the disks take every save
    for r, got in res.items():
        assert [t for t, _ in got["tiers"]] == ["local"] * 5, (r, got["tiers"])
