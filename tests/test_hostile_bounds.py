"""Hostile files cost bounded time and memory, and only CheckpointError escapes (issue 9, G).

Each case measured in issue 9 is rebuilt small-but-equivalent: just over the limit that
refuses it (so the refusal, not the file size, is what is tested), or the very same file
where it is cheap (a sparse 1 TiB shard, a world_size of 10**12). Reads that could cost
memory run in a child process that reports its wall time and peak RSS (``ru_maxrss``).
"""

from __future__ import annotations

import importlib.util
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

from asyncckpt import CheckpointCorruptError, Checkpointer, CheckpointError, find_latest, load
from asyncckpt.format._bounds import MAX_MANIFEST_FILES
from asyncckpt.format._manifest import MANIFEST, FileEntry, decode, encode

#: The fixed limits these files were first refused by (2**23 JSON items, a 256 MiB structure
#: file, 2**19 tensors per shard) refused honest states too (issue 26): the bounds now scale
#: with the bytes the file has, and the memory its parse needs is checked before parsing.
OLD_TREE_ITEMS, OLD_TENSORS = 2**23, 2**19

_spec = importlib.util.spec_from_file_location(
    "hostile_files", Path(__file__).resolve().parent.parent / "benchmarks" / "hostile_files.py"
)
assert _spec is not None and _spec.loader is not None
hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf)

STEP2 = "step_00000002"
SHARD, TREE = "rank00000.safetensors", "rank00000.json"

CHILD = r"""
import json, os, resource, sys, time
root, op, extra_as = sys.argv[1], sys.argv[2], int(sys.argv[3])
import asyncckpt, torch
if extra_as:
    vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra_as, resource.getrlimit(resource.RLIMIT_AS)[1]))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t0 = time.perf_counter()
out = {"type": None, "msg": None, "path": None}
try:
    asyncckpt.load(root, 2) if op == "load" else asyncckpt.load(root)
except BaseException as e:
    out = {"type": type(e).__name__, "msg": str(e), "path": getattr(e, "path", None),
           "checkpoint_error": isinstance(e, asyncckpt.CheckpointError)}
out["time_s"] = time.perf_counter() - t0
out["rss_growth"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
print(json.dumps(out))
"""


def run_child(root: Path, op: str = "load", extra_as: int = 0) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), op, str(extra_as)],
        capture_output=True, text=True, timeout=100, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"\n== {root.name} {op}: {out['time_s']:.2f}s, +{out['rss_growth'] / 2**20:.0f} MiB, {out['type']}")
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(hf.build_base(tmp_path_factory.mktemp("bounds")))


@pytest.fixture
def case(pristine: Path, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(pristine, root)
    return root


def assert_refused(out: dict[str, Any], path: Path, kind: str = "CheckpointCorruptError", rss_mib: int = 200) -> None:
    assert out["type"] == kind and out["checkpoint_error"], out
    assert str(path) in out["msg"], out
    assert out["time_s"] < 5, out
    assert out["rss_growth"] < rss_mib * 2**20, out


def test_world_size_of_10_12_is_refused_and_verify_ends_at_once(case: Path) -> None:
    hf.case_world_size(case / STEP2, 1.0)
    with pytest.raises(CheckpointCorruptError, match="world_size") as ei:
        load(case, 2)
    assert ei.value.path == str(case / STEP2 / MANIFEST)
    assert find_latest(case).step == 1  # type: ignore[union-attr]
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run(
        [sys.executable, "-m", "asyncckpt", "verify", str(case), "--step", "2"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert time.perf_counter() - t0 < 20


@pytest.mark.timing  # the same 5 s bound
def test_structure_file_of_more_items_than_memory_allows_is_refused_before_parsing(case: Path) -> None:
    """Nested empty lists, as in issue 9's 286 MiB file, at the old item limit: their parse
    needs ~3.2 GiB, refused under a 256 MiB headroom before json.loads allocates any of it."""
    n = OLD_TREE_ITEMS // 2 + 3
    hf.reseal(case / STEP2, {TREE: b"[" + b"[]," * n + b"[]]"})
    out = run_child(case, extra_as=256 * 2**20)
    assert_refused(out, case / STEP2 / TREE, kind="CheckpointError", rss_mib=150)
    assert "parsing the structure file needs" in out["msg"], out


def test_sparse_tib_structure_file_is_refused_unread(case: Path) -> None:
    """A manifest sealing a 1 TiB structure file (sparse: no blocks on disk): refused from
    its size, before a byte is read, saying how much memory its parse would need."""
    sd = case / STEP2
    m = decode((sd / MANIFEST).read_bytes(), "")
    with open(sd / TREE, "r+b") as f:
        f.truncate(2**40)  # the CRC would be wrong, but it is never read
    files = [f for f in m.files if f.name != TREE] + [FileEntry(TREE, 2**40, 0, 0)]
    (sd / MANIFEST).write_bytes(encode(m.step, m.attempt, m.world_size, m.nbytes, m.created, files, m.extra))
    out = run_child(case)
    assert_refused(out, sd / TREE, kind="CheckpointError", rss_mib=50)
    assert "reading the structure file needs 3.0 TiB" in out["msg"], out


def test_structure_file_within_limits_but_beyond_memory_is_a_checkpoint_error(case: Path) -> None:
    n = 2_000_000
    hf.reseal(case / STEP2, {TREE: b"[" + b"[]," * n + b"[]]"})
    out = run_child(case, extra_as=64 * 2**20)  # 64 MiB of address space left
    assert out["checkpoint_error"] and "needs" in out["msg"] and str(case / STEP2 / TREE) in out["msg"], out


def test_sparse_tib_shard_says_how_much_memory_it_needs(case: Path) -> None:
    hf.case_sparse_tib(case / STEP2, 1.0)
    with pytest.raises(CheckpointError, match=r"needs 1\.0 TiB") as ei:
        load(case, 2)
    assert str(case / STEP2 / SHARD) in str(ei.value)
    assert not isinstance(ei.value, CheckpointCorruptError)  # a real size, not damage


@pytest.mark.timing  # a 5 s bound on a CPU-bound parse (5.1 s seen under parallel load)
def test_manifest_over_the_entry_limit_is_refused(case: Path) -> None:
    hf.reseal(case / STEP2, {}, extra_files=[FileEntry(f"f{i:07d}", 0, 0, 0) for i in range(MAX_MANIFEST_FILES + 1)])
    out = run_child(case)
    assert_refused(out, case / STEP2 / MANIFEST, rss_mib=400)
    assert "more than" in out["msg"] or "at most" in out["msg"], out


@pytest.mark.slow  # a 37 MB header of 2**19 tensors parsed in children (~1 min)
def test_header_of_more_tensors_than_the_old_limit_is_bounded_by_its_bytes(case: Path) -> None:
    """Issue 9's header of 1.4M empty tensors took 100 s; 2**19 + 2 of them (over the old
    limit, a valid shard whose tree names all of them) now load in time linear in the
    header's 37 MB; under a 64 MiB headroom the header is refused before it is parsed."""
    names = [f"t{i:07d}" for i in range(OLD_TENSORS + 2)]
    header = {k: {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for k in names}
    hf.reseal(case / STEP2, {SHARD: hf.shard_bytes(header), TREE: hf.tree_for(names[:1])}, nbytes=0)
    del header
    out = run_child(case, extra_as=64 * 2**20)
    assert_refused(out, case / STEP2 / SHARD, kind="CheckpointError", rss_mib=150)
    assert "reading the shard header needs" in out["msg"], out
    hf.reseal(case / STEP2, {TREE: hf.tree_for(names)})
    out = run_child(case)
    assert out["type"] is None, out  # loaded: every one of its tensors
    assert out["time_s"] < 60 and out["rss_growth"] < 2048 * 2**20, out


def test_real_checkpoint_too_large_for_memory_says_how_much_it_needs(tmp_path: Path) -> None:
    root = tmp_path / "big"
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.zeros(64 * 2**20 // 4)}).result(timeout=60)  # 64 MiB
        ck.save(2, {"w": torch.ones(96 * 2**20 // 4)}).result(timeout=60)  # 96 MiB
    out = run_child(root, extra_as=48 * 2**20)
    assert out["type"] == "CheckpointError" and out["checkpoint_error"], out
    assert "needs 96.0 MiB" in out["msg"] and str(root / STEP2 / SHARD) in out["msg"], out
