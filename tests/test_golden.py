"""The golden checkpoints (``tests/data/golden/``, written by ``make_golden.py``): every later
version of the code must load them bit for bit, through every door (``asyncckpt.load``,
``Checkpointer.load(into=)``, another world size, ``s3://``, the CLI), and must write the same
bytes for the same state.

The expected values are regenerated from seeds (``_golden_worker``), never read from the
golden files themselves. Manifests hold three fields that differ on every save (``created``,
``attempt``, ``run``): a fresh manifest must equal the golden one byte for byte once those
three take the fresh values and the seal (``checksum``, a CRC-32C of the canonical body, the
format's own rule, recomputed here independently) is recomputed.
"""

from __future__ import annotations

import collections
import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest
import torch
from _cli_util import cli_doc, option_args
from _golden_worker import (
    STEP,
    Net,
    Small,
    ddp_module,
    ddp_saved,
    fsdp_tp_full,
    single_saved,
    single_state,
)
from _ranks import free_port, log_tail, run_ranks
from conftest import assert_same
from s3fixtures import data_keys, get, opts, put, require_s3, shared_server

import asyncckpt
from asyncckpt import Checkpointer, CheckpointError, remote

GOLDEN = Path(__file__).parent / "data" / "golden"
WORKER = str(Path(__file__).parent / "support" / "_golden_worker.py")
STEP_DIR = f"step_{STEP:08d}"
LOCAL = ("single", "ddp2", "fsdp_tp4")
PUSHED = ("single", "fsdp_tp4")
BUCKET = "golden"
pytestmark = pytest.mark.timeout(180)


# ------------------------------------------------------------------ comparing


def canon(x: Any) -> Any:
    """``x`` as plain dicts, lists and tensors that :func:`conftest.assert_same` compares
    exactly: each value tagged with its exact type and whatever ``==`` would not see (a
    tensor's ``requires_grad``, a float's sign and NaN payload, an OrderedDict's metadata, a
    defaultdict's factory, a generator's state, an array's dtype)."""
    if isinstance(x, torch.Tensor):
        return {"type": type(x).__name__, "requires_grad": x.requires_grad, "data": x.detach()}
    if isinstance(x, np.ndarray):
        return {"type": "ndarray", "dtype": str(x.dtype), "shape": list(x.shape), "writable": x.flags.writeable,
                "data": torch.from_numpy(np.ascontiguousarray(x).reshape(-1).view(np.uint8).copy())}
    if isinstance(x, np.generic):
        return {"type": type(x).__name__, "data": x.tobytes()}
    if isinstance(x, torch.Generator):
        return {"type": "Generator", "device": str(x.device), "state": x.get_state()}
    if isinstance(x, float):
        return {"type": "float", "bits": np.float64(x).tobytes()}
    if isinstance(x, dict):
        tag: dict[str, Any] = {"type": type(x).__name__}
        if isinstance(x, collections.OrderedDict):
            tag["metadata"] = canon(getattr(x, "_metadata", None))
        if isinstance(x, collections.defaultdict):
            tag["factory"] = None if x.default_factory is None else x.default_factory.__name__
        # keys keep their type: a list of pairs, not a dict
        return {**tag, "items": [[type(k).__name__, repr(k), canon(v)] for k, v in x.items()]}
    if isinstance(x, (list, tuple)):
        return {"type": type(x).__name__, "items": [canon(v) for v in x]}
    if isinstance(x, (set, frozenset)):
        return {"type": type(x).__name__, "items": sorted(repr(v) for v in x)}
    return x


def same(got: Any, want: Any) -> None:
    assert_same(canon(got), canon(want))


def fixed_manifest(golden: bytes, fresh: bytes) -> bytes:
    """The golden manifest with the fresh one's ``created``, ``attempt`` and ``run`` and
    the seal recomputed: what ``fresh`` must be, byte for byte."""
    g, f = json.loads(golden), json.loads(fresh)

    def encoded(doc: dict[str, Any]) -> bytes:
        return json.dumps(doc, sort_keys=True, indent=1, ensure_ascii=True).encode() + b"\n"

    assert encoded(g) == golden, "the golden manifest is not in the format's own encoding"
    assert re.fullmatch(r"[0-9a-f]{16}", f["attempt"]) and re.fullmatch(r"[0-9a-f]{32}", f["run"]), f
    assert isinstance(f["created"], float) and abs(f["created"] - time.time()) < 600, f["created"]
    body = {k: v for k, v in g.items() if k != "checksum"}
    body.update(created=f["created"], attempt=f["attempt"], run=f["run"])
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return encoded(dict(body, checksum=crc32c.crc32c(canonical)))


def assert_same_bytes(fresh_root: Path, golden_root: Path) -> None:
    """The step of ``fresh_root`` holds the golden files: data and structure byte for byte,
    the manifest with its three per-save fields normalised (:func:`fixed_manifest`)."""
    fresh, golden = fresh_root / STEP_DIR, golden_root / STEP_DIR
    names = sorted(p.name for p in golden.iterdir())
    assert sorted(p.name for p in fresh.iterdir()) == names
    for name in names:
        want, got = (golden / name).read_bytes(), (fresh / name).read_bytes()
        if name == "manifest.json":
            want = fixed_manifest(want, got)
        assert got == want, f"{name} differs from the golden one"


@pytest.fixture
def copy(tmp_path: Path) -> Any:
    """A writable copy of a golden root (a load may record a bad mark, a Checkpointer its lock)."""

    def make(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(GOLDEN / name, dst)
        return dst

    return make


def test_the_golden_files_are_small_and_complete() -> None:
    total = 0
    for p in GOLDEN.rglob("*"):
        if p.is_file():
            assert p.stat().st_size < 1 << 20, p
            total += p.stat().st_size
    assert total < 4 << 20
    for name in LOCAL:
        assert sorted(p.name for p in (GOLDEN / name).iterdir()) == [STEP_DIR]
    manifests = {n: json.loads((GOLDEN / n / STEP_DIR / "manifest.json").read_bytes()) for n in LOCAL}
    assert {n: (m["world_size"], m["format"]) for n, m in manifests.items()} == {
        "single": (1, "asyncckpt/2"), "ddp2": (2, "asyncckpt/2"), "fsdp_tp4": (4, "asyncckpt/2")}
    assert (GOLDEN / "fsdp_tp4" / STEP_DIR / "index.json").is_file()


# ------------------------------------------------------------------ one process


def test_single_loads_bit_exactly(copy: Any) -> None:
    root = copy("single")
    want = single_saved()
    same(asyncckpt.load(root), want)
    same(asyncckpt.load(root, STEP, rank=0, verify=True), want)
    mapped = asyncckpt.load(root, mmap=True)
    same(mapped["tensors"], want["tensors"])
    same(mapped["tied"], want["tied"])


def test_single_loads_into_objects(copy: Any) -> None:
    root = copy("single")
    want = single_saved()
    model = Small()
    optim = torch.optim.Adam(model.parameters(), lr=0.5)
    gen = torch.Generator()
    tensors = {k: torch.zeros_like(v) for k, v in want["tensors"].items() if k not in ("param", "frozen")}
    target = {"model": model, "optim": optim, "torch": {"generator": gen}, "tensors": tensors}
    with Checkpointer(root) as ck:
        got = ck.load(into=target)
    same(model.state_dict(), want["model"])
    same(optim.state_dict(), want["optim"])
    same(gen, want["torch"]["generator"])
    same(tensors, {k: v for k, v in want["tensors"].items() if k in tensors})
    assert all(got["tensors"][k] is t for k, t in tensors.items())  # restored in place
    same(got["plain"], want["plain"])
    # the module-level load restores into objects too
    model2 = Small()
    asyncckpt.load(root, into={"model": model2})
    same(model2.state_dict(), want["model"])


def test_single_resaves_to_the_same_bytes(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "fresh") as ck:
        ck.save(STEP, single_state()).result(timeout=60)
    assert_same_bytes(tmp_path / "fresh", GOLDEN / "single")


def test_ddp_loads_each_rank_in_one_process(copy: Any) -> None:
    root = copy("ddp2")
    for r in (0, 1):
        same(asyncckpt.load(root, rank=r), ddp_saved(r))
    with pytest.raises(CheckpointError, match="rng"):  # per-rank values differ: a policy is needed
        asyncckpt.load(root)
    same(asyncckpt.load(root, per_rank="rank0"), ddp_saved(0))
    model = ddp_module(seed=1)  # other values
    optim = torch.optim.Adam(model.parameters(), lr=0.5)
    with Checkpointer(root, strip_prefixes=("module.",)) as ck:
        ck.load(into={"model": model, "optim": optim}, per_rank="rank0")
    want = ddp_saved(0)
    same(model.state_dict(), want["model"])
    same(optim.state_dict(), want["optim"])


def test_fsdp_tp_loads_whole_in_one_process(copy: Any) -> None:
    root = copy("fsdp_tp4")
    want = fsdp_tp_full()
    got = asyncckpt.load(root)
    same(got["model"], want["model"])
    same(got["optim"]["state"], want["optim"]["state"])
    assert got["step"] == STEP
    model = Net()
    with Checkpointer(root) as ck:
        ck.load(into={"model": model})
    same(model.state_dict(), want["model"])


# ------------------------------------------------------------------ real ranks


def spawn(tmp: Path, scenario: str, world: int, roots: list[Path]) -> dict[int, dict[str, Any]]:
    logs = tmp / f"logs-{scenario}"
    logs.mkdir()
    port, out = free_port(), tmp / f"out-{scenario}"
    argv = [scenario, "", str(world), str(port), *map(str, roots), str(out)]
    hung = run_ranks(lambda r: [WORKER, argv[0], str(r), *argv[2:]], world, logs, 150.0, warm=True)
    assert not hung, f"ranks {hung} still running at the deadline"
    res = {}
    for r in range(world):
        f = Path(f"{out}.{r}.json")
        assert f.exists(), f"rank {r} wrote no result:\n{log_tail(logs, r)}"
        res[r] = json.loads(f.read_text())
        assert "crash" not in res[r], res[r]["crash"]
    return res


def test_on_two_ranks_ddp_resaves_to_the_same_bytes_and_fsdp_tp_reshards(tmp_path: Path, copy: Any) -> None:
    """One 2-rank job: the DDP state saved again with dedupe gives the golden bytes; the
    4-rank FSDP2 x TP golden loads into FSDP2 on a 1-D mesh of 2, bit-exact."""
    res = spawn(tmp_path, "two", 2, [tmp_path / "ddp", copy("fsdp_tp4")])
    assert_same_bytes(tmp_path / "ddp", GOLDEN / "ddp2")
    assert [res[r]["diff"] for r in (0, 1)] == [[], []]
    assert [res[r]["step"] for r in (0, 1)] == [STEP, STEP]


def test_on_four_ranks_fsdp_tp_resaves_to_the_same_bytes(tmp_path: Path) -> None:
    spawn(tmp_path, "fsdp_tp", 4, [tmp_path / "fsdp_tp"])
    assert_same_bytes(tmp_path / "fsdp_tp", GOLDEN / "fsdp_tp4")


# ------------------------------------------------------------------ the CLI


@pytest.mark.parametrize("name", LOCAL)
def test_cli_verify_ls_info_on_each_golden(copy: Any, name: str) -> None:
    root = copy(name)
    world = json.loads((root / STEP_DIR / "manifest.json").read_bytes())["world_size"]
    code, doc, err = cli_doc("verify", root, "--json")
    assert code == 0 and doc["ok"] == 1 and doc["steps"][0]["status"] == "ok", (doc, err)
    code, rows, err = cli_doc("ls", root, "--json")
    assert code == 0 and [(r["step"], r["status"], r["ranks"]) for r in rows] == [(STEP, "complete", world)], err
    for rank in range(world):
        code, doc, err = cli_doc("info", root, "--rank", rank, "--json")
        assert code == 0 and doc["step"] == STEP and doc["rank"] == rank, err
    code, text, err = cli_doc("info", root)
    assert code == 0 and text.startswith(f"step {STEP}  "), err


# ------------------------------------------------------------------ s3://


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[str, dict[str, str]]]:
    """A SeaweedFS holding the golden objects as they sat on the store they were pushed to."""
    require_s3()
    with shared_server(BUCKET) as server:
        for name in PUSHED:
            base = GOLDEN / "s3" / name
            for f in sorted(base.rglob("*")):
                if f.is_file():
                    put(server.endpoint, f"s3://{BUCKET}/{name}", f.relative_to(base).as_posix(), f.read_bytes())
        yield server.endpoint, opts(server.endpoint)


def test_pushed_goldens_load_through_s3(store: tuple[str, dict[str, str]]) -> None:
    _, so = store
    same(asyncckpt.load(f"s3://{BUCKET}/single", storage_options=so), single_saved())
    model = Small()
    asyncckpt.load(f"s3://{BUCKET}/single", into={"model": model}, storage_options=so)
    same(model.state_dict(), single_saved()["model"])
    want = fsdp_tp_full()
    got = asyncckpt.load(f"s3://{BUCKET}/fsdp_tp4", storage_options=so)
    same(got["model"], want["model"])
    same(got["optim"]["state"], want["optim"]["state"])


def test_a_push_of_the_local_goldens_gives_the_golden_objects(store: tuple[str, dict[str, str]], copy: Any) -> None:
    """A push keeps the manifest and its attempt: the same keys and the same bytes."""
    endpoint, so = store
    for name in PUSHED:
        url = f"s3://{BUCKET}/again-{name}"
        remote.push(copy(name), url, storage_options=so, deadline_s=60)
        base = GOLDEN / "s3" / name
        want = sorted(f.relative_to(base).as_posix() for f in base.rglob("*") if f.is_file())
        assert data_keys(endpoint, url) == want
        for key in want:
            assert get(endpoint, url, key) == (base / key).read_bytes(), key


def test_cli_verify_ls_info_through_s3(store: tuple[str, dict[str, str]], copy: Any) -> None:
    _, so = store
    flags = option_args(so)
    for name in PUSHED:
        url = f"s3://{BUCKET}/{name}"
        code, doc, err = cli_doc("verify", url, "--json", *flags)
        assert code == 0 and doc["ok"] == 1, (doc, err)
        code, rows, err = cli_doc("ls", url, "--json", *flags)
        assert code == 0 and [(r["step"], r["status"]) for r in rows] == [(STEP, "complete")], err
        code, far, err = cli_doc("info", url, "--json", *flags)
        assert code == 0, err
        code, near, err = cli_doc("info", copy(name), "--json")
        assert far.pop("path") == f"{url}/{STEP_DIR}" and near.pop("path").endswith(STEP_DIR)
        assert far == near
