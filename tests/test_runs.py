"""A run is an identity (issue 26): every manifest records its run, resumes carry it, and a
collective load refuses to mix two commits of one step.

Real files, real processes: the manifest field under its seal; a local root's run made on the
empty root and carried through resumes; a step written before runs were recorded still loads
(and starts a new run); two gloo ranks whose views of one root path hold different commits of
the same step both refuse the load instead of each reading its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli_util import reseal, run_cli
from conftest import assert_same

import asyncckpt
from asyncckpt import CheckpointCorruptError, Checkpointer, CheckpointError
from asyncckpt.format._checksum import crc32c
from asyncckpt.format._manifest import MANIFEST, FileEntry, decode, encode
from asyncckpt.roots._badmarks import bad_mark
from asyncckpt.roots.posix._discovery import read_manifest

pytestmark = pytest.mark.timeout(120)


def state_for(step: int) -> dict[str, Any]:
    return {"w": torch.arange(step, step + 64, dtype=torch.float32), "step": step}


def _manifest(step_dir: Path) -> Any:
    return read_manifest(str(step_dir))


def test_the_run_is_a_sealed_manifest_field_and_older_manifests_decode_without_one() -> None:
    files = [FileEntry("rank00000.safetensors", 8, 1, 0), FileEntry("rank00000.json", 2, 2, 0)]
    run = "0123456789abcdef0123456789abcdef"
    raw = encode(3, "ab12", 1, 8, 1.5, files, {}, ranks=[0], run=run)
    assert decode(raw, "m").run == run
    old = encode(3, "ab12", 1, 8, 1.5, files, {}, ranks=[0])  # as written before runs were recorded
    assert b'"run"' not in old and decode(old, "m").run is None
    # under the seal: another run id in the same bytes is a checksum mismatch, not another run
    forged = raw.replace(run.encode(), b"f" * 32)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        decode(forged, "m")
    # a run id that is not a hex token: refused by the writer, malformed for the reader
    with pytest.raises(ValueError, match="run id"):
        encode(3, "ab12", 1, 8, 1.5, files, {}, run="../x")
    doc = json.loads(old)
    doc.pop("checksum")
    doc["run"] = "NOT-HEX"
    canon = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    bad = json.dumps(dict(doc, checksum=crc32c(canon)), sort_keys=True, indent=1, ensure_ascii=True).encode() + b"\n"
    with pytest.raises(CheckpointCorruptError, match="bad run id"):
        decode(bad, "m")


def test_a_run_starts_on_an_empty_root_and_is_carried_through_resumes(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        run = ck.run_id
        assert len(run) == 32 and int(run, 16) >= 0
        info = ck.save(1, state_for(1)).result(timeout=30)
        assert info.run == run
    assert _manifest(root / "step_00000001").run == run
    with Checkpointer(root, keep_last=1) as ck:  # a resume: the same run
        assert ck.run_id == run
        ck.save(2, state_for(2))
    assert _manifest(root / "step_00000002").run == run
    latest = asyncckpt.find_latest(root)
    assert latest is not None and latest.step == 2 and latest.run == run
    with Checkpointer(root) as ck:
        latest = ck.latest()
        assert latest is not None and latest.run == run
    with Checkpointer(tmp_path / "other") as ck:  # another empty root: another run
        assert ck.run_id != run
    # ls and info show it
    r = run_cli("ls", root, "--json")
    assert r.code == 0, r.err
    assert [row.get("run") for row in json.loads(r.out)] == [run]
    r = run_cli("ls", root)
    assert r.code == 0 and run[:12] in r.out, r.out
    r = run_cli("info", root)
    assert r.code == 0 and run in r.out, r.out


def test_a_step_written_before_runs_were_recorded_loads_and_the_resume_starts_a_new_run(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(4, state_for(4))
    sd = root / "step_00000004"
    reseal(sd, MANIFEST)  # the same manifest, sealed again without the run (as an older writer did)
    assert b'"run"' not in (sd / MANIFEST).read_bytes() and _manifest(sd).run is None
    assert_same(asyncckpt.load(root), state_for(4))
    with Checkpointer(root) as ck:
        assert len(ck.run_id) == 32  # a new run: there was none to carry
        assert_same(ck.load(), state_for(4))
        ck.save(5, state_for(5))
        run = ck.run_id
    assert _manifest(root / "step_00000005").run == run
    with Checkpointer(root) as ck:
        assert ck.run_id == run


def test_two_ranks_whose_views_hold_different_commits_of_a_step_both_refuse_the_load(tmp_path: Path) -> None:
    """Rank 0 names the commit (step and attempt) every rank reads; a rank whose view of the
    root holds another commit of that step refuses, and so every rank raises: nobody gets a
    state mixed from two commits (before: each rank loaded its own view's step 5). Rank 1's
    view changes after construction (a bind mount in its own mount namespace): construction
    refuses ranks that do not share the root at all (tests/test_node_local.py)."""
    from _ranks import free_port, log_tail, run_ranks

    if os.geteuid() != 0:
        pytest.skip(f"needs root/mount namespaces: a bind mount in a private mount namespace (euid {os.geteuid()})")

    root_a, root_b, link = tmp_path / "a", tmp_path / "b", tmp_path / "root"
    os.symlink(root_a, link)
    worker = str(Path(__file__).parent / "support" / "_runs_worker.py")
    port = free_port()

    def argv(r: int) -> list[str]:
        return [worker, str(r), "2", str(port), str(root_a), str(root_b), str(link), str(tmp_path / f"out{r}.json")]

    hung = run_ranks(argv, 2, tmp_path, deadline=100)
    assert not hung, [log_tail(tmp_path, r) for r in hung]
    results = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(2)]
    assert all(res.get("ok") for res in results), (results, [log_tail(tmp_path, r) for r in range(2)])
    assert results[0]["root"] == results[1]["root"] == str(root_a.resolve())
    assert results[0]["view"] != results[1]["view"]  # two commits (attempts) of step 5
    assert not os.path.ismount(root_a)  # the bind mount stayed in rank 1's namespace
    for res in results:
        for how in ("newest", "explicit"):
            got = res[how]
            assert got.get("error") == "CheckpointError", (how, res)  # neither NotFound nor Corrupt: no fallback
            assert "rank 0 chose" in got["msg"] and "attempt" in got["msg"], got
    # nothing was marked bad or moved: each view still loads on its own
    for root, which in ((root_a, "a"), (root_b, "b")):
        assert bad_mark(root, 5, _manifest(root / "step_00000005").attempt) is None
        assert asyncckpt.load(root, rank=1)["which"] == which


def test_a_collective_load_names_the_commit_it_chose(tmp_path: Path) -> None:
    """The check itself, on one process: a read of another attempt than the one chosen raises
    ``CheckpointError`` (not corrupt: nothing is marked), the chosen one loads."""
    from asyncckpt.loading import _resume
    from asyncckpt.roots import _runs, open_root

    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(1, state_for(1))
    chosen = _runs.choice_at(open_root(str(root)), 1)
    assert chosen[0] == 1 and chosen[1] == _manifest(root / "step_00000001").attempt and chosen[2] is not None
    assert _runs.choice_at(open_root(str(root)), 9) == [9, None, None]
    step, attempt = _runs.unpack(chosen)
    assert_same(_resume.attempt(str(root), step, 0, True, expect=attempt), state_for(1))
    with pytest.raises(CheckpointError, match="rank 0 chose") as ei:
        _resume.attempt(str(root), step, 0, True, expect="0" * 16)
    assert type(ei.value) is CheckpointError
    assert bad_mark(root, 1, attempt) is None  # another commit is not damage
