"""DTensor state (FSDP2 uneven and empty shards, TP Shard(0)/Shard(1)/Replicate, FSDP x TP on a
2 x 2 mesh) saved on real gloo ranks and loaded on another world size, into DTensors of another
layout and into plain tensors on one process: bit-equal to the full tensors that were saved."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _ranks import free_port, results, run_ranks

import asyncckpt
from asyncckpt import CheckpointCorruptError, CheckpointError
from asyncckpt.loading._verify import verify_step

WORKER = str(Path(__file__).parent / "support" / "_global_worker.py")
sys.path.insert(0, str(Path(__file__).parent / "support"))
from _global_worker import Net, same  # noqa: E402

STEP = "step_00000001"


def verify(root: Path, step: int) -> list[Any]:
    """What ``asyncckpt verify`` finds wrong with a step (nothing, for a good one)."""
    return verify_step(str(root), step, record=False)


def spawn(
    tmp: Path,
    scenario: str,
    world: int,
    root: Path,
    out: Path,
    saved: int,
    dead: tuple[int, ...] = (),
    warm: bool = False,
) -> dict[int, dict[str, Any]]:
    logs = tmp / f"logs-{scenario}-{world}"
    logs.mkdir()
    port = free_port()
    argv = [scenario, "", str(world), str(port), str(root), str(out), str(saved)]

    def args(r: int) -> list[str]:
        return [WORKER, argv[0], str(r), *argv[2:]]

    hung = run_ranks(args, world, logs, 120.0, warm=warm)
    assert not hung, f"ranks {hung} still running at the deadline"
    return results(out, world, logs, dead)


@pytest.fixture(scope="module")
def saved_on_4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[int, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("s4")
    root, out = tmp / "ck", tmp / "out"
    return root, out, spawn(tmp, "save", 4, root, out, 4, warm=True)


@pytest.mark.timeout(200)
def test_save_on_4_load_on_2_reshards_bit_equal(saved_on_4: Any, tmp_path: Path) -> None:
    root, out, saved = saved_on_4
    step_dir = root / STEP
    names = sorted(p.name for p in step_dir.iterdir())
    ranks = [f"rank{r:05d}.{e}" for r in range(4) for e in ("json", "safetensors")]
    assert names == ["index.json", "manifest.json", *ranks]
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["format"] == "asyncckpt/2" and "index.json" in {f["name"] for f in manifest["files"]}
    index = json.loads((step_dir / "index.json").read_text())
    # the Replicate()d vector is one chunk, written by one of its replicas
    assert len(index["tensors"]["tp.rep"]["chunks"]) == 1
    # FSDP2 with 3 rows on 4 ranks: rank 3's shard is empty and written by nobody
    assert len(index["tensors"]["model.b.up.weight"]["chunks"]) == 3
    assert index["tensors"]["tp2d.up.weight"]["placements"] == ["SS(0,2)", "S(0)"]
    assert verify(root, 1) == []
    res = spawn(tmp_path, "load", 2, root, out, 4, warm=True)
    for r in res.values():
        # per-rank values across a change of world size are refused by name, then rank 0's taken
        assert r["refused"] is not None and "'rng'" in r["refused"] and "per_rank='rank0'" in r["refused"]
        assert r["step"] == 7
    assert res[0]["diff"] == [] and res[0]["diff_dcp"] == []  # bit-equal to what was saved and to DCP's reshard
    assert res[0]["local_shapes"] == {"s1": [5, 4], "s0": [4, 5], "rep": [7]}
    assert res[1]["local_shapes"] == {"s1": [5, 3], "s0": [3, 5], "rep": [7]}
    print(f"\nbytes on disk: asyncckpt {saved[0]['bytes']}, dcp.save {saved[0]['dcp_bytes']}")


def test_saved_on_4_loads_on_one_process_as_full_tensors(saved_on_4: Any) -> None:
    root, out, _ = saved_on_4
    ref = torch.load(f"{out}.ref.pt")
    with pytest.raises(CheckpointError, match="'rng'"):
        asyncckpt.load(root)
    state = asyncckpt.load(root, per_rank="rank0")
    assert same({k: state[k] for k in ref}, ref) == []
    assert state["rng"].tolist() == [0, 0, 0]
    assert asyncckpt.load(root, rank=3)["rng"].tolist() == [3, 3, 3]
    # into plain tensors: a plain module gets the full weights
    torch.manual_seed(0)
    plain = Net(8)
    asyncckpt.load(root, into={"tp2d": plain}, per_rank="rank0")
    assert same(dict(plain.state_dict()), ref["tp2d"]) == []
    # a Checkpointer on one process reads it the same way
    with asyncckpt.Checkpointer(root) as ck:
        assert same(ck.load(per_rank="rank0")["tp"], ref["tp"]) == []


def test_corrupt_chunk_is_named(saved_on_4: Any, tmp_path: Path) -> None:
    root, _, _ = saved_on_4
    copy = tmp_path / "ck"
    shutil.copytree(root, copy)
    index = json.loads((copy / STEP / "index.json").read_text())
    _, _, file, begin, n, _ = index["tensors"]["model.a.up.weight"]["chunks"][1]
    with open(copy / STEP / file, "r+b") as f:
        f.seek(begin + n // 2)
        b = f.read(1)
        f.seek(begin + n // 2)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(CheckpointCorruptError) as e:
        asyncckpt.load(copy, 1, per_rank="rank0")
    assert e.value.path is not None and e.value.path.endswith(file)
    # a tampered index is named too
    raw = (copy / STEP / "index.json").read_bytes()
    (copy / STEP / "index.json").write_bytes(raw.replace(b'"chunks"', b'"chunkz"', 1))
    with pytest.raises(CheckpointCorruptError, match=r"index\.json"):
        asyncckpt.load(copy, 1, per_rank="rank0", verify=False)


@pytest.mark.slow  # the other direction of test_save_on_4_load_on_2_reshards_bit_equal
@pytest.mark.timeout(200)
def test_save_on_2_load_on_4(tmp_path: Path) -> None:
    root, out = tmp_path / "ck", tmp_path / "out"
    spawn(tmp_path, "save", 2, root, out, 2)  # with dedupe (the default)
    index = json.loads((root / STEP / "index.json").read_text())
    # the FSDP buffers and optimizer steps are equal on both ranks, but a few bytes next to each
    # rank's shard: dropping them would copy the whole shard, so each rank keeps its own copy
    assert index["dedupe"]["copies_not_written"] == 0
    assert index["plain"]["0"]["model.a.buf"][2] == "rank00000.safetensors"
    assert index["plain"]["1"]["model.a.buf"][2] == "rank00001.safetensors"
    assert index["plain"]["0"]["rng"][2] != index["plain"]["1"]["rng"][2]  # one per rank
    assert verify(root, 1) == []
    res = spawn(tmp_path, "load", 4, root, out, 2)
    assert res[0]["diff"] == [] and res[0]["diff_dcp"] == []
    assert [res[r]["local_shapes"]["s1"] for r in range(4)] == [[5, 2], [5, 2], [5, 2], [5, 1]]
    for r in res.values():
        assert "'rng'" in r["refused"]


def test_state_without_dtensors_keeps_the_old_format(tmp_path: Path) -> None:
    with asyncckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": torch.arange(4.0), "n": 3}).result(timeout=60)
    manifest = json.loads((tmp_path / STEP / "manifest.json").read_text())
    assert manifest["format"] == "asyncckpt/1"
    assert not (tmp_path / STEP / "index.json").exists()
    assert asyncckpt.load(tmp_path)["n"] == 3
    with pytest.raises(ValueError, match="per_rank"):
        asyncckpt.load(tmp_path, per_rank="rank1")  # type: ignore[arg-type]


@pytest.mark.slow  # > 15 s on a quiet 2-core machine: make test-slow (and CI) runs it
@pytest.mark.timeout(200)
def test_ddp_dedupe_writes_the_replicated_state_once(tmp_path: Path) -> None:
    root, out = tmp_path / "ck", tmp_path / "out"
    res = spawn(tmp_path, "ddp", 4, root, out, 4)
    for r in res.values():
        assert r["model_equal"] and r["optim_equal"] and r["rng_equal"], r
        # a rank refusing its state fails the dedupe round at once for everyone, naming it
        assert r["bad"] == ("TypeError" if r["rank"] == 1 else [1]), r
        assert r["bad_s"] < 10 and r["after_bad"] == [2], r
    r0 = res[0]
    # model and optimizer once in total, the per-rank RNG states once per rank
    assert r0["dedup_nbytes"] == r0["replicated_bytes"] + 4 * r0["rng_bytes"]
    assert r0["plain_nbytes"] == 4 * (r0["replicated_bytes"] + r0["rng_bytes"])
    dd, plain = Path(f"{root}-dedup"), Path(f"{root}-plain")
    assert json.loads((plain / "step_00000002" / "manifest.json").read_text())["format"] == "asyncckpt/1"
    index = json.loads((dd / "step_00000002" / "index.json").read_text())
    assert verify(dd, 2) == [] and verify(plain, 2) == []
    writers = {e[2] for e in index["plain"]["0"].values()}
    assert len(writers) == 4, writers  # spread over every rank's file
    # per-rank values stay per rank: every saved rank's RNG state, and they differ
    rngs = [asyncckpt.load(dd, 2, rank=r)["rng"] for r in range(4)]
    assert len({bytes(t.numpy()) for t in rngs}) == 4
    with pytest.raises(CheckpointError, match="'rng'") as e:
        asyncckpt.load(dd, 2)
    assert "model" not in str(e.value).split("per-rank state")[1]
    got, want = asyncckpt.load(dd, 2, per_rank="rank0"), asyncckpt.load(plain, 2)
    assert same(got["model"], want["model"]) == [] and same(got["optim"], want["optim"]) == []
    # on disk: one replica of the model and optimizer plus every rank's RNG state, and per file
    # no more than its page-aligned header and the tree
    on_disk = sum(p.stat().st_size for p in (dd / "step_00000002").glob("rank*.safetensors"))
    data = r0["replicated_bytes"] + 4 * r0["rng_bytes"]
    assert data <= on_disk <= data + 4 * 16384, (on_disk, data)
    print(f"\nDDP on 4 ranks: {r0['dedup_nbytes']} B written with dedupe, {r0['plain_nbytes']} B without")

    # resume on 2 ranks: the model and optimizer (identical on every saved rank) load exactly; the
    # RNG states, which differ, are refused by name until a policy picks rank 0's
    res2 = spawn(tmp_path, "ddp_load", 2, root, out, 4)
    for r in res2.values():
        assert r["refused"] is not None and "'rng'" in r["refused"] and "model" not in r["refused"], r
        assert r["rng_untouched"] and r["model_equal"] and r["optim_equal"] and r["rng0"], r


@pytest.mark.slow  # > 15 s in make test's parallel phase: make test-slow (and CI) runs it
@pytest.mark.timeout(200)
def test_hsdp_replica_writes_are_spread_and_load_bit_equal(tmp_path: Path) -> None:
    root, out = tmp_path / "ck", tmp_path / "out"
    res = spawn(tmp_path, "hsdp", 4, root, out, 4, warm=True)
    assert res[0]["diff"] == []  # loaded into a fresh HSDP model: bit-equal to what was saved

    def data_bytes(name: str) -> list[int]:
        """The DTensor bytes each rank's file holds, from the index."""
        index = json.loads((Path(f"{root}-{name}") / STEP / "index.json").read_text())
        per = [0] * 4
        for e in index["tensors"].values():
            for c in e["chunks"]:
                per[int(c[2][4:9])] += c[4]
        return per

    spread, lowest = data_bytes("spread"), data_bytes("lowest")
    assert sum(spread) == sum(lowest)
    # the lowest replica (replicate coordinate 0: ranks 0 and 1) wrote every box before
    assert lowest[2] == lowest[3] == 0 and lowest[0] > 0 and lowest[1] > 0, lowest
    # spread: every rank writes, and the bytes per rank are within one box of each other
    assert max(spread) - min(spread) <= res[0]["largest_box"], (spread, res[0]["largest_box"])
    assert min(spread) > 0
    for name in ("spread", "lowest"):
        assert verify(Path(f"{root}-{name}"), 1) == []
    ref = torch.load(f"{out}.hsdp_ref.pt")
    whole = asyncckpt.load(Path(f"{root}-spread"))  # one process: full global tensors
    assert same({"model": whole["model"], "optim": whole["optim"]}, ref) == []
    print(f"\nHSDP 2x2 data bytes per rank: spread {spread}, lowest replica {lowest}")


def test_tied_weights_are_stored_once_and_come_back_tied(tmp_path: Path) -> None:
    from safetensors import safe_open

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = torch.nn.Embedding(50, 8)
            self.lm_head = torch.nn.Linear(8, 50, bias=False)
            self.lm_head.weight = self.wte.weight  # GPT-2's tying

    torch.manual_seed(0)
    model = Tied()
    base = torch.arange(12.0)
    state = {"model": model, "views": [base, base[2:], base.view(3, 4)], "again": base}
    with asyncckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, state).result(timeout=60)
    with safe_open(str(tmp_path / STEP / "rank00000.safetensors"), "pt") as f:
        names = sorted(f.keys())
    # one copy of the tied weight and of `base` (the slice and the reshaped view are other tensors)
    assert names == ["model.wte.weight", "views.0", "views.1", "views.2"]
    assert json.loads((tmp_path / STEP / "manifest.json").read_text())["format"] == "asyncckpt/2"
    loaded = asyncckpt.load(tmp_path)
    assert loaded["model"]["lm_head.weight"] is loaded["model"]["wte.weight"]
    assert loaded["again"] is loaded["views"][0] and torch.equal(loaded["views"][1], base[2:])
    torch.manual_seed(1)
    fresh = Tied()
    asyncckpt.load(tmp_path, into={"model": fresh})
    assert torch.equal(fresh.lm_head.weight, model.wte.weight) and fresh.lm_head.weight is fresh.wte.weight
    assert verify(tmp_path, 1) == []


@pytest.mark.slow  # > 15 s on a quiet 2-core machine: make test-slow (and CI) runs it
@pytest.mark.timeout(200)
def test_rank_killed_during_a_sharded_save_then_resume_on_2(tmp_path: Path) -> None:
    root, out = tmp_path / "ck", tmp_path / "out"
    res = spawn(tmp_path, "savekill", 4, root, out, 4, dead=(3,))
    for r in range(3):
        assert res[r]["second"] == "SaveTimeoutError", res[r]
    assert asyncckpt.find_latest(root).step == 1  # type: ignore[union-attr]
    # the survivors' attempt is not a checkpoint; a 2-rank job resumes from step 1, resharded
    res = spawn(tmp_path, "load", 2, root, out, 4)
    assert res[0]["diff"] == [] and res[0]["step"] == 7


# ---------------------------------------------------------------------- block CRCs, partial reads
@pytest.mark.slow  # > 15 s in make test's parallel phase: make test-slow (and CI) runs it
@pytest.mark.timeout(200)
def test_corrupt_chunk_read_by_one_rank_is_named_on_every_rank_and_the_fallback_restores_all(
    saved_on_4: Any, tmp_path: Path
) -> None:
    root, out, _ = saved_on_4
    copy = tmp_path / "ck"
    shutil.copytree(root, copy)
    _copy_step(copy, 1, 2)
    step2 = copy / "step_00000002"
    index = json.loads((step2 / "index.json").read_text())
    # tp.s0 (7 x 5, Shard(0)) on 2 ranks: rank 0 takes rows 0-3, rank 1 rows 4-6; only rank 1 reads this
    (chunk,) = [c for c in index["tensors"]["tp.s0"]["chunks"] if c[0] == [4, 0]]
    _, _, file, begin, _, _ = chunk
    with open(step2 / file, "r+b") as f:
        f.seek(begin + 3)
        b = f.read(1)
        f.seek(begin + 3)
        f.write(bytes([b[0] ^ 0x10]))
    res = spawn(tmp_path, "loadcorrupt", 2, copy, out, 4, warm=True)
    for r in (0, 1):
        on = res[r]["on"]
        assert on["error"] == "CheckpointCorruptError" and on["path"].endswith(file), on
        assert on["unchanged"], f"rank {r} wrote its targets for a step that failed verification (verify_first)"
    assert "'tp.s0'" in res[1]["on"]["msg"]
    # teeth: without the agreement rank 0 (whose bytes verified) writes
    assert not res[0]["agree_off"]["unchanged"] and res[1]["agree_off"]["unchanged"]
    # the default, one pass: every rank names the corrupt file, and the targets were written
    for r in (0, 1):
        one = res[r]["verify_off"]
        assert one["error"] == "CheckpointCorruptError" and one["path"].endswith(file), one
        assert "partly overwritten" in one["msg"], one  # so a caller does not train on from them
        assert "partly overwritten" not in res[r]["on"]["msg"]
    assert not res[1]["verify_off"]["unchanged"]
    # load(step=None) over those dirty targets: both ranks reject step 2 and load step 1, bit-equal
    assert res[0]["fallback_diff"] == []


def _copy_step(root: Path, src: int, dst: int) -> None:
    """Step ``dst`` as a copy of step ``src`` (its manifest resealed with the new step)."""
    from asyncckpt.format import _manifest

    d = root / f"step_{dst:08d}"
    shutil.copytree(root / f"step_{src:08d}", d)
    m = json.loads((d / "manifest.json").read_text())
    files = [_manifest.FileEntry(f["name"], f["size"], f["crc32c"], f["rank"]) for f in m["files"]]
    body = _manifest.encode(
        dst, m["attempt"], m["world_size"], m["nbytes"], m["created"], files, m["extra"], m.get("ranks"),
        format=m["format"],
    )  # fmt: skip
    (d / "manifest.json").write_bytes(body)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Saved on 4 ranks with 4 KiB blocks: w1 (32 x 16384 F32, Shard(1): 16 KiB rows per
    chunk) and w0 (64 x 8192 F32, Shard(0): 512 KiB chunks)."""
    tmp = tmp_path_factory.mktemp("wide")
    root, out = tmp / "ck", tmp / "out"
    spawn(tmp, "savewide", 4, root, out, 4, warm=True)
    return root, torch.load(f"{out}.ref.pt")


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _read_box(root: Path, name: str, box: Any, verify: bool = True) -> tuple[torch.Tensor, int, int]:
    """The box of ``name`` read as a resharded load reads it (the checked pass, into a fresh
    tensor); with the bytes the reads asked the kernel for and the bytes of the chunks it touches."""
    from asyncckpt.format import _index
    from asyncckpt.format._reshard import plan_reads
    from asyncckpt.format._safetensors import ST_TO_DTYPE
    from asyncckpt.loading import _load_global
    from asyncckpt.loading._stepfiles import ReaderFiles
    from asyncckpt.roots import open_root

    files = ReaderFiles(open_root(str(root)).open_reader(1))
    manifest = files.manifest
    try:
        raw = (root / STEP / "index.json").read_bytes()
        meta = _index.parse(raw, 4, {f.name: f.size for f in manifest.files})["tensors"][name]
        out = torch.empty(box.sizes, dtype=ST_TO_DTYPE[meta["dtype"]])
        plan = _load_global._Plan()
        plan.add(files, name, meta, out, box, verify, target=False)
        chunks = sum(cr.chunk.nbytes(4) for cr in plan_reads(meta["chunks"], box, 4))
        before = _rchar()
        plan.run_first()
        return out, _rchar() - before, chunks
    finally:
        files.close()


def _rewrite_index(root: Path, edit: Any) -> None:
    """Apply ``edit`` to the step's index document and reseal the manifest over the result
    (so only the index's content is wrong, not its listed size or CRC)."""
    from asyncckpt.format import _manifest
    from asyncckpt.format._checksum import crc32c

    step_dir = root / STEP
    doc = json.loads((step_dir / "index.json").read_text())
    edit(doc)
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    (step_dir / "index.json").write_bytes(raw)
    m = json.loads((step_dir / "manifest.json").read_text())
    files = [
        _manifest.FileEntry(f["name"], len(raw) if f["name"] == "index.json" else f["size"],
                            crc32c(raw) if f["name"] == "index.json" else f["crc32c"], f["rank"])
        for f in m["files"]
    ]  # fmt: skip
    body = _manifest.encode(
        m["step"], m["attempt"], m["world_size"], m["nbytes"], m["created"], files, m["extra"], m.get("ranks"),
        format=m["format"],
    )  # fmt: skip
    (step_dir / "manifest.json").write_bytes(body)


def _without_blocks(doc: dict[str, Any]) -> None:
    """An index as written before block CRCs: no ``block``, no ``blocks``."""
    del doc["block"]
    for e in doc["tensors"].values():
        del e["blocks"]


def _old_format(root: Path) -> None:
    _rewrite_index(root, _without_blocks)


@pytest.mark.parametrize(
    ("name", "offsets", "sizes", "at_most"),
    [
        ("w1", (0, 2048), (32, 4096), 1.0),  # Shard(1): half of two chunks, block-aligned rows
        ("w1", (0, 2000), (32, 4100), 1.3),  # not aligned: one extra block at each end of each row
        ("w1", (0, 0), (32, 8192), 1.0),  # a 4 -> 2 shard: whole chunks
        ("w1", (5, 7000), (20, 9000), 1.3),  # an uneven 2-D box across three chunks
        ("w0", (8, 0), (16, 8192), 1.0),  # Shard(0) 2 -> 4: half of two chunks, contiguous
    ],
)
def test_partial_reads_read_only_the_covering_blocks(
    wide: Any, name: str, offsets: tuple[int, int], sizes: tuple[int, int], at_most: float
) -> None:
    from asyncckpt.format._reshard import Box

    root, ref = wide
    box = Box(offsets, sizes)
    got, read, chunks = _read_box(root, name, box)
    want = ref[name][tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
    assert torch.equal(got, want)
    needed = want.numel() * 4
    slack = 4096  # rchar counts every read of the process (the I/O threads' start reads ~128 B)
    assert needed <= read <= at_most * needed + slack, (read, needed)
    if at_most == 1.0 and sizes != (32, 8192):
        assert chunks == 2 * needed  # the whole-chunk reads this replaces read twice the bytes
    got, unverified, _ = _read_box(root, name, box, verify=False)
    assert torch.equal(got, want)
    assert needed <= unverified <= needed + slack  # without verification: only the bytes needed


def test_corrupt_block_is_named_and_blocks_not_needed_are_not_read(wide: Any, tmp_path: Path) -> None:
    from asyncckpt.format._reshard import Box

    root, ref = wide
    copy = tmp_path / "ck"
    shutil.copytree(root, copy)
    index = json.loads((copy / STEP / "index.json").read_text())
    assert index["block"] == 4096
    _, _, file, begin, _, _ = index["tensors"]["w1"]["chunks"][0]
    with open(copy / STEP / file, "r+b") as f:  # row 0, column 100 of chunk 0: in its block 0
        f.seek(begin + 400)
        b = f.read(1)
        f.seek(begin + 400)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(CheckpointCorruptError, match=r"block 0 of a chunk of 'w1'") as e:
        _read_box(copy, "w1", Box((0, 0), (32, 8192)))
    assert e.value.path is not None and e.value.path.endswith(file)
    # a box that does not need that block reads the rest of the chunk, verified, and loads
    got, _, _ = _read_box(copy, "w1", Box((0, 2048), (32, 4096)))
    assert torch.equal(got, ref["w1"][:, 2048:6144])
    with pytest.raises(CheckpointCorruptError) as e:
        asyncckpt.load(copy, 1)  # whole tensors: every block
    assert e.value.path is not None and e.value.path.endswith(file)
    # an index without block CRCs checks the whole chunk, so the same box now fails
    _old_format(copy)
    assert verify(copy, 1) != []  # the data file's own CRC (manifest) still catches it
    with pytest.raises(CheckpointCorruptError, match=r"checksum mismatch in a chunk of 'w1'"):
        _read_box(copy, "w1", Box((0, 2048), (32, 4096)))


def test_index_without_block_crcs_still_loads(wide: Any, tmp_path: Path) -> None:
    from asyncckpt.format._reshard import Box

    root, ref = wide
    copy = tmp_path / "ck"
    shutil.copytree(root, copy)
    _old_format(copy)
    assert verify(copy, 1) == []
    state = asyncckpt.load(copy, 1)
    assert torch.equal(state["w1"], ref["w1"]) and torch.equal(state["w0"], ref["w0"]) and state["step"] == 3
    # a partial read falls back to whole chunks, verified
    got, read, chunks = _read_box(copy, "w1", Box((0, 2048), (32, 4096)))
    assert torch.equal(got, ref["w1"][:, 2048:6144]) and chunks <= read <= chunks + 4096


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda d: d.update(block=0), "bad block size"),
        (lambda d: d.update(block=-4096), "bad block size"),
        (lambda d: d.update(block=True), "bad block size"),
        (lambda d: d.update(block="4096"), "bad block size"),
        (lambda d: d.update(block=1 << 40), "bad block size"),
        (lambda d: d["tensors"]["w1"].update(blocks=None), "block CRCs of 'w1' are malformed"),
        (lambda d: d["tensors"]["w1"]["blocks"].pop(), "block CRCs of 'w1' are malformed"),
        (lambda d: d["tensors"]["w1"]["blocks"][0].pop(), "block CRCs of 'w1' are malformed"),
        (lambda d: d["tensors"]["w1"]["blocks"][0].append(1), "block CRCs of 'w1' are malformed"),
        (lambda d: d["tensors"]["w1"]["blocks"][1].__setitem__(0, 2**32), "block CRCs of 'w1' are malformed"),
        (lambda d: d["tensors"]["w1"]["blocks"][1].__setitem__(0, -1), "block CRCs of 'w1' are malformed"),
        (lambda d: d["tensors"]["w1"]["blocks"][1].__setitem__(0, 1.5), "block CRCs of 'w1' are malformed"),
        (lambda d: d["tensors"]["w1"]["blocks"].__setitem__(0, {"0": 1}), "block CRCs of 'w1' are malformed"),
        (lambda d: d.update(block=8192), "block CRCs of 'w0' are malformed"),  # lengths no longer match
        (lambda d: d.pop("block"), "block CRCs of 'w.' without a block size"),
    ],
)
def test_hostile_block_crcs_are_named(wide: Any, tmp_path: Path, edit: Any, why: str) -> None:
    root, _ = wide
    copy = tmp_path / "ck"
    shutil.copytree(root, copy)
    _rewrite_index(copy, edit)
    with pytest.raises(CheckpointCorruptError, match=why) as e:
        asyncckpt.load(copy, 1)
    assert e.value.path is not None and e.value.path.endswith("index.json")
