"""DTensors whose replicas lie outside their own mesh (issue 28): a parameter FSDP2 shards over
``mesh["dp"]`` of a 2 x 2 ``(dp, tp)`` mesh lives on two dp sub-meshes, one per tp column. Its
global tensor must be written once and load, on real gloo ranks; and ``verify`` must reject
exactly what ``load`` rejects (the index's coverage and overlaps, every block CRC)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli_util import option_args
from _ranks import free_port, log_tail, run_ranks

import asyncckpt
from asyncckpt import CheckpointCorruptError, reading
from asyncckpt.format._checksum import crc32c
from asyncckpt.format._manifest import MANIFEST, FileEntry, encode
from asyncckpt.loading._verify import verify_step
from asyncckpt.roots.posix._discovery import read_manifest

WORKER = str(Path(__file__).parent / "support" / "_placement_worker.py")
STEP = "step_00000001"


def spawn(tmp: Path, scenario: str, world: int, root: Path, out: Path, warm: bool = False) -> dict[int, dict[str, Any]]:
    logs = tmp / f"logs-{scenario}-{world}"
    logs.mkdir()
    port = free_port()
    argv = [str(world), str(port), str(root), str(out)]
    hung = run_ranks(lambda r: [WORKER, scenario, str(r), *argv], world, logs, 100.0, warm=warm)
    assert not hung, f"ranks {hung} still running at the deadline"
    res = {}
    for r in range(world):
        f = Path(f"{out}.{r}.json")
        assert f.exists(), f"rank {r} wrote no result:\n{log_tail(logs, r)}"
        res[r] = json.loads(f.read_text())
        assert "crash" not in res[r], res[r]["crash"]
    return res


@pytest.fixture(scope="module")
def submesh(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[int, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("submesh")
    root, out = tmp / "ck", tmp / "out"
    return root, out, spawn(tmp, "linear_submesh", 4, root, out, warm=True)


def verify(root: Path, step: int = 1) -> list[str]:
    return [str(p) for p in verify_step(str(root), step, record=False)]


def dtensor_bytes_written(step: Path, index: dict[str, Any]) -> int:
    """Bytes of DTensor data in the step's rank files (whether or not the index points at them)."""
    total = 0
    for f in sorted(step.glob("rank*.safetensors")):
        slots = reading.read_shard_slots(str(f), f.stat().st_size)
        total += sum(s.end - s.begin for n, s in slots.items() if n in index["tensors"])
    return total


@pytest.mark.timeout(120)
def test_linear_on_dp_submesh_of_2x2_is_written_once_and_loads(submesh: Any) -> None:
    root, out, res = submesh
    for r, got in res.items():
        for name in ("dedupe", "plain"):
            assert got[name].get("error") is None and got[name]["diff"] == [], (r, name, got[name])
    ref = torch.load(f"{out}.ref.pt")
    written = {}
    for name, n in itertools.product(("dedupe", "plain"), (1, 2)):
        step = Path(f"{root}-{name}") / f"step_{n:08d}"
        index = json.loads((step / "index.json").read_text())
        for key, e in index["tensors"].items():
            boxes = [(tuple(c[0]), tuple(c[1])) for c in e["chunks"]]
            assert len(boxes) == len(set(boxes)), (name, key, boxes)  # each global chunk once
        assert verify(Path(f"{root}-{name}"), n) == []
        written[f"{name}{n}"] = dtensor_bytes_written(step, index)
        if n == 1:  # one process, no mesh: the whole tensors
            whole = asyncckpt.load(Path(f"{root}-{name}"), 1, per_rank="rank0")
            assert torch.equal(whole["model"]["weight"], ref["model"]["weight"])
    r0 = res[0]
    # default (dedupe): no byte of a global tensor written twice, and no more bytes than DCP;
    # the second save (the arena laid out for the first one's plan, no copy) as the first
    assert written["dedupe1"] == written["dedupe2"] == r0["dtensor_bytes"], (written, r0)
    assert r0["dedupe"]["bytes"] <= r0["dcp_bytes"], r0
    # without dedupe (no round before the write) each tp column writes its copy; one is indexed
    assert written["plain1"] == written["plain2"] == 2 * r0["dtensor_bytes"], (written, r0)


def reseal(step_dir: Path, name: str, data: bytes) -> None:
    """Replace ``name`` in a committed step and seal a manifest that matches it (same format)."""
    m = read_manifest(str(step_dir))
    (step_dir / name).write_bytes(data)
    files = [FileEntry(f.name, len(data), crc32c(data), f.rank) if f.name == name else f for f in m.files]
    fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.init}
    fields.update(world_size=m.world_size, files=files, ranks=list(m.ranks) if m.ranks is not None else None)
    (step_dir / MANIFEST).write_bytes(encode(**fields))


def copy_of(submesh: Any, tmp_path: Path) -> tuple[Path, Path]:
    root, _, _ = submesh
    copy = tmp_path / "ck"
    shutil.copytree(f"{root}-dedupe", copy)
    return copy, copy / STEP


def test_an_index_listing_every_twin_loads_and_verifies(submesh: Any, tmp_path: Path) -> None:
    """The issue's committed steps (written before twins were merged): every chunk of a
    sub-mesh DTensor listed once per tp column. An equal box is the same chunk: they load,
    bit-exact, and verify."""
    root, step = copy_of(submesh, tmp_path)
    ref = torch.load(f"{submesh[1]}.ref.pt")
    index = json.loads((step / "index.json").read_text())
    for e in index["tensors"].values():
        e["chunks"] *= 2
        e["blocks"] *= 2
    reseal(step, "index.json", json.dumps(index).encode())
    assert verify(root) == []
    got = asyncckpt.load(root, 1, per_rank="rank0")
    assert torch.equal(got["model"]["weight"], ref["model"]["weight"])
    # and the CLI's export (which exited 1 on them) writes the full tensors
    from safetensors.torch import load_file

    from asyncckpt.cli import main as cli_main

    out = tmp_path / "model.safetensors"
    assert cli_main(["export", str(root), "--step", "1", "--key", "model", "--to", str(out)]) == 0
    assert torch.equal(load_file(str(out))["weight"], ref["model"]["weight"])


def test_verify_rejects_the_overlapping_chunks_load_rejects(submesh: Any, tmp_path: Path) -> None:
    """Chunks that overlap without being equal: rejected by both, in the same words."""
    root, step = copy_of(submesh, tmp_path)
    index = json.loads((step / "index.json").read_text())
    e = index["tensors"]["model.bias"]
    e["chunks"][1][0] = [e["chunks"][1][0][0] - 1]  # one row into its neighbour
    reseal(step, "index.json", json.dumps(index).encode())
    with pytest.raises(CheckpointCorruptError, match=r"bad global index \(model\.bias: chunk .* overlaps") as got:
        asyncckpt.load(root, 1, per_rank="rank0")
    problems = verify(root)
    assert len(problems) == 1 and problems[0].split(": /")[0] in str(got.value), (problems, got.value)
    assert problems[0].endswith("index.json")


def test_verify_checks_every_block_crc_load_checks(submesh: Any, tmp_path: Path) -> None:
    """A flipped byte inside a chunk, with the file's CRC in the manifest made to match: only
    the block CRCs of the index can see it, and both load and verify do."""
    root, step = copy_of(submesh, tmp_path)
    index = json.loads((step / "index.json").read_text())
    _, _, file, begin, n, _ = index["tensors"]["model.weight"]["chunks"][1]
    data = bytearray((step / file).read_bytes())
    data[begin + n // 2] ^= 0x10
    reseal(step, file, bytes(data))
    with pytest.raises(CheckpointCorruptError) as got:
        asyncckpt.load(root, 1, per_rank="rank0")
    assert got.value.path is not None and got.value.path.endswith(file)
    problems = verify(root)
    assert len(problems) == 1 and "block 0 of a chunk of 'model.weight'" in problems[0], problems
    assert problems[0].endswith(file)


def test_verify_names_a_dtensor_the_index_lacks(submesh: Any, tmp_path: Path) -> None:
    root, step = copy_of(submesh, tmp_path)
    index = json.loads((step / "index.json").read_text())
    index["tensors"]["model.bias2"] = index["tensors"].pop("model.bias")
    reseal(step, "index.json", json.dumps(index).encode())
    with pytest.raises(CheckpointCorruptError, match=r"the index lacks DTensor 'model\.bias'"):
        asyncckpt.load(root, 1, per_rank="rank0")
    problems = verify(root)
    assert problems and "the index lacks DTensor 'model.bias'" in problems[0], problems


@pytest.mark.slow  # > 15 s on a quiet 2-core machine: make test-slow (and CI) runs it
@pytest.mark.timeout(120)
def test_stateful_targets_read_only_their_shards(tmp_path: Path) -> None:
    """torchtitan's model wrapper and flat optimizer state dict as ``into=`` targets: each of
    4 ranks reads about a quarter of the DTensor bytes (plus the index and trees), exactly
    what a plain-dict target reads (/proc/self/io, after each kind's first load, whose reads
    include the modules it imports), and gets exactly what was saved."""
    res = spawn(tmp_path, "stateful", 4, tmp_path / "ck", tmp_path / "out")
    for r, got in res.items():
        assert got["diff"] == [], (r, got["diff"][:5])
        read = got["read"]
        assert read["stateful again"] <= read["plain again"] + 4096, (r, read)
        assert read["stateful again"] < 0.3 * got["dtensor_bytes"], (r, read, got["dtensor_bytes"])


@pytest.mark.timeout(120)
def test_remote_verify_checks_the_index_load_checks(
    submesh: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``asyncckpt verify s3://...``: a step whose every object matches its CRC but whose index
    a load refuses (chunks overlapping) does not verify; the good step does."""
    pytest.importorskip("obstore")
    import obstore
    from obstore.store import S3Store
    from s3fixtures import opts, shared_server

    from asyncckpt import remote
    from asyncckpt.cli import main as cli_main

    root, step = copy_of(submesh, tmp_path)
    with shared_server("placement") as s3:
        o = opts(s3.endpoint)
        so = option_args(o)
        url = "s3://placement/run"
        remote.push(root, url, storage_options=o, deadline_s=60)
        assert cli_main(["verify", url, "--all", *so]) == 0
        capsys.readouterr()
        index = json.loads((step / "index.json").read_text())
        e = index["tensors"]["model.bias"]
        e["chunks"][1][0] = [e["chunks"][1][0][0] - 1]
        reseal(step, "index.json", json.dumps(index).encode())
        attempt = read_manifest(str(step)).attempt
        st = S3Store("placement", prefix="run", config=o, client_options={"allow_http": True})  # type: ignore[arg-type]
        obstore.put(st, f"{STEP}/a-{attempt}/index.json", (step / "index.json").read_bytes())
        obstore.put(st, f"{STEP}/manifest.json", (step / MANIFEST).read_bytes())
        assert cli_main(["verify", url, "--step", "1", *so]) == 1
        err = capsys.readouterr().err
        assert "bad global index (model.bias: chunk" in err and err.rstrip().endswith("index.json"), err
        with pytest.raises(CheckpointCorruptError, match=r"bad global index \(model\.bias: chunk"):
            remote.load(url, 1, per_rank="rank0", storage_options=o)


@pytest.mark.slow  # > 15 s on a quiet 2-core machine: make test-slow (and CI) runs it
@pytest.mark.timeout(120)
def test_a_file_without_twins_holds_only_staged_bytes(tmp_path: Path) -> None:
    """The copy in save() paused halfway on every rank while the dedupe round ends: each rank's
    file without the twins others write is built from the staged state (it waits for the copy),
    so every tensor loads as saved (before: bytes not yet copied, with CRCs that matched them)."""
    res = spawn(tmp_path, "paused_staging", 4, tmp_path / "ck", tmp_path / "out")
    for r, got in res.items():
        assert got["paused"], r
        assert got["diff"] == [], (r, len(got["diff"]), got["diff"][:5])


@pytest.mark.timeout(120)
def test_remote_verify_checks_every_block_crc_load_checks(
    submesh: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``asyncckpt verify s3://...`` is the local engine (one ``verify`` for every root): a
    flipped byte inside a chunk whose file's CRC was made to match is seen by the block CRCs
    of the index, on the store as on disk, and the step is marked bad on the store."""
    pytest.importorskip("obstore")
    from s3fixtures import opts, running_server

    from asyncckpt import remote
    from asyncckpt.cli import main as cli_main

    root, step = copy_of(submesh, tmp_path)
    index = json.loads((step / "index.json").read_text())
    _, _, file, begin, n, _ = index["tensors"]["model.weight"]["chunks"][1]
    data = bytearray((step / file).read_bytes())
    data[begin + n // 2] ^= 0x10
    reseal(step, file, bytes(data))
    with running_server("placement") as s3:
        o = opts(s3.endpoint)
        so = option_args(o)
        url = "s3://placement/blocks"
        remote.push(root, url, storage_options=o, deadline_s=60)
        assert cli_main(["verify", url, "--step", "1", *so]) == 1
        err = capsys.readouterr().err
        assert "checksum mismatch in block 0 of a chunk of 'model.weight'" in err, err
        assert err.rstrip().endswith(file) and url in err, err
        from asyncckpt.roots import open_root

        rows = {r.step: r for r in open_root(url, storage_options=o).list_steps()}
        assert rows[1].state == "bad" and rows[1].bad is not None, rows[1]  # known bad on the store
        with pytest.raises(CheckpointCorruptError):
            remote.load(url, 1, per_rank="rank0", storage_options=o)
