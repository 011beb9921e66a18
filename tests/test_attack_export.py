"""``asyncckpt export`` reading a step in place (``Root.open_reader``) under attack: a store
that serves fewer bytes than asked, objects of another size than the manifest lists, a step
retired while it is exported, a defect in the structure file or the shard header (found
before the first output byte), Ctrl-C mid-export. What a failed read means is judged as a
load judges it: damage marks the step bad, an I/O fault does not, and either on a step
retired meanwhile is "retired", never "corrupt"; OUT is never left behind in part."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli_util import cli, so
from s3fixtures import get, opts, proxy_fixture, put, require_s3, server_fixture
from s3proxy import FaultProxy, Rule

from asyncckpt import Checkpointer, remote
from asyncckpt.cli import main as cli_main

require_s3()

BUCKET = "attackexport"
MiB = 1024 * 1024
pytestmark = pytest.mark.timeout(300)
s3 = server_fixture(BUCKET)
proxy = proxy_fixture()


def single(tmp_path: Path, endpoint: str, mib: int = 20) -> tuple[Path, str]:
    root = tmp_path / f"ck-{uuid.uuid4().hex[:6]}"
    g = torch.Generator().manual_seed(1)
    model = {"w": torch.randn(mib * MiB // 8, generator=g), "v": torch.randn(mib * MiB // 8, generator=g)}
    with Checkpointer(root) as ck:
        ck.save(1, {"model": model, "step": 1}).result(timeout=60)
    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:10]}"
    remote.push(root, url, storage_options=opts(endpoint), deadline_s=60)
    return root, url


def shard_key(endpoint: str, url: str, step: int = 1) -> str:
    attempt = json.loads(get(endpoint, url, f"step_{step:08d}/manifest.json"))["attempt"]
    return f"step_{step:08d}/a-{attempt}/rank00000.safetensors"


def bad_of(capsys: pytest.CaptureFixture[str], url: str, endpoint: str) -> Any:
    capsys.readouterr()
    code, listing, err = cli(capsys, "ls", url, "--json", *so(endpoint))
    assert code == 0, err
    return [(r["step"], r["status"], r["bad"]) for r in json.loads(listing)]


def local(tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(1, {"model": {"w": torch.ones(3), "bias": torch.zeros(2)}, "x": 1}).result(timeout=60)
    return root


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["rank00000.json", "rank00000.safetensors"])
def test_a_defect_found_before_the_first_output_byte_marks_the_step_bad(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """The structure file (its CRC) or the shard's header (read while planning) is damaged:
    export exits 1 naming the file, writes nothing, and the step is marked bad as a load
    would mark it (main: only a defect met while streaming marked it; ``ls`` still said
    complete and ``load(step=None)`` kept choosing the step)."""
    root = local(tmp_path)
    flip(root / "step_00000001" / where, 20)
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = cli(capsys, "export", root, "--to", out / "m.safetensors")
    assert code == 1 and where in err, err
    assert os.listdir(out) == []
    code, listing, err = cli(capsys, "ls", root, "--json")
    assert code == 0, err
    (row,) = json.loads(listing)
    assert row["status"] == "bad", row


@pytest.mark.parametrize("action", ["short_200", "short_206"])
def test_a_store_serving_fewer_bytes_is_a_read_error_not_damage(
    s3: Any, proxy: FaultProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str
) -> None:
    """Every ranged GET of the shard answers half the bytes asked (a 200 without a range, or a
    206 naming the shorter range): exit 1 with a read error naming the object, no output, no
    bad mark; the same export passes once the store answers in full."""
    _, url = single(tmp_path, s3.endpoint)
    out = tmp_path / "out"
    out.mkdir()
    proxy.add(Rule(action, method="GET", path_contains="rank00000.safetensors", times=1000))
    code, _, err = cli(capsys, "export", url, "--to", out / "m.safetensors", *so(proxy.endpoint))
    assert code == 1 and "cannot read" in err and "rank00000.safetensors" in err, err
    assert os.listdir(out) == []
    assert bad_of(capsys, url, s3.endpoint) == [(1, "complete", None)]
    proxy.clear()
    code, _, err = cli(capsys, "export", url, "--to", out / "m.safetensors", *so(proxy.endpoint))
    assert code == 0, err


@pytest.mark.parametrize("delta", [-100, 100])
def test_an_object_of_another_size_than_the_manifest_is_damage(
    s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], delta: int
) -> None:
    """The shard object is replaced by one 100 bytes shorter or longer (its first bytes
    intact, so only the size tells): found when the step is opened, marked bad, nothing
    written."""
    _, url = single(tmp_path, s3.endpoint, mib=2)
    key = shard_key(s3.endpoint, url)
    data = get(s3.endpoint, url, key)
    put(s3.endpoint, url, key, data[:delta] if delta < 0 else data + b"\0" * delta)
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = cli(capsys, "export", url, "--step", "1", "--to", out / "m.safetensors", *so(s3.endpoint))
    assert code == 1 and "recorded in the manifest" in err, err
    assert os.listdir(out) == []
    assert bad_of(capsys, url, s3.endpoint)[0][:2] == (1, "bad")


def test_a_step_retired_while_it_is_exported_from_a_store_is_gone_not_corrupt(
    s3: Any, proxy: FaultProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shard's GETs are held 3 s while a writer with ``keep_last=1`` commits steps 2 and 3
    (step 1's objects deleted): exit 1 saying the step was retired while it was read, as a
    load says it (main: "object listed in the manifest is missing", a corrupt step's words
    and type, for a step nothing damaged), no output, no bad mark."""
    _, url = single(tmp_path, s3.endpoint, mib=20)
    out = tmp_path / "out"
    out.mkdir()
    proxy.add(Rule("delay", method="GET", path_contains="rank00000.safetensors", delay=3.0, times=1000))
    res: dict[str, int] = {}
    t = threading.Thread(
        target=lambda: res.update(
            code=cli_main(["export", url, "--step", "1", "--to", str(out / "m.safetensors"), *so(proxy.endpoint)])
        )
    )
    t.start()
    try:
        time.sleep(1.0)
        with Checkpointer(url, storage_options=opts(s3.endpoint), keep_last=1) as ck:
            for step in (2, 3):
                ck.save(step, {"model": {"w": torch.ones(3)}}).result(timeout=60)
    finally:
        t.join(120)
    err = capsys.readouterr().err
    assert res == {"code": 1}, err
    assert "retired or replaced" in err and "missing" not in err, err
    assert os.listdir(out) == []
    assert bad_of(capsys, url, s3.endpoint) == [(3, "complete", None)]


def sigint(pid: int, to: str) -> None:
    """SIGINT to process ``pid``: ``"process"``, as a terminal's Ctrl-C or ``kill -INT`` (the
    kernel picks the thread that takes it: the main one where it can); ``"thread"``, taken by
    one of its other threads, as the kernel may pick (only the main thread runs Python's
    handler: a main thread asleep in an untimed wait is not woken by it)."""
    if to == "process":
        os.kill(pid, signal.SIGINT)
        return
    import ctypes

    def name(tid: int) -> str:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()

    # one of the store client's (obstore's tokio) threads: always there, never the main one
    others = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid and "tokio" in name(int(t)))
    assert others, "the export has no thread of the store client's"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.tgkill(pid, others[0], signal.SIGINT) == 0, os.strerror(ctypes.get_errno())


@pytest.mark.timing
@pytest.mark.parametrize(("held", "to"), [("write", "process"), ("write", "thread"), ("header", "thread")])
def test_ctrl_c_while_a_get_is_held_ends_the_export_promptly_and_leaves_no_output(
    s3: Any, proxy: FaultProxy, tmp_path: Path, held: str, to: str
) -> None:
    """SIGINT while the export's next ranged GET of the shard is held by the store (it never
    answers): exit 130 within seconds, nothing left beside OUT. ``write``: once the temporary
    output exists; ``header``: the shard header's GET, before anything is written.

    It waited for the held GET to end by its deadline (``--deadline``, an hour by default):
    first because the export's clean-up waited for its reads in flight (a read of an
    interrupted export is cancelled now); then, where a thread other than the main one took
    the signal (``to="thread"``: the kernel may hand a process's signal to any of its
    threads), because the main thread slept in an untimed ``Future.result()`` that no signal
    wakes (its waits are in slices now: ``threads._deadline.result_of``). Once, under make
    test's load, the process-directed SIGINT was not handled within 30 s."""
    _, url = single(tmp_path, s3.endpoint, mib=40)
    out = tmp_path / "out"
    out.mkdir()
    if held == "write":
        proxy.add(Rule("delay", method="GET", path_contains="rank00000.safetensors", delay=1.0, times=1000))
        hang = None
    else:
        hang = proxy.add(Rule("hang", method="GET", path_contains="rank00000.safetensors", times=1000))
    argv = [sys.executable, "-m", "asyncckpt", "export", url, "--to", str(out / "m.safetensors"), *so(proxy.endpoint)]
    with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True) as p:  # its pipe closed on every path
        try:
            deadline = time.monotonic() + 60
            if hang is None:
                while not os.listdir(out) and p.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert os.listdir(out), "the export never created its temporary output"
                proxy.clear()
                hang = proxy.add(Rule("hang", method="GET", path_contains="rank00000.safetensors", times=1000))
            while hang.hits == 0 and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert hang.hits and p.poll() is None, "the export read no more of the shard: nothing was held"
            t0 = time.monotonic()
            sigint(p.pid, to)
            try:
                _, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"a SIGINT ({to}) while a GET is held did not end the export within 30 s")
            took = time.monotonic() - t0
        finally:
            if p.poll() is None:
                p.kill()
    print(f"\nSIGINT ({to}) with a GET of the {held} held: exit {p.returncode} after {took:.2f} s")
    assert p.returncode == 130 and "interrupted" in err, (p.returncode, err)
    assert took < 10, took
    assert os.listdir(out) == []


@pytest.mark.needs_root
def test_a_pt_export_to_a_full_file_system_is_enospc_not_an_internal_error(tmp_path: Path) -> None:
    """``--to x.pt`` on a 2 MiB tmpfs (torch.save has no size to reserve first): exit 1 with
    ENOSPC named, nothing left beside OUT (main: exit 70, "internal error (RuntimeError:
    [enforce fail at inline_container.cc] unexpected pos ...)": torch's zip writer loses the
    errno)."""
    from _nosigbus import tmpfs

    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(1, {"model": {"w": torch.randn(MiB)}}).result(timeout=60)
    with tmpfs(tmp_path / "small", "2m") as mnt:
        r = subprocess.run([sys.executable, "-m", "asyncckpt", "export", str(root), "--to", str(mnt / "m.pt")],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert r.returncode == 1 and os.strerror(28) in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert os.listdir(mnt) == []


def test_out_that_is_a_directory_is_refused_by_name_even_with_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """main: with --force, exit 1 "Is a directory: .../.d.safetensors.tmp-..." naming the
    temporary file, after the whole step was read; now refused at once, naming OUT."""
    root = local(tmp_path)
    dest = tmp_path / "d.safetensors"
    dest.mkdir()
    for extra in ([], ["--force"]):
        code, _, err = cli(capsys, "export", root, "--to", dest, *extra)
        assert code == 2 and f"{dest} is a directory" in err and ".tmp-" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["ck", "d.safetensors"]
    assert os.listdir(dest) == []
