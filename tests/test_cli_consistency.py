"""The commands agree with each other: counts, defaults, --json everywhere, verdicts remembered."""

from __future__ import annotations

import io
import os
import pty
import random
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli_util import REPO, cli, private_copy, run_cli, saved_steps, strict_json

from asyncckpt import Checkpointer, find_latest
from asyncckpt.cli._print import Progress
from asyncckpt.roots._badmarks import bad_mark
from asyncckpt.roots.posix._discovery import read_manifest

WORLD = 1


def state(step: int) -> dict[str, Any]:
    rng = random.Random(step)
    return {
        "model": {"w": torch.randn(32, 32), "b": torch.zeros(32)},
        "rng": rng.getstate(),  # (3, tuple of 625 ints, None)
        "layers": [[i] for i in range(130)],
        "epoch": step,
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_steps(tmp_path_factory.mktemp("consistency") / "ck", {step: state(step) for step in (1, 2, 3)})


@pytest.fixture
def root(pristine: Path, tmp_path: Path) -> Path:
    return private_copy(pristine, tmp_path)


def test_ls_and_verify_count_the_same_files(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = cli(capsys, "ls", root, "--json")
    ls_files = {d["step"]: d["files"] for d in strict_json(out)}
    _, out, _ = cli(capsys, "verify", root, "--all", "--json")
    doc = strict_json(out)
    assert {s["step"]: s["files"] for s in doc["steps"]} == ls_files
    on_disk = len(os.listdir(root / "step_00000003"))
    assert ls_files[3] == on_disk == 2 * WORLD + 1  # shard + structure per rank, and the manifest
    _, text, _ = cli(capsys, "verify", root)
    assert text.startswith(f"step 3: ok ({on_disk} files, ")
    _, table, _ = cli(capsys, "ls", root)
    assert table.splitlines()[-1].split()[4] == str(on_disk)  # the FILES column
    assert doc["steps"][-1]["bytes"] == sum(p.stat().st_size for p in (root / "step_00000003").iterdir())


def test_every_command_defaults_to_the_newest_complete_step(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (root / "step_00000003" / "manifest.json").unlink()  # 3 is incomplete: newest complete is 2
    latest = find_latest(root)
    assert latest is not None and latest.step == 2
    code, out, _ = cli(capsys, "info", root, "--json")
    assert code == 0 and strict_json(out)["step"] == 2
    code, out, _ = cli(capsys, "verify", root, "--json")
    assert code == 0 and [s["step"] for s in strict_json(out)["steps"]] == [2]
    code, out, err = cli(capsys, "export", root, "--key", "model", "--to", tmp_path / "m.safetensors", "--json")
    assert code == 0, err
    assert strict_json(out)["step"] == 2 and strict_json(out)["tensors"] == 2


def test_info_abbreviates_long_lists_and_full_shows_them(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "info", root)
    assert code == 0
    rng_line = next(line for line in out.splitlines() if "625 items" in line)
    assert "... 617 more" in rng_line and "--full" in rng_line
    assert len(out.splitlines()) < 250  # not 625 + 2 * 130 lines
    assert "30 more (--full shows all)" in out  # 130 layers, 100 shown
    code, full, _ = cli(capsys, "info", root, "--full")
    assert code == 0 and "more" not in full
    ints = random.Random(3).getstate()[1]
    assert all(f"  {v}" in full for v in (ints[0], ints[311], ints[624]))
    assert len(full.splitlines()) > 625 + 130
    code, out, _ = cli(capsys, "info", root, "--json")  # JSON is always complete
    entries = strict_json(out)["entries"]
    assert len([e for e in entries if e["path"][:2] == ["rng", 1]]) == 1 + 625


def test_json_on_every_command(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    leftover = root / "step_00000004.tmp-0abc"
    leftover.mkdir()
    shapes: dict[str, set[str]] = {
        "ls": set(),
        "info": {"step", "rank", "world_size", "entries", "tensors", "created", "nbytes"},
        "verify": {"root", "ok", "failed", "steps"},
        "gc": {"root", "dry_run", "removed", "kept", "retired", "kept_steps", "left_alone", "freed"},
        "export": {"path", "step", "rank", "key", "tensors", "nbytes", "skipped"},
    }
    argv: dict[str, list[str | Path]] = {
        "ls": [],
        "info": [],
        "verify": ["--all"],
        "gc": ["--keep-last", "2", "--min-age", "0", "--dry-run"],
        "export": ["--to", tmp_path / "all.pt"],
    }
    for command, keys in shapes.items():
        code, out, err = cli(capsys, command, root, *argv[command], "--json")
        assert code == 0, (command, err)
        doc = strict_json(out)
        if command == "ls":
            assert [d["step"] for d in doc] == [1, 2, 3, 4] and doc[-1]["problem"] == "save-leftover"
        else:
            assert keys <= set(doc), (command, sorted(doc))
    code, out, _ = cli(capsys, "gc", root, "--keep-last", "2", "--min-age", "0", "--json")
    doc = strict_json(out)
    assert [r["step"] for r in doc["retired"]] == [1] and [r["name"] for r in doc["removed"]] == [leftover.name]
    assert doc["kept_steps"] == [2, 3] and not leftover.exists()


def test_verify_remembers_a_bad_checkpoint_and_ls_marks_it(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = root / "step_00000002" / "rank00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, out, _ = cli(capsys, "ls", root, "--json")
    assert [d["status"] for d in strict_json(out)] == ["complete"] * 3  # nobody has verified yet

    code, _, err = cli(capsys, "verify", root, "--step", "2")
    assert code == 1 and str(shard) in err
    attempt = read_manifest(str(root / "step_00000002")).attempt
    mark = bad_mark(root, 2, attempt)
    assert mark is not None and mark["path"] == str(shard) and mark["reason"] == "checksum mismatch"

    code, out, _ = cli(capsys, "ls", root, "--json")
    rows = {d["step"]: d for d in strict_json(out)}
    assert rows[2]["status"] == "bad" and rows[2]["complete"] is True and rows[2]["bad"]["path"] == str(shard)
    assert rows[1]["status"] == rows[3]["status"] == "complete" and rows[1]["bad"] is None
    code, out, _ = cli(capsys, "ls", root)
    line = next(r for r in out.splitlines() if r.startswith("2 "))
    assert line.split()[1] == "bad" and f"verification failed: checksum mismatch: {shard}" in line

    # the mark judged that attempt only: a new checkpoint under the same step is not marked
    shutil.rmtree(root / "step_00000002")
    shutil.copytree(root / "step_00000003", root / "step_00000002")
    (root / "step_00000002" / "manifest.json").unlink()
    code, out, _ = cli(capsys, "ls", root, "--json")
    assert {d["step"]: d for d in strict_json(out)}[2]["bad"] is None


def test_progress_shows_rate_and_eta() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    s = Tty()
    p = Progress(s, total=4096, enabled=True)
    p.label("verifying step 7")
    p.advance(1024)
    time.sleep(0.15)
    p.advance(1024)
    text = s.getvalue()
    assert "ETA " in text and "/s" in text and "2.0 KiB / 4.0 KiB" in text
    p.advance(2048)
    p.close()
    assert "done" in s.getvalue() and s.getvalue().endswith("\r\x1b[K")


def test_verify_progress_on_a_real_terminal_and_quiet_when_piped(tmp_path: Path) -> None:
    root = tmp_path / "big"
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.randn(8 * 2**20)}).result(timeout=60)  # 32 MiB
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "asyncckpt", "verify", str(root)]
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, env=env)
        os.close(slave)
        seen = b""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
            elif proc.poll() is not None:
                break
        out, _ = proc.communicate(timeout=60)
    finally:
        os.close(master)
    assert proc.returncode == 0 and out.startswith(b"step 1: ok (3 files, 32.0 MiB verified)")
    assert b"verifying step 1" in seen and (b"MiB/s" in seen or b"GiB/s" in seen) and b"32.0 MiB / 32.0 MiB" in seen
    assert seen.endswith(b"\r\x1b[K")  # the line is erased at the end

    piped = run_cli("verify", root)
    assert piped.code == 0 and piped.err == ""


def test_a_step_retired_during_verify_is_not_called_corrupt(root: Path) -> None:
    from asyncckpt.loading._verify import verify_opened
    from asyncckpt.roots import open_root

    target = open_root(str(root))
    reader = target.open_reader(2)
    step_dir, manifest = reader.locate(), reader.manifest
    calls = []

    def retire_midway(n: int) -> None:  # the retention of a running job, between two reads
        calls.append(n)
        if len(calls) == 2:
            os.rename(step_dir, str(root / "step_00000002.deleting-0abc"))
            shutil.rmtree(root / "step_00000002.deleting-0abc")

    with reader:
        problems = verify_opened(target, reader, retire_midway)
    assert len(problems) == 1 and "retired or replaced while being verified" in problems[0].reason
    assert bad_mark(root, 2, manifest.attempt) is None  # nothing recorded against the step
