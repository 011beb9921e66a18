"""Issue 26, problems 2 and 3: "resumable" is defined once (``_stepstates``) and every reader,
writer and tool asks it. Real roots, real flipped bytes, the CLI as a real process, two real
gloo ranks; the object-store variants are in ``test_s3_resumable.py``.

* ``gc --keep-last 1`` after a verification marked the newest step bad keeps the newest good
  step (and says why), exactly as ``--dry-run`` predicted; retention by ``keep_last`` in the
  library counts the same way.
* after ``load()`` falls back past a corrupt newest step N, ``latest()`` no longer answers N,
  the README's resume recipe saves N again (the bad attempt is set aside, ``ls`` shows it)
  and goes on; ``info``/``export`` without ``--step`` take the newest resumable step and say so.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli_util import run_cli, strict_json
from _ranks import free_port, log_tail, run_ranks

import asyncckpt
from asyncckpt import Checkpointer
from asyncckpt.format._manifest import MANIFEST, decode
from asyncckpt.roots._badmarks import bad_mark

WORKER = str(Path(__file__).parent / "support" / "_fallback_worker.py")
STEPS = (5, 10, 15)


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((2048,), float(step)), "extra": {"step": step}}


def flip(path: Path, offset: int = -5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def sd(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def attempt_of(root: Path, step: int) -> str:
    return decode((sd(root, step) / MANIFEST).read_bytes(), "").attempt


def shard(root: Path, step: int) -> Path:
    return sd(root, step) / "rank00000.safetensors"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ck"
    with Checkpointer(r) as ck:
        for s in STEPS:
            ck.save(s, state(s)).result(timeout=60)
    return r


def names(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step_"))


# ------------------------------------------------------------------------ problem 2: gc


def test_gc_keep_last_keeps_the_newest_good_step_past_a_bad_one(root: Path) -> None:
    flip(shard(root, 15))
    r = run_cli("verify", root, "--step", "15")
    assert r.code == 1 and str(shard(root, 15)) in r.err
    dry = run_cli("gc", root, "--keep-last", "1", "--min-age", "0", "--dry-run", "--json")
    assert dry.code == 0, dry.err
    predicted = strict_json(dry.out)
    assert [x["step"] for x in predicted["retired"]] == [5] and predicted["kept_steps"] == [10]
    assert predicted["newest_known_bad"] == 15
    assert [(b["name"], b["kind"], b["removed"]) for b in predicted["bad"]] == [("step_00000015", "bad", False)]
    text = run_cli("gc", root, "--keep-last", "1", "--min-age", "0", "--dry-run")
    assert "warning: step 15, the highest, is known bad; step 10 is the newest resumable one" in text.err
    assert "kept step_00000015: known bad" in text.out and "would retire step 5" in text.out
    real = run_cli("gc", root, "--keep-last", "1", "--min-age", "0", "--json")
    assert real.code == 0, real.err
    done = strict_json(real.out)
    assert done["retired"] == predicted["retired"] and done["kept_steps"] == predicted["kept_steps"]
    assert names(root) == ["step_00000010", "step_00000015"]  # the bad one is kept for inspection
    assert asyncckpt.load(root)["extra"]["step"] == 10
    latest = asyncckpt.find_latest(root)
    assert latest is not None and latest.step == 10
    # a second gc does not retire step 10 either: the newest step that is not known bad stays
    again = strict_json(run_cli("gc", root, "--keep-last", "1", "--min-age", "0", "--json").out)
    assert again["retired"] == [] and again["kept_steps"] == [10]


def test_gc_remove_bad_removes_only_known_bad_entries(root: Path) -> None:
    flip(shard(root, 15))
    assert run_cli("verify", root, "--step", "15").code == 1
    a15 = attempt_of(root, 15)
    r = run_cli("gc", root, "--remove-bad", "--min-age", "0", "--json")
    assert r.code == 0, r.err
    doc = strict_json(r.out)
    assert [(b["name"], b["removed"]) for b in doc["bad"]] == [("step_00000015", True)]
    assert names(root) == ["step_00000005", "step_00000010"]
    assert bad_mark(root, 15, a15) is None  # its mark went with it
    # with nothing known bad, --remove-bad removes nothing
    assert strict_json(run_cli("gc", root, "--remove-bad", "--min-age", "0", "--json").out)["bad"] == []
    assert names(root) == ["step_00000005", "step_00000010"]


def test_library_keep_last_never_counts_a_known_bad_step(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    flip(shard(root, 15))
    with Checkpointer(root, keep_last=2) as ck:
        with caplog.at_level(logging.WARNING, logger="asyncckpt"):
            assert ck.load()["extra"]["step"] == 10  # falls back; 15 is known bad from now on
        ck.save(16, state(16)).result(timeout=60)
        ck.flush()
        # counted: 10 and 16 (15 is not resumable); retired: 5 only. Counting 15 would retire 10
        assert ck.steps() == [10, 16]
    assert names(root) == ["step_00000010", "step_00000015", "step_00000016"]


# ------------------------------------------------------------------- problem 3: fallback


def run_recipe(root: Path, until: int, **kw: Any) -> list[int]:
    """The README's resume recipe ("The API in one screen"), saving every 5 steps."""
    saved = []
    ckpt = Checkpointer(root, keep_last=3, **kw)
    start = 0
    if ckpt.latest() is not None:
        st_ = ckpt.load(into={"w": torch.zeros(2048)})
        start = st_["extra"]["step"] + 1
    for step in range(start, until + 1):
        if step % 5 == 0 and step > 0:
            ckpt.save(step, state(step))
            saved.append(step)
    ckpt.close()
    return saved


@pytest.mark.parametrize("allow_earlier", [False, True])
def test_resume_recipe_continues_after_falling_back_past_a_corrupt_newest_step(
    tmp_path: Path, allow_earlier: bool, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    assert run_recipe(root, 15, allow_earlier_steps=allow_earlier) == [5, 10, 15]
    bad = shard(root, 15)
    flip(bad)
    old = attempt_of(root, 15)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        assert run_recipe(root, 25, allow_earlier_steps=allow_earlier) == [15, 20, 25]
    assert any("falling back" in r.getMessage() and str(bad) in r.getMessage() for r in caplog.records)
    assert any("set aside" in r.getMessage() for r in caplog.records)
    aside = f"step_00000015.bad-{old}"
    assert names(root) == sorted([aside, "step_00000015", "step_00000020", "step_00000025"])
    assert asyncckpt.load(root, 15)["extra"]["step"] == 15  # the new step 15
    assert attempt_of(root, 15) != old
    latest = asyncckpt.find_latest(root)
    assert latest is not None and latest.step == 25
    rows = {d["name"]: d for d in strict_json(run_cli("ls", root, "--json").out)}
    assert rows[aside]["status"] == "aside" and rows[aside]["resumable"] is False
    assert rows[aside]["bad"]["path"] == str(bad)  # the verdict on that attempt goes with it
    assert rows["step_00000015"]["status"] == "complete" and rows["step_00000015"]["bad"] is None
    table = run_cli("ls", root).out
    line = next(ln for ln in table.splitlines() if aside in ln)
    assert line.split()[1] == "aside" and "set aside" in line and "kept for inspection" in line
    # a later start neither removes it nor takes it for a leftover
    with Checkpointer(root) as ck:
        assert ck.steps() == [15, 20, 25]
    assert aside in names(root)


def test_after_a_fallback_latest_skips_the_bad_step_and_saving_it_again_commits(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    flip(shard(root, 15))
    with Checkpointer(root) as ck:
        latest = ck.latest()
        assert latest is not None and latest.step == 15  # nobody has read its data yet
        with caplog.at_level(logging.WARNING, logger="asyncckpt"):
            assert ck.load()["extra"]["step"] == 10
        latest = ck.latest()
        assert latest is not None and latest.step == 10
        assert ck.steps() == [5, 10]
        assert asyncckpt.find_latest(root).step == 10  # type: ignore[union-attr]
        with pytest.raises(ValueError, match="lower than step 10"):
            ck.save(7, state(7))  # the rule still holds for the good steps
        ck.save(15, state(15)).result(timeout=60)
        with pytest.raises(ValueError, match="step 15 is already committed"):
            ck.save(15, state(15))  # the new one is resumable: not again
        ck.save(20, state(20)).result(timeout=60)
        assert ck.steps() == [5, 10, 15, 20]


def test_a_corrupt_manifest_is_known_bad_and_its_step_saves_again(root: Path) -> None:
    flip(sd(root, 15) / MANIFEST, 3)  # the manifest's own checksum fails: a proven content fault
    with Checkpointer(root) as ck:
        assert ck.latest().step == 10  # type: ignore[union-attr]
        assert ck.load()["extra"]["step"] == 10
        ck.save(15, state(15)).result(timeout=60)
    assert asyncckpt.load(root)["extra"]["step"] == 15
    assert len([n for n in names(root) if n.startswith("step_00000015.bad-")]) == 1


def test_a_directory_without_a_manifest_is_not_moved(root: Path) -> None:
    (sd(root, 15) / MANIFEST).unlink()  # not provably a checkpoint (maybe not ours): never moved
    with Checkpointer(root) as ck:
        assert ck.latest().step == 10  # type: ignore[union-attr]
        with pytest.raises(asyncckpt.SaveError, match="not a complete checkpoint"):
            ck.save(15, state(15)).result(timeout=60)
        with pytest.raises(asyncckpt.SaveError):
            ck.flush()
    assert names(root) == ["step_00000005", "step_00000010", "step_00000015"]


def test_info_and_export_without_a_step_take_the_newest_resumable_and_say_so(root: Path, tmp_path: Path) -> None:
    flip(shard(root, 15))
    assert asyncckpt.load(root)["extra"]["step"] == 10  # marks 15
    r = run_cli("info", root)
    assert r.code == 0 and r.out.startswith("step 10 "), (r.out, r.err)
    assert f"passed over step 15 (known bad: verification failed: checksum mismatch: {shard(root, 15)})" in r.err
    assert "showing step 10, the newest resumable one" in r.err
    out = tmp_path / "w.safetensors"
    r = run_cli("export", root, "--to", out, "--json")
    assert r.code == 0 and strict_json(r.out)["step"] == 10, r.err
    assert "passed over step 15" in r.err and "exporting step 10" in r.err
    r = run_cli("verify", root)
    assert r.code == 0 and r.out.startswith("step 10: ok") and "passed over step 15" in r.err


def test_a_mark_names_the_file_once_as_an_absolute_path(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = shard(root, 15)
    flip(bad)
    monkeypatch.chdir(root.parent)
    assert asyncckpt.load("ck")["extra"]["step"] == 10  # a relative root
    mark = bad_mark(root, 15, attempt_of(root, 15))
    assert mark is not None and mark["path"] == str(bad) and os.path.isabs(str(mark["path"]))
    assert str(bad) not in str(mark["reason"]) and "rank00000.safetensors" not in str(mark["reason"])
    line = next(ln for ln in run_cli("ls", "ck").out.splitlines() if ln.startswith("15 "))
    assert line.count("rank00000.safetensors") == 1 and str(bad) in line


def test_a_passing_verification_drops_the_mark(root: Path) -> None:
    data = shard(root, 15).read_bytes()
    flip(shard(root, 15))
    assert run_cli("verify", root, "--step", "15").code == 1
    assert asyncckpt.find_latest(root).step == 10  # type: ignore[union-attr]
    shard(root, 15).write_bytes(data)  # the fault was elsewhere (say, a bad cable): same attempt, good bytes
    assert run_cli("verify", root, "--step", "15").code == 0
    assert bad_mark(root, 15, attempt_of(root, 15)) is None
    assert asyncckpt.find_latest(root).step == 15  # type: ignore[union-attr]


# -------------------------------------------------------------------------- two ranks


@pytest.mark.timeout(150)
def test_two_ranks_fall_back_then_save_the_bad_step_again(tmp_path: Path) -> None:
    root, out = tmp_path / "ck", tmp_path / "result"
    port = free_port()
    hung = run_ranks(
        lambda r: [WORKER, str(r), "2", str(port), str(root), str(out)],
        2, tmp_path, 120, extra_env={"BAD_RANK": "1", "RESAVE": "1"}, warm=True,
    )  # fmt: skip
    assert not hung, f"ranks {hung} hung"
    for r in range(2):
        f = Path(f"{out}.{r}.json")
        assert f.exists(), log_tail(tmp_path, r)
        got = json.loads(f.read_text())
        assert "crash" not in got, got["crash"]
        assert got["loaded"][0] == 1  # the agreed fallback past step 2
        assert got["resaved"] == {"latest_after_fallback": 1, "committed": [2, 3], "latest": 3,
                                  "step2": [2, r, 20.0 + r]}, got  # fmt: skip
    assert len([n for n in os.listdir(root) if n.startswith("step_00000002.bad-")]) == 1
