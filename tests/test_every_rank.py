"""``asyncckpt.on_every_rank`` on 4 real gloo ranks: all results, or the same typed error on
every rank naming the failed (or silent) ranks, within the deadline."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest
from _ranks import free_port, log_tail, run_ranks

import asyncckpt
from asyncckpt import RanksFailedError, RanksTimeoutError

WORKER = str(Path(__file__).parent / "support" / "_every_rank_worker.py")
WORLD = 4


def _run(tmp_path: Path, scenarios: list[str], deadline: float, warm: bool = False) -> list[dict[str, Any]]:
    port = free_port()
    outs = [tmp_path / f"out{r}.json" for r in range(WORLD)]
    hung = run_ranks(
        lambda r: [WORKER, ",".join(scenarios), str(r), str(WORLD), str(port), str(tmp_path), str(outs[r])],
        WORLD,
        tmp_path,
        deadline,
        warm=warm,
    )
    assert not hung, f"ranks {hung} hung: {log_tail(tmp_path, hung[0])}"
    res = []
    for r in range(WORLD):
        assert outs[r].exists(), log_tail(tmp_path, r)
        doc = json.loads(outs[r].read_text())
        assert "crash" not in doc, doc["crash"]
        res.append(doc)
    return res


def test_all_results_or_the_same_error_naming_the_failed_rank(tmp_path: Path) -> None:
    res = _run(tmp_path, ["ok", "one_fails", "not_json", "subgroup"], deadline=90, warm=True)

    ok = [r["ok"] for r in res]
    expect = [{"rank": i, "dir": str(tmp_path / "ok" / f"rank{i}"), "pair": [i, "x"]} for i in range(WORLD)]
    assert all(o["value"] == expect for o in ok), ok  # tuples travel as lists
    assert all((tmp_path / "ok" / f"rank{i}").is_dir() for i in range(WORLD))

    # one rank raised FileExistsError: every rank raises RanksFailedError naming rank 2 only,
    # at once (no timeout involved), with the errno and the path; rank 2 chains its own error
    for o in (r["one_fails"] for r in res):
        err = o["error"]
        assert err["type"] == "RanksFailedError" and not err["timeout"], err
        assert list(err["failures"]) == ["2"] and err["missing"] == [], err
        f = err["failures"]["2"]
        assert f["exc_type"] == "FileExistsError" and f["errno"] == errno.EEXIST, f
        assert f["path"].endswith("epoch_1_step_297/rng"), f
        assert o["s"] < 10, o
    assert [r["one_fails"]["error"]["cause"] for r in res] == [None, None, "FileExistsError", None]

    # a result that cannot travel as JSON is that rank's failure (TypeError), on every rank
    for o in (r["not_json"] for r in res):
        assert o["error"]["type"] == "RanksFailedError", o
        assert list(o["error"]["failures"]) == ["1"], o
        assert o["error"]["failures"]["1"]["exc_type"] == "TypeError", o

    # a sub-group: group ranks, with the global rank filled in; ranks outside it take no part
    assert res[0]["subgroup"] == {"skipped": True} and res[2]["subgroup"] == {"skipped": True}
    for r in (1, 3):
        err = res[r]["subgroup"]["error"]
        assert err["type"] == "RanksFailedError" and list(err["failures"]) == ["1"], err
        assert err["failures"]["1"]["global_rank"] == 3 and err["failures"]["1"]["errno"] == errno.EACCES, err


@pytest.mark.slow  # 15 s: make test-slow (and CI) runs it, one at a time
@pytest.mark.timing  # 1-1.5 s timeouts against 4 and 7.5 s sleeps
def test_a_silent_rank_is_named_within_the_deadline_and_late_ranks_raise_the_same(tmp_path: Path) -> None:
    res = _run(tmp_path, ["absent", "leader_slow"], deadline=90)  # 1-1.5 s timeouts: fresh interpreters

    # rank 2 alive but busy for 4 s, timeout 1.5 s: ranks 0, 1, 3 raise RanksTimeoutError
    # naming rank 2 near the deadline (a barrier would wait for it); rank 2 raises the same
    for r in res:
        err = r["absent"]["error"]
        assert err["type"] == "RanksTimeoutError" and err["missing"] == [2], (r["rank"], err)
    for r in (0, 1, 3):
        assert 1.0 < res[r]["absent"]["s"] < 1.5 + 5.0 + 2.0, res[r]["absent"]

    # rank 0 slow inside fn: the others give up naming rank 0 after timeout + 5 s; rank 0,
    # arriving later with every report in hand, raises that same error (it must not return
    # results the others never received)
    for r in res:
        err = r["leader_slow"]["error"]
        assert err["type"] == "RanksTimeoutError" and err["missing"] == [0], (r["rank"], err)


def test_one_process_runs_once_and_types_the_error() -> None:
    assert asyncckpt.on_every_rank(lambda: {"a": (1, 2)}) == [{"a": (1, 2)}]
    with pytest.raises(RanksFailedError) as ei:
        asyncckpt.on_every_rank(lambda: open("/nonexistent/asyncckpt/x"))
    assert not isinstance(ei.value, RanksTimeoutError)
    f = ei.value.failures[0]
    assert f.exc_type == "FileNotFoundError" and f.errno == errno.ENOENT and f.path == "/nonexistent/asyncckpt/x"
    assert isinstance(ei.value.__cause__, FileNotFoundError)


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), True, "5"])
def test_bad_timeout_is_refused_at_the_call(bad: Any) -> None:
    with pytest.raises(ValueError, match="timeout"):
        asyncckpt.on_every_rank(lambda: 1, timeout=bad)


def test_fn_must_be_callable() -> None:
    with pytest.raises(TypeError, match="callable"):
        asyncckpt.on_every_rank(42)  # type: ignore[arg-type]


def test_errors_pickle_with_their_fields() -> None:
    import pickle

    f = asyncckpt.RankFailure(2, "FileExistsError", "File exists", errno.EEXIST, "/x")
    e = pickle.loads(pickle.dumps(RanksTimeoutError("op", {2: f}, detail="d", missing=(1,))))
    assert isinstance(e, RanksTimeoutError) and e.failures == {2: f} and e.missing == (1,) and e.detail == "d"
    assert str(e) == "op: failed on rank(s) [2]: rank 2: FileExistsError[EEXIST]: File exists (path /x); " \
        "rank(s) [1] did not answer in time (d)"
