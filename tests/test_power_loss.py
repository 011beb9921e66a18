"""Power loss at every point of a real save: enumerate the crash states the disk may be left
in (``crashsim.py``) and check each with the library; then remove each fsync in turn and
require that the enumeration notices.

Figures are printed (run with ``-s``, or see them under ``-rA``).
"""

from __future__ import annotations

import os
from pathlib import Path

import crashsim as cs
import pytest

#: violation classes that are the library's core promises (the rest are the stricter ones)
CORE = ("no-checkpoint", "latest-broken", "committed-lost")
#: fsyncs that no crash state of this model needs, and why (see test docstrings)
REDUNDANT_SINGLE = {"fsync_dir(step_00000002.tmp)#1"}
REDUNDANT_RANKS = {"fsync_dir(step_00000002.tmp)[r0]#1", "fsync_dir(step_00000002.tmp)[r1]#1"}
#: fsyncs whose loss only the stricter properties see
STRICT_ONLY = {"fsync_dir(root)#1": "leaked", "fsync_dir(root)#3": "broken-committed-name"}


def _print(title: str, lines: list[str]) -> None:
    print(f"\n== {title}")
    for line in lines:
        print(f"   {line}")


def _full_run_holds(rec: cs.Recording, scratch: Path, title: str) -> cs.Report:
    report = cs.check_log(rec, scratch, title)
    _print(title, [report.line()])
    assert report.total == 0, "\n".join([report.line(), *report.examples, "log:", cs.describe_log(rec)])
    # the enumeration really covered the commit and retention, in every kind of state
    kinds = [op.kind for op in rec.log]
    assert {"mkdir", "create", "write", "fsync", "fsync_dir", "rename", "unlink", "rmdir"} <= set(kinds)
    assert any(op.kind == "rename" and ".deleting-" in op.dst for op in rec.log), "retention is not in the log"
    assert rec.committed_at() < len(rec.log)
    assert report.states > 2 * report.crash_points
    return report


# --------------------------------------------------------------------------- the model itself


def _synthetic(tmp_path: Path, ops: list[cs.Op]) -> cs.Recording:
    root = str(tmp_path / "r")
    fix = [cs.Op(o.kind, os.path.normpath(os.path.join(root, o.path)), os.path.join(root, o.dst) if o.dst else "",
                 o.offset, o.data, o.length, o.handle) for o in ops]  # fmt: skip
    return cs.Recording(root, {".": None}, fix, {})


def _trees(rec: cs.Recording) -> dict[int, set[cs.Tree]]:
    out: dict[int, set[cs.Tree]] = {}
    for s in cs.enumerate_states(cs.resolve(rec.root, rec.base, rec.log)):
        out.setdefault(s.k, set()).add(s.tree)
    return out


def test_model_file_data_and_dir_entries(tmp_path: Path) -> None:
    rec = _synthetic(tmp_path, [
        cs.Op("create", "f", handle="1"),
        cs.Op("write", "f", offset=0, data=b"abc", handle="1"),
        cs.Op("fsync_dir", ""),
        cs.Op("fsync", "f", handle="1"),
        cs.Op("write", "f", offset=3, data=b"de", handle="1"),
    ])  # fmt: skip
    t = _trees(rec)
    assert t[1] == {(), (("f", b""),)}  # the create may be lost
    assert t[2] == {(), (("f", b""),), (("f", b"abc"),), (("f", b"\0\0\0"),)}
    assert t[3] == {(("f", b""),), (("f", b"abc"),), (("f", b"\0\0\0"),)}  # the entry is durable now
    assert t[4] == {(("f", b"abc"),)}
    assert t[5] == {(("f", b"abc"),), (("f", b"abcde"),), (("f", b"abc\0\0"),)}


def test_model_directory_rename_carries_its_entries(tmp_path: Path) -> None:
    rec = _synthetic(tmp_path, [
        cs.Op("mkdir", "d.tmp"),
        cs.Op("fsync_dir", ""),
        cs.Op("create", "d.tmp/x", handle="1"),
        cs.Op("fsync", "d.tmp/x", handle="1"),
        cs.Op("rename", "d.tmp", dst="d"),
        cs.Op("fsync_dir", "d"),  # the same directory as d.tmp: makes the create durable
        cs.Op("fsync_dir", ""),
        cs.Op("unlink", "d/x"),
        cs.Op("rmdir", "d"),
    ])  # fmt: skip
    t = _trees(rec)
    assert t[5] == {(("d.tmp", None),), (("d.tmp", None), ("d.tmp/x", b"")), (("d", None),),
                    (("d", None), ("d/x", b""))}  # fmt: skip
    assert t[6] == {(("d.tmp", None), ("d.tmp/x", b"")), (("d", None), ("d/x", b""))}
    assert t[7] == {(("d", None), ("d/x", b""))}
    # unlink and rmdir pending: an rmdir of a non-empty directory is skipped
    assert t[9] == {(("d", None), ("d/x", b"")), (("d", None),), ()}


def test_model_unlinked_parent_leaks_its_entries(tmp_path: Path) -> None:
    rec = _synthetic(tmp_path, [
        cs.Op("mkdir", "d"),
        cs.Op("create", "d/x", handle="1"),
        cs.Op("fsync_dir", "d"),
    ])  # fmt: skip
    leaked = [s for s in cs.enumerate_states(cs.resolve(rec.root, rec.base, rec.log)) if s.leaked]
    assert leaked and all(s.tree == () for s in leaked if s.k == 3)


# --------------------------------------------------------------------------- one process


def test_single_process_save_survives_every_crash_state(tmp_path: Path) -> None:
    """Step 1 durable (syncfs), then step 2 with keep_last=1: 0 violations in every crash state."""
    rec = cs.record_single(tmp_path / "ck")
    report = _full_run_holds(rec, tmp_path / "scratch", "single process: steps 1 -> 2, keep_last=1")
    _print("log of step 2", [cs.describe_log(rec)])
    assert report.capped_points == 0


def test_single_process_each_fsync_is_needed(tmp_path: Path) -> None:
    """Re-record the save with the recorder's switch dropping one fsync/fsync_dir at a time.

    Every one but the rank's own ``fsync_dir(tmp)`` yields violations. That one is redundant
    on one kernel: the leader's ``fsync_dir(tmp)`` after the manifest rename persists every
    entry of the directory before the commit rename, whoever created it. (It still matters
    where ranks run on different clients of a network file system.) ``fsync_dir(root)#1``
    (after mkdir) only guards against a leaked attempt directory; ``fsync_dir(root)#3``
    (retention) only against a half-deleted ``step_N`` that is never cleaned up.
    """
    baseline = cs.record_single(tmp_path / "base")
    labels = cs.barrier_labels(baseline.log, baseline.root)
    assert len(labels) == 8, labels
    cache: dict[cs.Tree, cs.Verdict] = {}
    lines, silent = [], []
    for j, label in enumerate(labels):
        rec = cs.record_single(tmp_path / f"drop{j}", drop=j)
        assert cs.barrier_labels(rec.log, rec.root) == labels
        assert sum(op.kind == "dropped" for op in rec.log) == 1
        report = cs.check_log(rec, tmp_path / f"scratch{j}", f"without {label}", cache=cache)
        lines.append(report.line())
        if label in REDUNDANT_SINGLE:
            assert report.total == 0, report.line()
            continue
        if report.total == 0:
            silent.append(label)
            continue
        core = sum(report.violations[c] for c in CORE)
        if label in STRICT_ONLY:
            assert report.violations[STRICT_ONLY[label]] > 0 and core == 0, report.line()
        else:
            assert core > 0, report.line()
    _print("single process, each fsync removed (recorder switch)", lines)
    assert not silent, f"removing these fsyncs went unnoticed: {silent}"


# --------------------------------------------------------------------------- two real ranks


@pytest.mark.slow  # > 15 s in make test's parallel phase: make test-slow (and CI) runs it
@pytest.mark.timeout(150)
def test_two_gloo_ranks_survive_every_crash_state(tmp_path: Path) -> None:
    """A real 2-rank gloo run (two processes, one shard + structure file each), logs merged by time."""
    rec = cs.record_ranks(tmp_path)
    assert rec.world == 2
    assert {op.who for op in rec.log} == {"r0", "r1"}
    _full_run_holds(rec, tmp_path / "scratch", "2 gloo ranks: steps 1 -> 2, keep_last=1")
    labels = cs.barrier_labels(rec.log, rec.root)
    assert len(labels) == 11, labels
    cache: dict[cs.Tree, cs.Verdict] = {}
    lines, silent = [], []
    for j, label in enumerate(labels):
        report = cs.check_log(rec, tmp_path / f"scratch{j}", f"without {label}", log=cs.without_barrier(rec.log, j),
                              cache=cache)  # fmt: skip
        lines.append(report.line())
        if label in REDUNDANT_RANKS:
            assert report.total == 0, report.line()
        elif report.total == 0:
            silent.append(label)
    _print("2 gloo ranks, each fsync removed", lines)
    assert not silent, f"removing these fsyncs went unnoticed: {silent}"
