"""``asyncckpt export`` reads every root through ``Root.open_reader``: from an ``s3://`` URL it
streams ranged GETs of the objects the rank's tensors lie in (no temporary copy of the step
beside OUT), and its output is the same, byte for byte and in ``--json``, as a local export,
a ``memory://`` root's and a tier's. A corrupt object is named by its URL and the step is
marked bad on the store (as a local export marks a directory); a store that stops answering
mid-export fails within ``--deadline`` with a read error, no output and no bad mark.

The sharded step is a real 4-rank gloo save (FSDP2, TP, a 2-D mesh, tied, per-rank values),
so every kind of source is read from the store: DTensor chunks of every rank's object,
plain tensors with their own CRCs, and (the single-process steps) whole shards.
"""

from __future__ import annotations

import json
import os
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
from asyncckpt.roots import _memory, open_root
from asyncckpt.roots._transfer import copy_step

require_s3()

BUCKET = "exportstore"
MiB = 1024 * 1024
pytestmark = pytest.mark.timeout(300)
s3 = server_fixture(BUCKET)
proxy = proxy_fixture()


def fresh_url() -> str:
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory, s3: Any) -> tuple[Path, str]:
    """The 4-rank layouts step saved by real ranks, and its push to the store."""
    from test_export_sharded import spawn

    root, _ = spawn(tmp_path_factory.mktemp("x4"), "layouts", 4)
    url = fresh_url()
    remote.push(root, url, storage_options=opts(s3.endpoint), deadline_s=120)
    return root, url


def single(tmp_path: Path, endpoint: str, mib: int = 20, small: int = 0) -> tuple[Path, str]:
    """One process's step 1 of ``mib`` MiB in two tensors (several windows of the export) and
    ``small`` tensors of 16 KiB more, local and pushed."""
    root = tmp_path / f"ck-{uuid.uuid4().hex[:6]}"
    g = torch.Generator().manual_seed(1)
    model = {"w": torch.randn(mib * MiB // 8, generator=g), "v": torch.randn(mib * MiB // 8, generator=g),
             **{f"s{i}": torch.randn(4096, generator=g) for i in range(small)}, "b": torch.arange(10)}  # fmt: skip
    with Checkpointer(root) as ck:
        ck.save(1, {"model": model, "step": 1}).result(timeout=60)
    url = fresh_url()
    remote.push(root, url, storage_options=opts(endpoint), deadline_s=60)
    return root, url


class Beside:
    """Every name that appears in ``folder`` while it is watched (polled every millisecond)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.seen, self._stop = folder, set[str](), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen.update(os.listdir(self.folder))
            time.sleep(0.001)

    def __enter__(self) -> Beside:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=10)


def test_export_from_a_url_streams_the_objects_it_needs_and_stores_nothing_beside_out(
    sharded: tuple[Path, str], s3: Any, proxy: FaultProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """New behaviour: the step is not pulled first. Only rank 0's structure file is read (a pull
    fetched every rank's), no directory appears beside OUT, and the DTensors' chunks come in
    band-sized ranged GETs, not one request per tensor."""
    _, url = sharded
    out = tmp_path / "out"
    out.mkdir()
    dest = out / "all.safetensors"
    with Beside(out) as beside:
        code, _, err = cli(capsys, "export", url, "--to", dest, *so(proxy.endpoint))
    assert code == 0, err
    assert beside.seen <= {"all.safetensors"} | {n for n in beside.seen if n.startswith(".all.safetensors.tmp-")}, (
        beside.seen)  # fmt: skip
    assert not [n for n in beside.seen if n.startswith(".asyncckpt-export")], beside.seen
    gets = [s.path for s in proxy.seen if s.method == "GET" and "/a-" in s.path]
    assert [p for p in gets if p.endswith("rank00000.json")], gets
    assert not [p for p in gets if p.endswith(("rank00001.json", "rank00002.json", "rank00003.json"))], gets
    shards = [p for p in gets if p.endswith(".safetensors")]
    # every rank's object is read for the chunks it holds; the layouts step has dozens of
    # tensors: a request per tensor and rank would be well over a hundred
    assert 4 <= len(shards) <= 64, (len(shards), shards)


@pytest.mark.parametrize("extra", [[], ["--key", "tp"], ["--rank", "2"]])
def test_sharded_export_from_the_store_and_memory_equals_the_local_export(
    sharded: tuple[Path, str], s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    root, url = sharded
    mem = f"memory://export-{uuid.uuid4().hex[:8]}"
    copy_step(open_root(root), open_root(mem), 1)
    try:
        docs, outs = [], []
        for side, where, more in (("near", root, []), ("far", url, so(s3.endpoint)), ("mem", mem, [])):
            dest = tmp_path / side / "x.safetensors"
            dest.parent.mkdir()
            code, out, err = cli(capsys, "export", where, "--to", dest, "--json", *extra, *more)
            assert code == 0, err
            doc = json.loads(out)
            assert doc.pop("path") == str(dest)
            docs.append(doc)
            outs.append(dest.read_bytes())
        assert docs[0] == docs[1] == docs[2]
        assert outs[0] == outs[1] == outs[2]
    finally:
        _memory.drop(mem[len("memory://") :])


def test_export_through_a_tier_reads_the_store_when_the_local_copy_is_gone(
    sharded: tuple[Path, str], s3: Any, tmp_path: Path
) -> None:
    from asyncckpt.loading._export import open_export
    from asyncckpt.roots._tier import TierRoot

    root, url = sharded
    far = open_root(url, storage_options=opts(s3.endpoint), deadline_s=60)
    tier = TierRoot(open_root(tmp_path / "empty"), far, lambda skip: 1)
    (tmp_path / "empty").mkdir()
    with open_export(tier, 1, 0) as ex:
        ex.write(str(tmp_path / "t.safetensors"), ex.named)
    with open_export(open_root(root), 1, 0) as ex:
        ex.write(str(tmp_path / "l.safetensors"), ex.named)
    assert (tmp_path / "t.safetensors").read_bytes() == (tmp_path / "l.safetensors").read_bytes()


def test_a_corrupt_object_is_named_by_its_url_and_the_step_is_marked_bad(
    s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """New behaviour: the bad mark (a pull-then-export found the damage in the pull and left
    the store's step unmarked, so ``load(step=None)`` kept choosing it)."""
    _, url = single(tmp_path, s3.endpoint)
    attempt = json.loads(get(s3.endpoint, url, "step_00000001/manifest.json"))["attempt"]
    key = f"step_00000001/a-{attempt}/rank00000.safetensors"
    data = bytearray(get(s3.endpoint, url, key))
    data[len(data) // 2] ^= 0x40  # same size: only the CRC can tell
    put(s3.endpoint, url, key, bytes(data))
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = cli(capsys, "export", url, "--step", "1", "--to", out / "m.safetensors", *so(s3.endpoint))
    assert code == 1 and "checksum mismatch" in err and f"{url}/{key}" in err, err
    assert os.listdir(out) == []
    code, listing, err = cli(capsys, "ls", url, "--json", *so(s3.endpoint))
    assert code == 0, err
    (row,) = json.loads(listing)
    assert row["status"] == "bad" and row["bad"] is not None, row


@pytest.mark.timing
def test_a_store_that_stops_answering_mid_export_fails_within_the_deadline(
    sharded: tuple[Path, str], s3: Any, proxy: FaultProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 3's object never answers (its chunks are read only once the output is being
    written): exit 1 within ``--deadline`` naming the object, a read error (no bad mark), no
    output file, no temporary beside it; the same export succeeds once the store answers."""
    _, url = sharded
    out = tmp_path / "out"
    out.mkdir()
    proxy.add(Rule("hang", method="GET", path_contains="rank00003.safetensors", times=1000))
    t0 = time.monotonic()
    code, _, err = cli(capsys, "export", url, "--to", out / "m.safetensors", "--deadline", "4", *so(proxy.endpoint))
    took = time.monotonic() - t0
    assert code == 1 and "rank00003.safetensors" in err and "checksum" not in err, err
    assert took < 4 + 20, took
    assert os.listdir(out) == []
    proxy.clear()
    code, listing, err = cli(capsys, "ls", url, "--json", *so(s3.endpoint))
    assert code == 0 and json.loads(listing)[0]["bad"] is None, (err, listing)
    code, _, err = cli(capsys, "export", url, "--to", out / "m.safetensors", *so(proxy.endpoint))
    assert code == 0, err


def test_single_process_export_from_the_store_reads_whole_windows(
    s3: Any, proxy: FaultProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """New behaviour: a shard verified whole is read front to back in windows, one ranged GET
    each (1,000 small tensors among them ask for no request of their own; a pull fetched the
    object in 1 MiB ranges); the output equals the local export's."""
    root, url = single(tmp_path, s3.endpoint, mib=20, small=1000)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert cli(capsys, "export", root, "--to", a)[0] == 0
    proxy.clear()
    assert cli(capsys, "export", url, "--to", b, *so(proxy.endpoint))[0] == 0
    assert a.read_bytes() == b.read_bytes()
    shard = [s for s in proxy.seen if s.method == "GET" and s.path.endswith("rank00000.safetensors")]
    size = (root / "step_00000001" / "rank00000.safetensors").stat().st_size
    assert len(shard) <= 2 + size // (8 * MiB) + 1, len(shard)  # the header, then one GET per 8 MiB window
