"""What a reader may trust when the storage misbehaves: a red team's reproductions for issue 26
("committed means resumable") against its merged fixes, each fixed since and kept as a test.

Real files, the FUSE fault file system (``tests/support/faultfs.py``, skipped with ``needs root/FUSE:``
where it cannot mount), the CLI as a real process, a real SeaweedFS behind the fault proxy for
the tier tests. Each test's docstring names its finding:

A. An unreadable ``.asyncckpt/bad`` (EIO) hid every bad mark: ``latest()`` answered the
   known-bad step and ``gc --keep-last 1`` retired the last good step. Now unreadable marks
   are a ``CheckpointReadError``: gc exits 1 with nothing removed, retention retires nothing.
B. A bad mark that could not be written (ENOSPC/EIO on ``.asyncckpt/bad``) lost the fallback:
   the process that proved the step corrupt now remembers it, and warns.
C. A stray file in a step directory made an intact checkpoint "known bad" and
   ``gc --remove-bad`` deleted it. A file the manifest does not list is now ignored and named.
D. A shard header between 100,000,000 and 100 MiB: ``export`` wrote a ``.safetensors`` the
   safetensors library refuses. Now save() refuses such a header and export refuses it up front.
E. Tier mode: a store unreadable at construction turned the step rule off. Now the rule stays
   pending: save() looks again, uploads check first.
F. One transient ENOENT on a listed shard (a stale negative dentry) was taken for corruption.
   Now a missing listed file is looked up once more before it is called missing.
G. ``asyncckpt import`` wrote into a root a live Checkpointer owns. Now it takes ownership.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli_util import run_cli
from faultfs import FaultFS, mounted, rule

import asyncckpt
from asyncckpt import Checkpointer


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((1024,), float(step)), "step": step}


def shard(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}" / "rank00000.safetensors"


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))


def names(root: str | Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step_"))


def saved(root: str | Path, steps: tuple[int, ...]) -> None:
    with Checkpointer(root) as ck:
        for s in steps:
            ck.save(s, state(s)).result(timeout=60)


# ------------------------------------------------------------------------------ a FUSE mount
@pytest.fixture(scope="module")
def mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFS]:
    base = tmp_path_factory.mktemp("attack26")
    with mounted(base / "backing", base / "mnt", direct_io=True, skip_unavailable=True) as fs:
        yield fs


@pytest.fixture
def fs(mount: FaultFS) -> Iterator[FaultFS]:
    mount.clear()
    mount.reset_events()
    yield mount
    mount.clear()


def newest_known_bad(root: str) -> None:
    """Steps 5, 10, 15; 15 has a flipped byte and `verify` marked it bad."""
    saved(root, (5, 10, 15))
    flip(shard(root, 15))
    r = run_cli("verify", root, "--step", "15")
    assert r.code == 1 and os.listdir(Path(root) / ".asyncckpt" / "bad"), r.err


#: EIO on every look at the bad marks (a bad sector under that one directory, a FUSE server
#: failing on it): the step directories stay perfectly readable.
MARKS_EIO = rule(["readdir", "open", "read"], path="/.asyncckpt/bad", error="EIO", id="m")


# ------------------------------------------------------------------------------ A
@pytest.mark.needs_root
def test_a_gc_with_unreadable_bad_marks_never_retires_the_last_good_step(fs: FaultFS) -> None:
    """A: gc cannot read the marks, so it cannot tell the known-bad step 15 from a good one:
    it refuses (exit 1, naming the marks) and removes nothing."""
    root = fs.path("a-gc")
    newest_known_bad(root)
    fs.set_rules([MARKS_EIO])
    r = run_cli("gc", root, "--keep-last", "1", "--min-age", "0")
    fs.clear()
    assert fs.fired("m") >= 1
    # before: exit 0, "retired step 5, retired step 10, keeping 1 complete checkpoint(s): step 15"
    assert "step_00000010" in names(root), (r.code, r.out, r.err)
    # a typed refusal naming the marks, and nothing removed
    assert r.code == 1 and "cannot read the bad marks" in r.err and ".asyncckpt/bad" in r.err, (r.code, r.err)
    assert names(root) == ["step_00000005", "step_00000010", "step_00000015"]
    assert asyncckpt.load(root)["step"] == 10


@pytest.mark.needs_root
def test_a_retention_with_unreadable_bad_marks_retires_nothing(fs: FaultFS) -> None:
    """A: the library's ``keep_last`` asks the same rule: marks it cannot read stop retention
    (logged), the save itself commits."""
    root = fs.path("a-keep")
    newest_known_bad(root)
    with Checkpointer(root, keep_last=1) as ck:
        fs.set_rules([MARKS_EIO])
        ck.save(20, state(20)).result(timeout=60)
        ck.flush()
        fs.clear()
    assert fs.fired("m") >= 1
    assert names(root) == ["step_00000005", "step_00000010", "step_00000015", "step_00000020"]


@pytest.mark.needs_root
def test_a_latest_never_answers_a_known_bad_step_while_the_marks_are_unreadable(fs: FaultFS) -> None:
    """A: find_latest() raises CheckpointReadError naming the marks rather than answer step 15."""
    root = fs.path("a-latest")
    newest_known_bad(root)
    fs.set_rules([MARKS_EIO])
    try:
        found: Any = asyncckpt.find_latest(root)
    except asyncckpt.CheckpointReadError as e:  # an I/O error said as such keeps the promise
        found = e
    fs.clear()
    assert not (isinstance(found, asyncckpt.CheckpointInfo) and found.step == 15), found
    assert isinstance(found, asyncckpt.CheckpointReadError) and ".asyncckpt/bad" in str(found), found


# ------------------------------------------------------------------------------ B
@pytest.mark.needs_root
def test_b_the_resume_recipe_continues_when_the_bad_mark_cannot_be_written(
    fs: FaultFS, caplog: pytest.LogCaptureFixture
) -> None:
    """B: the process that proved step 15 corrupt remembers it although its mark could not be
    written, and says so; the recipe's save(15) sets the bad attempt aside and commits."""
    root = fs.path("b-nomark")
    saved(root, (5, 10, 15))
    flip(shard(root, 15))
    with Checkpointer(root) as ck:
        # the disk is full (or .asyncckpt/bad is not writable) while the run resumes
        fs.set_rules([rule(["mkdir", "create", "write", "rename"], path="/.asyncckpt/bad", error="ENOSPC", id="m")])
        got = ck.load()
        fs.clear()
        assert got["step"] == 10  # fell back past the corrupt 15, as documented
        assert not os.path.isdir(Path(root) / ".asyncckpt" / "bad") or not os.listdir(Path(root) / ".asyncckpt" / "bad")
        # this very process just proved 15 corrupt; today: latest() answers 15 and
        # save(15) raises "ValueError: step 15 is already committed"
        latest = ck.latest()
        assert latest is not None and latest.step == 10, latest
        assert "could not record that step 15" in caplog.text and "this process remembers it" in caplog.text
        ck.save(15, state(15)).result(timeout=60)
        latest = ck.latest()
        assert latest is not None and latest.step == 15
    assert asyncckpt.load(root)["step"] == 15
    assert [n for n in os.listdir(root) if n.startswith("step_00000015.bad-")], os.listdir(root)


# ------------------------------------------------------------------------------ C
def test_c_gc_remove_bad_never_deletes_a_checkpoint_whose_bytes_all_verify(tmp_path: Path) -> None:
    """C: a file the manifest does not list (a user's note) is ignored and named, never damage:
    the step stays resumable, ``verify`` passes, ``gc --remove-bad`` keeps it."""
    root = tmp_path / "ck"
    saved(root, (10,))
    (root / "step_00000010" / "NOTES.txt").write_text("lr looked fine here\n")  # a user's note, an editor's file
    r = run_cli("ls", root, "--json")
    (row,) = json.loads(r.out)
    # before: "bad", "unexpected file(s) not in the manifest: NOTES.txt"
    assert (row["status"], row["resumable"], row["problem"]) == ("complete", True, None), row
    assert "NOTES.txt" in row["note"], row
    assert "NOTES.txt" in run_cli("ls", root).out
    v = run_cli("verify", root)
    assert v.code == 0 and "NOTES.txt" in v.err, (v.out, v.err)
    g = run_cli("gc", root, "--remove-bad", "--min-age", "0")
    assert g.code == 0, g.err
    # before: "removed step_00000010 (known bad: unexpected file(s) not in the manifest: NOTES.txt)"
    assert shard(root, 10).exists(), g.out
    assert asyncckpt.load(root)["step"] == 10 and asyncckpt.find_latest(root).step == 10  # type: ignore[union-attr]


def test_c_a_stray_file_beside_real_damage_still_says_the_damage(tmp_path: Path) -> None:
    """C: ignoring unlisted files hides no damage: a truncated shard beside a stray file is
    known bad for its size, and ``gc --remove-bad`` removes it."""
    root = tmp_path / "ck"
    saved(root, (5, 10))
    (root / "step_00000010" / "NOTES.txt").write_text("x")
    with open(shard(root, 10), "r+b") as f:
        f.truncate(100)
    (_, row) = json.loads(run_cli("ls", root, "--json").out)
    assert (row["status"], row["problem"]) == ("bad", "size-mismatch"), row
    g = run_cli("gc", root, "--remove-bad", "--min-age", "0")
    assert g.code == 0 and names(root) == ["step_00000005"], (g.out, g.err)


# ------------------------------------------------------------------------------ D
#: 101 tensors with 1,000,000-byte names: a 101 MB header, between safetensors' 100,000,000
#: bytes and the 100 MiB our readers take.
def long_names() -> dict[str, torch.Tensor]:
    return {f"{i:03d}" + "n" * 1_000_000: torch.full((1,), float(i)) for i in range(101)}


def test_d_save_refuses_a_header_safetensors_would_refuse(tmp_path: Path) -> None:
    """D: every file save() writes opens with safetensors (the shards are plain safetensors):
    a header over 100,000,000 bytes is refused at the call, naming the limit; nothing commits."""
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        with pytest.raises(ValueError, match=r"100,000,000-byte limit of safetensors readers"):
            ck.save(1, long_names())
        assert ck.steps() == []


def test_d_export_refuses_a_header_safetensors_would_refuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """D: a shard an earlier version wrote with such a header (save()'s limit was 100 MiB: made
    here by raising today's writer limit back for one save) still loads; ``export`` refuses it
    up front, naming the safetensors limit: exit 1, no file left (before: exit 0 and a file
    safetensors cannot open, "header too large")."""
    from asyncckpt.format import _header

    root = tmp_path / "ck"
    monkeypatch.setattr(_header, "SAFETENSORS_MAX_HEADER", _header.MAX_HEADER)  # the earlier writer
    with Checkpointer(root) as ck:
        ck.save(1, long_names()).result(timeout=120)
    monkeypatch.undo()
    head = int.from_bytes(shard(root, 1).read_bytes()[:8], "little")
    assert 100_000_000 < head <= 100 * 2**20, head
    assert len(asyncckpt.load(root, 1)) == 101  # load is what must hold
    out = tmp_path / "model.safetensors"
    r = run_cli("export", root, "--to", out, timeout=120)
    assert r.code == 1, (r.code, r.err[-500:])
    assert "100,000,000-byte limit of safetensors readers" in r.err and "--key" in r.err, r.err[-500:]
    assert len(r.err) < 2000  # the names are shown shortened
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no file, no temporary left


# ------------------------------------------------------------------------------ E
@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    from s3fixtures import require_s3, shared_server

    require_s3()
    with shared_server("attack26") as server:
        yield server


@pytest.fixture
def proxy(s3: Any) -> Iterator[Any]:
    from s3proxy import FaultProxy

    p = FaultProxy(s3.s3_port, max_lifetime=150).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.mark.timeout(120)
def test_e_a_store_briefly_unreadable_at_construction_still_refuses_lower_steps(
    tmp_path: Path, s3: Any, proxy: Any
) -> None:
    """E: the step rule across tiers stays on when construction could not read the store:
    the first save() looks again and refuses step 1 below the other run's step 1000."""
    from s3fixtures import opts
    from s3proxy import Rule

    from asyncckpt import remote

    url = f"s3://attack26/e-{uuid.uuid4().hex[:8]}"
    o = opts(s3.endpoint)
    with Checkpointer(tmp_path / "old", mirror=url, storage_options=o) as ck:  # an older run: 900, 1000
        for s in (900, 1000):
            ck.save(s, state(s))
            ck.flush(timeout=60)
    proxy.add(Rule("status", times=10_000))  # 503 while the new job (empty local disk) starts
    with Checkpointer(
        tmp_path / "new", mirror=url, keep_last_remote=1, storage_options=opts(proxy.endpoint), timeout=5
    ) as ck:
        proxy.clear()  # the store is fine again before the first save
        run = ck.run_id
        accepted = True
        try:
            ck.save(1, state(1))
        except ValueError:
            accepted = False
        if accepted:
            ck.flush(timeout=60)
    on_store = sorted(s.step for s in remote.scan(url, storage_options=o) if s.complete)
    if accepted:
        # the consequence: a new node (empty disk) resumes the other run's 1000, not this run's 1
        with Checkpointer(tmp_path / "node2", mirror=url, storage_options=o) as ck:
            latest = ck.latest()
            print("store", on_store, "restart resumes", latest and (latest.step, latest.run != run))
    # before: accepted; the store holds [1, 900, 1000]
    assert not accepted, on_store
    assert on_store == [900, 1000]


@pytest.mark.timeout(120)
def test_e_a_store_unreadable_until_after_the_first_save_gets_no_lower_upload(
    tmp_path: Path, s3: Any, proxy: Any
) -> None:
    """E: while the store stays unreadable, save() goes on locally (the store never stops
    training) and the rule is checked before each upload: once the store answers, a step below
    its newest is refused (a SaveError at flush naming both steps), never uploaded."""
    from s3fixtures import opts
    from s3proxy import Rule

    from asyncckpt import SaveError, remote

    url = f"s3://attack26/e2-{uuid.uuid4().hex[:8]}"
    o = opts(s3.endpoint)
    with Checkpointer(tmp_path / "old", mirror=url, storage_options=o) as ck:  # an older run: 900, 1000
        for s in (900, 1000):
            ck.save(s, state(s))
            ck.flush(timeout=60)
    proxy.add(Rule("status", times=100_000))  # 503 through construction and the first save
    with Checkpointer(
        tmp_path / "new", mirror=url, keep_last_remote=1, storage_options=opts(proxy.endpoint), timeout=5
    ) as ck:
        ck.save(1, state(1)).result(timeout=60)  # local durability: the store is not needed for it
        with pytest.raises(SaveError):  # the upload of step 1 failed on the 503s
            ck.flush(timeout=60)
        proxy.clear()
        ck.save(2, state(2)).result(timeout=60)  # the next look at save() is not due yet (once a minute)
        with pytest.raises(SaveError, match="holds step 1000") as ei:
            ck.flush(timeout=60)
        assert isinstance(ei.value.__cause__, ValueError), ei.value.__cause__
        assert ck.steps() == [1, 2]  # the local commits stand
    assert sorted(s.step for s in remote.scan(url, storage_options=o) if s.complete) == [900, 1000]


# ------------------------------------------------------------------------------ F
@pytest.mark.needs_root
def test_f_one_transient_enoent_never_makes_load_fall_back(fs: FaultFS) -> None:
    """F: a listed file a lookup says is missing is looked up once more (a fresh handle on the
    same directory) before the step is called corrupt: no fallback, no mark."""
    fell_back: list[tuple[int, int]] = []
    fired: list[int] = []
    for skip in range(5):  # whichever lookup of the load it lands on
        root = fs.path(f"f-{skip}")
        saved(root, (10, 15))
        with Checkpointer(root) as ck:
            # one lookup of step 15's shard answers ENOENT: a stale negative dentry (NFS,
            # virtiofs, Lustre: tests/support/faultfs.py's stale_s), a FUSE server's glitch
            fs.set_rules(
                [
                    rule(
                        ["getattr", "open"],
                        glob="*/step_00000015/rank00000.safetensors",
                        error="ENOENT",
                        count=1,
                        skip=skip,
                        id="n",
                    )
                ]
            )
            got = ck.load()["step"]
            fired.append(fs.fired("n"))
            fs.clear()
            if got != 15:
                fell_back.append((skip, got))
                # the README recipe continues from what it loaded; today: "ValueError: step 11 is
                # lower than step 15, the newest committed checkpoint"
                with pytest.raises(ValueError, match="lower than step 15"):
                    ck.save(11, state(11))
    # an ENOENT that the next look contradicts says nothing about the checkpoint
    assert fell_back == [], fell_back
    assert fired == [1, 2, 3, 4, 5], fired  # the fault landed once in every round (counts add up)
    assert not any((Path(fs.path(f"f-{k}")) / ".asyncckpt" / "bad").exists() for k in range(5))


@pytest.mark.needs_root
def test_f_one_transient_enoent_never_makes_verify_mark_a_step_bad(fs: FaultFS) -> None:
    """F: ``verify`` opens the listed files by path; one ENOENT there is looked at again too."""
    root = fs.path("f-verify")
    saved(root, (10,))
    fs.set_rules([rule(["open"], glob="*/step_00000010/rank00000.safetensors", error="ENOENT", count=1, id="n")])
    r = run_cli("verify", root, "--step", "10")
    fs.clear()
    assert fs.fired("n") == 1
    assert r.code == 0, r.err
    assert not (Path(root) / ".asyncckpt" / "bad").exists()


def test_f_a_listed_file_really_missing_still_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """F: the second look changes nothing for a file that is really gone: corrupt, marked,
    load() falls back (and says so)."""
    root = tmp_path / "ck"
    saved(root, (10, 15))
    shard(root, 15).unlink()
    assert asyncckpt.load(root)["step"] == 10
    assert "listed in the manifest is missing" in caplog.text
    assert asyncckpt.find_latest(root).step == 10  # type: ignore[union-attr]
    rows = json.loads(run_cli("ls", root, "--json").out)
    got = [(r["step"], r["status"], r["problem"]) for r in rows]
    assert got == [(10, "complete", None), (15, "bad", "missing-file")]


# ------------------------------------------------------------------------------ G
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")  # dcp.save without a process group
def test_g_import_refuses_a_root_a_checkpointer_owns(tmp_path: Path) -> None:
    """G: import takes the root's ownership, as gc and pull do: refused (exit 1, naming the
    owner) while a Checkpointer owns the root; the job's steps are untouched; once the job
    closed, the import goes through."""
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    dcp.save({"model": {"w": torch.randn(64)}}, storage_writer=dcp.FileSystemWriter(src, thread_count=1))
    root = tmp_path / "ck"
    with Checkpointer(root, keep_last=1) as ck:
        ck.save(20, state(20)).result(timeout=60)
        p = subprocess.run([sys.executable, "-m", "asyncckpt", "import", str(src), str(root), "--step", "1000",
                            "--allow-pickle"], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))  # fmt: skip
        ck.save(21, state(21)).result(timeout=60)
        ck.flush()
        left = names(root)
    # gc and pull refuse a root a Checkpointer owns (RootInUseError, exit 1); today import
    # exits 0, and the job's retention then retires the step it has just committed:
    # left == ['step_00001000']
    assert p.returncode == 1 and "step_00000021" in left, (p.returncode, p.stdout, p.stderr[-300:], left)
    assert "already owned by another writer" in p.stderr and "pid" in p.stderr, p.stderr[-500:]
    assert left == ["step_00000021"]  # nothing of the import's left either
    assert not [n for n in os.listdir(root) if n.startswith("step_00001000")]
    r = run_cli("import", src, root, "--step", "1000", "--allow-pickle", timeout=120)
    assert r.code == 0, r.err[-500:]
    assert names(root) == ["step_00000021", "step_00001000"]
