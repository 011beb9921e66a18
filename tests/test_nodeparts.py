"""The resume decision of the node-local tier (``roots._nodeparts.common_steps``), pure."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from asyncckpt.roots._nodeparts import common_steps


def _p(**steps: tuple[str, str]) -> dict[str, list[Any]]:
    return {k[1:]: list(v) for k, v in steps.items()}  # s3=("att", "run") -> {"3": [...]}


def test_every_rank_reads_its_own_disk_when_it_holds_the_attempt() -> None:
    local = [_p(s1=("x1", "R"), s2=("x2", "R"))] * 4
    assert [e[:4] for e in common_steps(local, [])] == [[1, "x1", "R", ["local"] * 4], [2, "x2", "R", ["local"] * 4]]


def test_a_rank_lacking_its_part_reads_the_store_but_only_of_the_same_attempt() -> None:
    a = _p(s2=("x2", "R"))
    wiped: dict[str, list[Any]] = {}
    other = _p(s2=("y2", "Q"))  # another attempt (another run) of step 2 on that node's disk
    store = [[2, "x2", "R"]]
    assert common_steps([a, a, wiped, other], store) == [
        [2, "x2", "R", ["local", "local", "store", "store"], [["local", "store"]] * 2 + [["store"]] * 2]
    ]
    assert common_steps([a, a, wiped, other], []) == []  # without the store: never a mix


def test_another_runs_steps_are_never_chosen_over_this_runs() -> None:
    mine = _p(s3=("x3", "R"))
    theirs = _p(s3=("x3", "R"), s9=("z9", "Q"))  # a node that also holds another run's step 9
    store = [[3, "x3", "R"], [7, "w7", "Q"]]  # and the store another run's step 7
    got = common_steps([mine, mine, theirs, theirs], store)
    assert [e[0] for e in got] == [3]
    # disks that hold nothing: the store's newest, whatever its run (a job resuming on new nodes)
    assert common_steps([{}, {}], store)[-1][:3] == [7, "w7", "Q"]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.dictionaries(st.integers(1, 6).map(str), st.tuples(st.sampled_from("abc"), st.sampled_from("RQ"))),
                min_size=1, max_size=4),
       st.lists(st.tuples(st.integers(1, 6), st.sampled_from("abc"), st.sampled_from("RQ")), max_size=4))
def test_every_chosen_step_is_readable_by_every_rank_with_one_attempt(
    local: list[dict[str, tuple[str, str]]], store: list[tuple[int, str, str]]
) -> None:
    parts = [{s: list(v) for s, v in p.items()} for p in local]
    listed = {s: (a, r) for s, a, r in store}  # one manifest per step on the store
    for step, attempt, _run, sources, _tiers in common_steps(parts, [[s, a, r] for s, (a, r) in listed.items()]):
        assert len(sources) == len(parts)
        for p, src in zip(parts, sources, strict=True):
            if src == "local":
                assert p[str(step)][0] == attempt
            else:
                assert listed[step][0] == attempt


def test_a_rank_reads_its_memory_copy_first_then_its_disk_then_the_store_of_the_same_attempt() -> None:
    disk = _p(s4=("x4", "R"), s5=("x5", "R"))
    mem = _p(s5=("x5", "R"))
    stale = _p(s5=("y5", "R"))  # another attempt of step 5 in a node's memory: never read
    store = [[5, "x5", "R"]]
    got = common_steps([disk, disk, {}, disk], store, [mem, stale, mem, {}])
    assert got[-1] == [5, "x5", "R", ["memory", "local", "memory", "local"],
                       [["memory", "local", "store"], ["local", "store"], ["memory", "store"], ["local", "store"]]]
    # the memory tier alone (the disks wiped, no store): a step every rank holds in memory
    assert common_steps([{}, {}], [], [mem, mem]) == [[5, "x5", "R", ["memory"] * 2, [["memory"]] * 2]]
    # memory on some ranks only and nothing else: never a mix with another step
    assert common_steps([{}, {}], [], [mem, {}]) == []


def test_a_rank_reads_its_buddys_replica_after_its_own_memory_and_before_its_disk() -> None:
    disk = _p(s5=("x5", "R"))
    mem = _p(s5=("x5", "R"))
    peer = {"5": ["x5"]}
    # node b replaced (ranks 2, 3: no disk, no memory): its ranks read the replicas node a holds
    got = common_steps([disk, disk, {}, {}], [], [mem, mem, {}, {}], [peer, peer, peer, peer])
    assert got == [[5, "x5", "R", ["memory", "memory", "peer", "peer"],
                    [["memory", "peer", "local"], ["memory", "peer", "local"], ["peer"], ["peer"]]]]  # fmt: skip
    # a replica of another attempt is no place to read this one; a replica alone is no candidate
    assert common_steps([disk, disk, {}, {}], [], [mem, mem, {}, {}], [{}, {}, {"5": ["y5"]}, peer]) == []
    assert common_steps([{}, {}], [], [{}, {}], [peer, peer]) == []
