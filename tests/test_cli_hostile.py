"""Hostile and damaged files: one clear line, escaped names, bounded time, never a traceback."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from _cli_util import private_copy, reseal, run_cli, saved_steps, strict_json

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    states = {step: {"w": torch.randn(8), "epoch": step} for step in (1, 2, 3)}
    return saved_steps(tmp_path_factory.mktemp("hostile") / "ck", states)


@pytest.fixture
def root(pristine: Path, tmp_path: Path) -> Path:
    return private_copy(pristine, tmp_path)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def test_names_with_control_characters_are_printed_escaped(root: Path) -> None:
    # a leftover name may end in a newline (the layout's "$" accepts one); junk with escape
    # codes and undecodable bytes sits in the root and inside a committed step
    leftover = root / "step_00000009.tmp-ab\n"
    leftover.mkdir()
    (leftover / "rank00000.safetensors").write_bytes(b"x")
    (root / "\x1b[2J\x1b[31mjunk").mkdir()
    os.mkdir(os.path.join(os.fsencode(root), b"step_00000004\xff\x1b"))
    (step_dir(root, 2) / "\x1b]0;pwned\x07\nforged line").write_bytes(b"")
    for argv in (["ls"], ["gc", "--dry-run", "--min-age", "0"], ["verify", "--all"]):
        r = run_cli(argv[0], root, *argv[1:])
        assert r.code in (0, 1), r.err
        for text in (r.out, r.err):
            assert "\x1b" not in text and "\x07" not in text, (argv, text)
            assert "Traceback" not in text
        assert "forged line" not in "".join(line for line in r.out.splitlines() if line.startswith("forged"))
    ls = run_cli("ls", root)
    assert "step_00000009.tmp-ab\\x0a" in ls.out
    assert "\\x1b]0;pwned\\x07\\x0aforged line" in ls.out  # the unexpected file, named in the note
    assert len(ls.out.splitlines()) == 1 + 4  # header + steps 1, 2, 3, 9: junk names are not steps
    assert "junk" not in ls.out and "step_00000004" not in ls.out
    gc = run_cli("gc", root, "--min-age", "0")
    assert gc.code == 0 and "removed step_00000009.tmp-ab\\x0a" in gc.out and not leftover.exists()
    doc = strict_json(run_cli("ls", root, "--json").out)
    assert {d["name"] for d in doc} >= {"step_00000001", "step_00000002", "step_00000003"}


@pytest.mark.parametrize("created", [math.nan, math.inf, -math.inf, 1e300, -5.0])
def test_one_bad_created_time_never_breaks_ls(root: Path, created: float) -> None:
    reseal(step_dir(root, 2), "", created=created)
    r = run_cli("ls", root)
    assert r.code == 0 and r.err == "", r.err
    rows = r.out.splitlines()[1:]
    assert [row.split()[0] for row in rows] == ["1", "2", "3"]
    assert all(row.split()[1] == "complete" for row in rows)
    j = run_cli("ls", root, "--json")
    assert j.code == 0
    doc = strict_json(j.out)  # valid JSON: no NaN/Infinity
    assert [d["created"] for d in doc][1] is None and doc[0]["created"] is not None
    info = run_cli("info", root, "--step", "2")
    assert info.code == 0 and "created unknown" in info.out, info.err
    assert strict_json(run_cli("info", root, "--step", "2", "--json").out)["created"] is None
    assert run_cli("verify", root, "--all").code == 0


@pytest.mark.parametrize(
    "case",
    ["deep-structure", "wide-structure", "not-json", "bad-tag", "tensor-missing", "bad-header", "huge-header-len"],
)
def test_a_bad_file_is_one_line_naming_it(root: Path, case: str) -> None:
    sd = step_dir(root, 3)
    tree, shard = sd / "rank00000.json", sd / "rank00000.safetensors"
    target = tree
    if case == "deep-structure":
        reseal(sd, tree.name, b"[" * 200_000 + b"]" * 200_000)
    elif case == "wide-structure":
        # well-formed, 300k nodes, naming a tensor the shard lacks (a tree that merely leaves a
        # shard tensor unnamed loads, so it verifies too: verify passes what load passes)
        reseal(sd, tree.name, b"[" + b"[]," * 300_000 + b'{"$tensor": "nope"}]')
        target = shard
    elif case == "not-json":
        reseal(sd, tree.name, b"\xff\xfe{")
    elif case == "bad-tag":
        reseal(sd, tree.name, b'{"$dict": [["w", {"$tensor": 5}]]}')
    elif case == "tensor-missing":
        reseal(sd, tree.name, b'{"$dict": [["w", {"$tensor": "nope"}]]}')
        target = shard
    elif case == "bad-header":
        data = bytearray(shard.read_bytes())
        data[8:12] = b"\x00\x00\x00\x00"
        reseal(sd, shard.name, bytes(data))
        target = shard
    else:
        data = bytearray(shard.read_bytes())
        data[0:8] = (2**62).to_bytes(8, "little")
        reseal(sd, shard.name, bytes(data))
        target = shard
    for argv in (["info", "--step", "3"], ["verify", "--step", "3"]):
        r = run_cli(*argv[:1], root, *argv[1:])
        assert r.code == 1, (argv, r.code, r.err)
        assert "Traceback" not in r.err and r.out == "", (argv, r.err)
        assert r.err.count("\n") == 1 and str(target) in r.err, (argv, r.err)
        assert r.wall_s < 30
    # step 3 is known bad now: without --step they take step 2, the newest resumable, and say why
    for argv in (["info"], ["verify"]):
        r = run_cli(*argv, root)
        assert r.code == 0 and "Traceback" not in r.err, (argv, r.code, r.err)
        assert "passed over step 3" in r.err and r.err.count(str(target)) == 1, (argv, r.err)
        assert "step 2" in r.out.splitlines()[0], (argv, r.out)
    j = run_cli("verify", root, "--step", "3", "--json")
    doc = strict_json(j.out)
    assert j.code == 1 and doc["failed"] == 1 and doc["steps"][0]["problems"][0]["path"] == str(target)
    ls = run_cli("ls", root)  # ls does not read the data; it does show the verdict recorded
    assert ls.code == 0 and "verification failed" in ls.out


def test_unreadable_step_does_not_hide_the_others(root: Path) -> None:
    # a manifest that is a directory, a FIFO as a shard, a symlinked step
    (step_dir(root, 1) / "manifest.json").unlink()
    (step_dir(root, 1) / "manifest.json").mkdir()
    shard = step_dir(root, 2) / "rank00000.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    (root / "step_00000005").symlink_to(step_dir(root, 3))
    r = run_cli("ls", root, "--json")
    assert r.code == 0, r.err
    rows = {d["name"]: d for d in strict_json(r.out)}
    assert rows["step_00000003"]["complete"] is True
    assert rows["step_00000001"]["complete"] is False and rows["step_00000002"]["complete"] is False
    assert rows["step_00000005"]["problem"] == "not-a-directory"
    v = run_cli("verify", root, "--all")
    assert v.code == 1 and "step 3: ok" in v.out and "Traceback" not in v.err
