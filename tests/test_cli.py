"""The ``asyncckpt`` command line, run in-process on real checkpoints made by ``Checkpointer``."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli_util import cli, private_copy, saved_steps
from safetensors.torch import load_file

from asyncckpt import Checkpointer, find_latest, load
from asyncckpt.cli._print import Progress, human_age, human_bytes

STEPS = (1, 2, 3)
REPO = Path(__file__).resolve().parents[1]


def make_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"layer.weight": torch.randn(3, 4, generator=g), "layer.bias": torch.randn(3, generator=g)},
        "optim": {
            "state": {0: {"exp_avg": torch.randn(3, 4, generator=g), "step": torch.tensor(step)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "half": torch.randn(5, generator=g).to(torch.bfloat16),
        "epoch": step,
        "name": f"run-{step}",
        "blob": b"\x00\x01",
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_steps(tmp_path_factory.mktemp("pristine") / "ck", {step: make_state(step) for step in STEPS})


@pytest.fixture
def root(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of three complete checkpoints (steps 1, 2, 3) that a test may damage."""
    return private_copy(pristine, tmp_path)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def make_leftover(root: Path, name: str, age_s: float = 0.0) -> Path:
    d = root / name
    d.mkdir()
    (d / "rank00000.safetensors").write_bytes(b"partial")
    if age_s:
        t = time.time() - age_s
        os.utime(d / "rank00000.safetensors", (t, t))
        os.utime(d, (t, t))
    return d


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def snapshot(root: Path) -> dict[str, tuple[int, float]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime) for p in sorted(root.rglob("*"))}


# ---------------------------------------------------------------------------- ls


def test_ls_reports_complete_incomplete_and_leftovers(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (step_dir(root, 2) / "manifest.json").unlink()
    shard = step_dir(root, 3) / "rank00000.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    make_leftover(root, "step_00000004.tmp-0123abcd")
    make_leftover(root, "step_00000001.deleting-beef")
    (root / "unrelated.txt").write_text("not a step")

    code, out, err = cli(capsys, "ls", root)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["STEP", "STATUS", "SIZE", "FILES", "RANKS", "AGE", "DIRECTORY", "RUN", "NOTE"]
    rows = lines[1:]
    assert [r.split()[0] for r in rows] == ["1", "1", "2", "3", "4"]  # newest last
    by_dir = {r.split()[7]: r for r in rows}  # SIZE is two words
    assert set(by_dir) == {
        "step_00000001",
        "step_00000001.deleting-beef",
        "step_00000002",
        "step_00000003",
        "step_00000004.tmp-0123abcd",
    }
    assert by_dir["step_00000001"].split()[1] == "complete"
    assert "no completion marker" in by_dir["step_00000002"]
    assert "size mismatch: rank00000.safetensors" in by_dir["step_00000003"]
    assert "crashed save attempt" in by_dir["step_00000004.tmp-0123abcd"]
    assert "interrupted retirement" in by_dir["step_00000001.deleting-beef"]
    for name in by_dir:
        if name not in ("step_00000001", "step_00000003"):
            assert by_dir[name].split()[1] == "incomplete", name
    # a size mismatch proves the checkpoint damaged: known bad (_stepstates), not merely incomplete
    assert by_dir["step_00000003"].split()[1] == "bad"

    code, out, err = cli(capsys, "ls", root, "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert [d["step"] for d in doc] == [1, 1, 2, 3, 4]
    rows_j = {d["name"]: d for d in doc}
    good = rows_j["step_00000001"]
    assert good["complete"] is True and good["status"] == "complete" and good["problem"] is None
    assert good["files"] == 3 and good["ranks"] == 1
    assert good["size"] == sum(p.stat().st_size for p in step_dir(root, 1).iterdir())
    assert good["created"] is not None and 0 <= good["age_s"] < 3600
    assert Path(good["path"]) == step_dir(root, 1).resolve()
    assert rows_j["step_00000002"]["problem"] == "no-marker"
    assert rows_j["step_00000003"]["problem"] == "size-mismatch"
    assert rows_j["step_00000004.tmp-0123abcd"]["problem"] == "save-leftover"
    assert rows_j["step_00000001.deleting-beef"]["problem"] == "retire-leftover"
    assert all(d["complete"] is False for n, d in rows_j.items() if n != "step_00000001")


def test_ls_corrupt_manifest_and_empty_and_missing_root(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flip_last_byte(step_dir(root, 3) / "manifest.json")  # the trailing newline: no longer canonical
    code, out, _ = cli(capsys, "ls", root, "--json")
    assert code == 0
    row = {d["step"]: d for d in json.loads(out)}[3]
    assert row["problem"] == "corrupt-manifest" and "manifest" in row["reason"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(capsys, "ls", empty, "--json")[:2] == (0, "[]\n")
    code, out, err = cli(capsys, "ls", empty)
    assert code == 0 and out == "" and "no step directories" in err

    code, out, err = cli(capsys, "ls", tmp_path / "nope")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "is not a directory" in err and "Traceback" not in err


# ---------------------------------------------------------------------------- info


def test_info_shows_keys_dtypes_shapes_and_values(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "info", root)
    assert code == 0 and err == ""
    assert out.startswith("step 3 ")  # newest complete by default
    words = [line.split() for line in out.splitlines()]
    assert ["model", "dict", "(2", "keys)"] in words
    assert ["layer.weight", "float32", "[3,", "4]", "48", "B"] in words
    assert ["layer.bias", "float32", "[3]", "12", "B"] in words
    assert ["half", "bfloat16", "[5]", "10", "B"] in words
    assert ["step", "int64", "[]", "8", "B"] in words
    assert ["lr", "0.1"] in words and ["epoch", "3"] in words and ["name", "'run-3'"] in words
    assert ["blob", "bytes", "(2", "B)"] in words
    # nesting is shown by indentation
    assert "\n  state " in out and "\n    0 " in out and "\n      exp_avg " in out
    assert "rank 0 of 1: 5 tensor(s)" in out

    code, out, _ = cli(capsys, "info", root, "--step", "1")
    assert code == 0 and out.startswith("step 1 ") and "'run-1'" in out


def test_info_json_and_errors(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "info", root, "--step", "2", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["step"] == 2 and doc["rank"] == 0 and doc["world_size"] == 1 and doc["tensors"] == 5
    entries = {tuple(e["path"]): e for e in doc["entries"]}
    assert entries[("model", "layer.weight")] == {
        "path": ["model", "layer.weight"],
        "kind": "tensor",
        "dtype": "float32",
        "shape": [3, 4],
        "nbytes": 48,
    }
    assert entries[("optim", "state", 0, "step")]["dtype"] == "int64"  # int keys stay ints
    assert entries[("epoch",)] == {"path": ["epoch"], "kind": "value", "type": "int", "value": 2}
    assert entries[("blob",)] == {"path": ["blob"], "kind": "bytes", "nbytes": 2}

    code, out, err = cli(capsys, "info", root, "--rank", "1")
    assert code == 1 and out == "" and "no rank 1" in err and err.count("\n") == 1
    code, _, err = cli(capsys, "info", root, "--step", "7")
    assert code == 1 and "no checkpoint for step 7" in err
    code, _, err = cli(capsys, "info", root, "--rank", "-1")
    assert code == 2 and "non-negative" in err


# ---------------------------------------------------------------------------- verify


def test_verify_valid_checkpoints_exit_0_quietly(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "verify", root)
    assert code == 0 and err == ""  # no progress bar when stderr is not a terminal
    # the manifest counts as a file, as in ``ls`` (FILES 3): both count the files of the directory
    assert out == "step 3: ok (3 files, " + out.split("(3 files, ", 1)[1]
    code, out, err = cli(capsys, "verify", root, "--all")
    assert code == 0 and err == ""
    assert [line.split(":")[0] for line in out.splitlines()[:3]] == ["step 1", "step 2", "step 3"]
    assert out.splitlines()[-1] == "3 of 3 checkpoints ok"
    assert cli(capsys, "verify", root, "--step", "2")[0] == 0


def test_verify_flipped_byte_names_the_file(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = step_dir(root, 2) / "rank00000.safetensors"
    flip_last_byte(shard)  # inside the last tensor's data: sizes and manifest still look fine
    code, out, err = cli(capsys, "verify", root, "--step", "2")
    assert code == 1 and out == ""
    assert err == f"asyncckpt: step 2: corrupt: checksum mismatch: {shard}\n"

    code, out, err = cli(capsys, "verify", root, "--all")
    assert code == 1
    assert "step 1: ok" in out and "step 3: ok" in out and "2 of 3 checkpoints ok" in out
    assert str(shard) in err and err.count("\n") == 1


def test_verify_incomplete_exits_1(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (step_dir(root, 3) / "manifest.json").unlink()
    code, out, err = cli(capsys, "verify", root, "--step", "3")
    assert code == 1 and out == ""
    assert "step 3: incomplete" in err and str(step_dir(root, 3)) in err and "no completion marker" in err

    code, _, err = cli(capsys, "verify", root, "--all")
    assert code == 1 and "step 3: incomplete" in err

    # the default is what load() resumes from: the newest complete step, with a note
    code, out, err = cli(capsys, "verify", root)
    assert code == 0 and out.startswith("step 2: ok") and "newer step directory is incomplete" in err

    truncated = step_dir(root, 2) / "rank00000.json"
    os.truncate(truncated, 3)
    code, _, err = cli(capsys, "verify", root, "--step", "2")
    assert code == 1 and str(truncated) in err

    code, _, err = cli(capsys, "verify", root, "--step", "9")
    assert code == 1 and "step 9: not found" in err


def test_verify_with_nothing_complete_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ck").mkdir()
    code, _, err = cli(capsys, "verify", tmp_path / "ck")
    assert code == 1 and "no complete checkpoint" in err
    code, _, err = cli(capsys, "verify", tmp_path / "ck", "--all")
    assert code == 1 and "no checkpoints" in err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["verify"],
        ["verify", "{root}", "--step", "1", "--all"],
        ["verify", "{root}", "--step", "x"],
        ["verify", "{root}", "--step", "-1"],
        ["verify", "{root}", "--bogus"],
        ["frobnicate", "{root}"],
    ],
    ids=["no-command", "no-root", "step-and-all", "step-not-int", "negative-step", "unknown-option", "unknown-cmd"],
)
def test_verify_usage_errors_exit_2(root: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, out, err = cli(capsys, *[a.format(root=root) for a in argv])
    assert code == 2 and out == ""
    assert "error:" in err and "Traceback" not in err


_OPTION = ["--storage-option", "endpoint=http://127.0.0.1:1"]
_DEADLINE = ["--deadline", "5"]
_DEADLINE_SMALL = ["--deadline", "0.001"]


@pytest.mark.parametrize(
    ("command", "flags"),
    [(c, _OPTION) for c in ("verify", "info", "export", "gc", "ls")]
    + [(c, _DEADLINE) for c in ("verify", "info", "export", "gc")]  # ls has no --deadline
    + [("verify", _DEADLINE_SMALL)],
)
def test_store_only_flags_on_a_local_root_are_a_usage_error_not_ignored(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, flags: list[str]
) -> None:
    extra = ["--to", str(tmp_path / "out.safetensors")] if command == "export" else []
    before = sorted(p.name for p in root.iterdir())
    code, out, err = cli(capsys, command, root, *extra, *flags)
    assert code == 2 and out == "", (code, out, err)
    assert f"{flags[0]} apply to s3:// URLs only" in err and "Traceback" not in err
    assert "127.0.0.1:1" not in err  # an option's value is never printed
    assert sorted(p.name for p in root.iterdir()) == before and not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon", "1e-320", "0.0009"])
@pytest.mark.parametrize("command", ["verify", "push", "pull"])
def test_a_deadline_that_is_not_a_number_of_seconds_from_1_ms_is_a_usage_error(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, value: str
) -> None:
    # refused by the parser, before anything is opened: a local root and a URL alike
    url = "s3://bucket/prefix"
    argv = {"verify": [url], "push": [root, url], "pull": [url, tmp_path / "into"]}[command]
    code, out, err = cli(capsys, command, *argv, "--deadline", value)
    assert code == 2 and out == "", (code, out, err)
    assert "--deadline" in err and repr(value) in err and "Traceback" not in err
    assert not (tmp_path / "into").exists()


def test_verify_progress_bar_on_a_terminal(
    root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = cli(capsys, "verify", root, "--all")
    assert code == 0 and out.count(": ok") == 3
    assert "verifying step 3" in err and "%" in err and err.endswith("\r\x1b[K")


def test_progress_draws_and_erases() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    s = Tty()
    p = Progress(s, total=2048, enabled=True)
    p.label("verifying step 7")
    p.advance(1024)
    p.advance(1024)
    p.close()
    text = s.getvalue()
    assert "verifying step 7" in text and "100.0%" in text and "2.0 KiB / 2.0 KiB" in text
    assert text.endswith("\r\x1b[K")

    quiet = io.StringIO()
    q = Progress(quiet, total=10, enabled=False)
    q.label("x")
    q.advance(10)
    q.close()
    assert quiet.getvalue() == ""


def test_human_formats() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 5 * 2**20)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "5.0 MiB",
    ]
    assert [human_age(s) for s in (-3, 0, 59, 60, 3599, 3600, 86400 * 2)] == [
        "0s",
        "0s",
        "59s",
        "1m",
        "59m",
        "1h",
        "2d",
    ]


# ---------------------------------------------------------------------------- gc


def test_gc_dry_run_changes_nothing(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_leftover(root, "step_00000004.tmp-00ff", age_s=7200)
    make_leftover(root, "step_00000002.deleting-abcd", age_s=7200)
    before = snapshot(root)
    code, out, err = cli(capsys, "gc", root, "--keep-last", "1", "--dry-run")
    assert code == 0 and err == ""
    assert snapshot(root) == before
    assert "would remove step_00000004.tmp-00ff" in out
    assert "would remove step_00000002.deleting-abcd" in out
    assert "would retire step 1 " in out and "would retire step 2 " in out
    assert "would retire step 3" not in out and "keeping 1 complete checkpoint(s): step 3" in out


def test_gc_keep_last_1_keeps_newest_complete_and_removes_leftovers(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # step 4 looks newer but is incomplete: it must neither count nor be removed
    shutil.copytree(step_dir(root, 3), step_dir(root, 4))
    (step_dir(root, 4) / "manifest.json").unlink()
    make_leftover(root, "step_00000005.tmp-00ff", age_s=7200)
    make_leftover(root, "step_00000001.deleting-abcd", age_s=7200)

    code, out, err = cli(capsys, "gc", root, "--keep-last", "1")
    assert code == 0 and err == ""
    assert sorted(p.name for p in root.iterdir()) == [".asyncckpt", "step_00000003", "step_00000004"]
    assert "removed step_00000005.tmp-00ff" in out and "removed step_00000001.deleting-abcd" in out
    assert "retired step 1 " in out and "retired step 2 " in out
    assert "left alone step_00000004" in out
    latest = find_latest(root)
    assert latest is not None and latest.step == 3
    assert load(root, 3)["epoch"] == 3

    # idempotent, and never removes the last complete checkpoint
    code, out, _ = cli(capsys, "gc", root, "--keep-last", "1")
    assert code == 0 and "retired" not in out and (step_dir(root, 3) / "manifest.json").exists()


def test_gc_by_commit_order_keeps_the_most_recently_committed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a root saved with allow_earlier_steps: step 5 committed first, then step 2 (a rewind)
    root = tmp_path / "rewound"
    with Checkpointer(root, allow_earlier_steps=True) as ck:
        ck.save(5, {"epoch": 5}).result(60)
        time.sleep(0.02)  # distinct manifest ``created`` times
        ck.save(2, {"epoch": 2}).result(60)
    code, out, _ = cli(capsys, "gc", root, "--keep-last", "1", "--by-commit-order", "--dry-run")
    assert code == 0 and "would retire step 5 " in out and "keeping 1 complete checkpoint(s): step 2" in out
    code, out, _ = cli(capsys, "gc", root, "--keep-last", "1", "--by-commit-order")
    assert code == 0 and "retired step 5 " in out
    assert sorted(p.name for p in root.iterdir()) == [".asyncckpt", "step_00000002"]
    assert load(root)["epoch"] == 2
    # without the flag, newest means the highest step
    with Checkpointer(root, allow_earlier_steps=True) as ck:
        ck.save(1, {"epoch": 1}).result(60)
    code, out, _ = cli(capsys, "gc", root, "--keep-last", "1")
    assert code == 0 and "retired step 1 " in out


def test_gc_spares_fresh_leftovers_and_checks_usage(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fresh = make_leftover(root, "step_00000004.tmp-00ff")
    code, out, _ = cli(capsys, "gc", root)
    assert code == 0 and fresh.exists() and "kept step_00000004.tmp-00ff" in out
    assert sorted(p.name for p in root.iterdir())[1:4] == ["step_00000001", "step_00000002", "step_00000003"]
    code, out, _ = cli(capsys, "gc", root, "--min-age", "0")
    assert code == 0 and not fresh.exists() and "removed step_00000004.tmp-00ff" in out
    assert len(list(root.iterdir())) == 4  # .asyncckpt + 3; no --keep-last: complete checkpoints untouched

    for bad in (["--keep-last", "0"], ["--keep-last", "x"], ["--min-age", "-1"]):
        code, _, err = cli(capsys, "gc", root, *bad)
        assert code == 2 and "error:" in err, bad


def test_gc_refuses_a_root_a_checkpointer_owns(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """gc removes files, so it is a writer: while a Checkpointer owns the root it changes
    nothing and exits 1 naming the owner; --dry-run still reads; afterwards gc runs."""
    old = make_leftover(root, "step_00000004.tmp-00ff", age_s=7200)
    with Checkpointer(root) as ck:
        # the Checkpointer took the root and removed the leftover it found: make a new one
        assert not old.exists()
        foreign = make_leftover(root, "step_00000005.tmp-00ff", age_s=7200)
        before = snapshot(root)
        code, out, err = cli(capsys, "gc", root, "--keep-last", "1")
        assert code == 1 and out == ""
        assert "already owned by another writer" in err and f"pid {os.getpid()}" in err, err
        assert snapshot(root) == before
        code, out, _ = cli(capsys, "gc", root, "--keep-last", "1", "--dry-run")
        assert code == 0 and "would remove step_00000005.tmp-00ff" in out
        ck.save(7, make_state(7)).result(timeout=60)  # the owner still writes
    code, out, _ = cli(capsys, "gc", root, "--keep-last", "1")
    assert code == 0 and not foreign.exists() and "retired step 3 " in out
    with Checkpointer(root) as ck:  # gc released the root
        assert ck.steps() == [7]


# ---------------------------------------------------------------------------- export


def test_export_safetensors_with_and_without_key(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = make_state(2)
    out_all = tmp_path / "all.safetensors"
    code, out, err = cli(capsys, "export", root, "--step", "2", "--to", out_all)
    assert code == 0 and "wrote 5 tensor(s)" in out
    assert "skipped" in err and "epoch" in err  # non-tensor values cannot go into the file
    got = load_file(str(out_all))
    expected = {
        "model.layer.weight": state["model"]["layer.weight"],
        "model.layer.bias": state["model"]["layer.bias"],
        "optim.state.0.exp_avg": state["optim"]["state"][0]["exp_avg"],
        "optim.state.0.step": state["optim"]["state"][0]["step"],
        "half": state["half"],
    }
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k

    out_model = tmp_path / "model.safetensors"
    code, out, err = cli(capsys, "export", root, "--step", "2", "--key", "model", "--to", out_model)
    assert code == 0 and err == "" and "wrote 2 tensor(s) under 'model'" in out
    got = load_file(str(out_model))
    assert set(got) == {"layer.weight", "layer.bias"}
    assert torch.equal(got["layer.weight"], state["model"]["layer.weight"])
    assert torch.equal(got["layer.bias"], state["model"]["layer.bias"])

    got = load_file(str(_export(capsys, root, tmp_path / "o.safetensors", "--key", "optim.state")))
    assert set(got) == {"0.exp_avg", "0.step"} and torch.equal(got["0.step"], torch.tensor(2))
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def _export(capsys: pytest.CaptureFixture[str], root: Path, dest: Path, *extra: str) -> Path:
    code, _, err = cli(capsys, "export", root, "--step", "2", "--to", dest, *extra)
    assert code == 0, err
    return dest


def test_export_pt_loads_with_weights_only(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = _export(capsys, root, tmp_path / "model.pt", "--key", "model")
    got = torch.load(dest, weights_only=True)
    assert isinstance(got, dict) and set(got) == {"layer.weight", "layer.bias"}
    assert torch.equal(got["layer.weight"], make_state(2)["model"]["layer.weight"])
    got_all = torch.load(_export(capsys, root, tmp_path / "all.pth"), weights_only=True)
    assert len(got_all) == 5 and got_all["half"].dtype == torch.bfloat16


def test_export_errors(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "m.safetensors"
    cases: list[tuple[list[str | Path], int, str]] = [
        (["--step", "2", "--to", tmp_path / "m.bin"], 2, "must end in .safetensors"),
        (["--step", "2"], 2, "--to"),
        (["--step", "2", "--key", "model.layer.weight", "--to", dest], 2, "single tensor"),
        (["--step", "2", "--key", "nope", "--to", dest], 1, "no tensors under key 'nope'"),
        (["--step", "2", "--key", "epoch", "--to", dest], 1, "no tensors under key 'epoch'"),
        (["--step", "8", "--to", dest], 1, "no checkpoint for step 8"),
        (["--step", "2", "--rank", "3", "--to", dest], 1, "no rank 3"),
        (["--step", "2", "--to", step_dir(root, 2) / "x.pt"], 2, "refusing to write into step_00000002"),
    ]
    for argv, want, msg in cases:
        code, _, err = cli(capsys, "export", root, *argv)
        assert code == want and msg in err and "Traceback" not in err, (argv, code, err)
    assert not dest.exists()

    _export(capsys, root, dest, "--key", "model")
    code, _, err = cli(capsys, "export", root, "--step", "2", "--to", dest)
    assert code == 2 and "already exists" in err
    assert set(load_file(str(dest))) == {"layer.weight", "layer.bias"}  # untouched
    _export(capsys, root, dest, "--force")
    assert len(load_file(str(dest))) == 5

    flip_last_byte(step_dir(root, 1) / "rank00000.safetensors")
    code, _, err = cli(capsys, "export", root, "--step", "1", "--to", tmp_path / "bad.pt")
    assert code == 1 and "checksum mismatch" in err and not (tmp_path / "bad.pt").exists()


# ---------------------------------------------------------------------------- help


def test_help_explains_each_command_with_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("ls", "info", "verify", "gc", "export"):
        code, out, _ = cli(capsys, command, "--help")
        assert code == 0 and "examples:" in out and f"asyncckpt {command} " in out, command


def test_python_m_asyncckpt_help() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    r = subprocess.run(
        [sys.executable, "-m", "asyncckpt", "--help"], capture_output=True, text=True, env=env, timeout=100
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: asyncckpt")
    for command in ("ls", "info", "verify", "gc", "export"):
        assert command in r.stdout


def test_verify_all_holds_a_bounded_number_of_steps_open(
    root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--all`` opens every step first (the progress total, what cannot be opened said first)
    but holds at most ``HELD`` open (a POSIX reader holds a directory descriptor); the others
    are opened again when their turn comes, with the same verdicts."""
    from asyncckpt.cli import verify

    monkeypatch.setattr(verify, "HELD", 1)
    code, out, err = cli(capsys, "verify", root, "--all", "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert [(s["step"], s["status"]) for s in doc["steps"]] == [(1, "ok"), (2, "ok"), (3, "ok")]
    flip_last_byte(step_dir(root, 3) / "rank00000.safetensors")
    code, out, _ = cli(capsys, "verify", root, "--all", "--json")
    assert code == 1 and [s["status"] for s in json.loads(out)["steps"]] == ["ok", "ok", "corrupt"]
