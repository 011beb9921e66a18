"""``asyncckpt export`` of sharded (DTensor) checkpoints saved by real gloo ranks: full global
tensors bit-equal to what was saved, accepted by ``safetensors.torch.load_model`` and by
``transformers`` ``from_pretrained``; DDP checkpoints (with and without dedupe) per rank; a
corrupt chunk named, nothing published; the export's memory bounded far below the state."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _ranks import free_port, log_tail, run_ranks
from safetensors import safe_open
from safetensors.torch import load_file, load_model

import asyncckpt
from asyncckpt.cli import main
from asyncckpt.format._reshard import Box
from asyncckpt.loading._exportwrite import bands, contiguous_in, linear
from asyncckpt.roots import open_root

HERE = Path(__file__).parent
WORKER = str(HERE / "support" / "_export_worker.py")
sys.path.insert(0, str(HERE / "support"))
from _export_worker import BIG, Net, Pair, big_value, ddp_state  # noqa: E402

STEP = "step_00000001"


def spawn(tmp: Path, scenario: str, world: int) -> tuple[Path, Path]:
    root, out, logs = tmp / "root", tmp / "out", tmp / "logs"
    logs.mkdir()
    port = str(free_port())
    hung = run_ranks(lambda r: [WORKER, scenario, str(r), str(world), port, str(root), str(out)], world, logs, 150.0)
    assert not hung, f"ranks {hung} still running at the deadline"
    for r in range(world):
        f = Path(f"{out}.{r}.json")
        assert f.exists(), f"rank {r} wrote no result:\n{log_tail(logs, r)}"
        res = json.loads(f.read_text())
        assert "crash" not in res, res["crash"]
    return root, out


@pytest.fixture(scope="module")
def on4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root, out = spawn(tmp_path_factory.mktemp("x4"), "layouts", 4)
    return root, torch.load(str(out) + ".ref.pt", weights_only=True)


@pytest.fixture(scope="module")
def on2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root, out = spawn(tmp_path_factory.mktemp("x2"), "two", 2)
    ref = Path(str(out) + ".ref.pt")
    return root, torch.load(ref, weights_only=True) if ref.exists() else {}


def export(capsys: pytest.CaptureFixture[str], root: Path, dest: Path, *extra: str) -> tuple[int, str]:
    code = main(["export", str(root), "--to", str(dest), *extra])
    return code, capsys.readouterr().err


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# ---------------------------------------------------------------------------- the arithmetic
def test_bands_tile_the_output_in_order_within_the_bound() -> None:
    for shape, item, bound in [((7, 5), 4, 40), ((3, 4, 5), 2, 16), ((10,), 8, 24), ((2, 3), 4, 1), ((), 4, 1)]:
        seen: list[int] = []
        for b in bands(shape, item, bound):
            assert b.numel * item <= max(bound, item) and contiguous_in(b, Box.whole(shape))
            start = linear(b.offsets, Box.whole(shape))
            seen.extend(range(start, start + b.numel))
        assert seen == list(range(int(torch.Size(shape).numel()))), shape
    assert list(bands((3, 0), 4, 8)) == []


def test_contiguous_in() -> None:
    box = Box((0, 0, 0), (2, 3, 4))
    assert contiguous_in(Box((1, 1, 0), (1, 2, 4)), box)
    assert contiguous_in(Box((1, 2, 1), (1, 1, 2)), box)
    assert not contiguous_in(Box((0, 0, 0), (1, 2, 2)), box)
    assert not contiguous_in(Box((0, 0, 0), (2, 3, 2)), box)


# ---------------------------------------------------------------------------- 4 ranks, many layouts
@pytest.mark.timeout(300)
def test_sharded_export_is_bit_equal_to_the_full_tensors(
    on4: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, ref = on4
    dest = tmp_path / "all.safetensors"
    code, err = export(capsys, root, dest)
    assert code == 0, err
    got = load_file(str(dest))
    # tied.a and tied.b are one storage: written once under the first name, as save_model keeps it
    assert "tied.b (= tied.a)" in err and "tied.b" not in got
    want = {k: v for k, v in ref.items() if k != "tied.b" and k != "rng"}
    for k, v in want.items():
        assert k in got and equal(got[k], v), k
    assert equal(got["rng"], torch.zeros(3))  # rank 0's per-rank value
    assert set(got) == set(want) | {"rng"}
    with safe_open(str(dest), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    # --rank picks whose per-rank values; the DTensors are the same full tensors
    code, err = export(capsys, root, tmp_path / "r2.safetensors", "--rank", "2")
    got2 = load_file(str(tmp_path / "r2.safetensors"))
    assert code == 0 and equal(got2["rng"], torch.full((3,), 2.0)) and equal(got2["tp.s1"], ref["tp.s1"])


@pytest.mark.timeout(300)
def test_sharded_model_export_loads_with_safetensors_load_model(
    on4: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, ref = on4
    dest = tmp_path / "model.safetensors"
    code, err = export(capsys, root, dest, "--key", "model")
    assert code == 0 and err == "", err
    plain = Pair()
    missing, unexpected = load_model(plain, str(dest))
    assert not missing and not unexpected
    for k, v in plain.state_dict().items():
        assert equal(v, ref[f"model.{k}"]), k
    code, _ = export(capsys, root, tmp_path / "tp2d.safetensors", "--key", "tp2d")
    two_d = Net(8)
    load_model(two_d, str(tmp_path / "tp2d.safetensors"))
    assert all(equal(v, ref[f"tp2d.{k}"]) for k, v in two_d.state_dict().items())


@pytest.mark.timeout(300)
def test_corrupt_chunk_is_named_and_nothing_is_published(
    on4: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    shutil.copytree(on4[0], root)
    shard = root / STEP / "rank00001.safetensors"
    with safe_open(str(shard), "pt") as f:
        names = list(f.keys())
    assert "tp.s1" in names
    # the byte of a DTensor chunk: tp.s1's chunk of rank 1 (find it through the header)
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    begin = 8 + n + header["tp.s1"]["data_offsets"][0]
    raw[begin] ^= 0x01
    shard.write_bytes(bytes(raw))
    dest = tmp_path / "m.safetensors"
    code, err = export(capsys, root, dest, "--key", "tp")
    assert code == 1 and "checksum mismatch in a chunk of 'tp.s1'" in err and "rank00001.safetensors" in err
    assert not dest.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert (root / ".asyncckpt" / "bad").is_dir()  # remembered, as a load would
    with pytest.raises(asyncckpt.CheckpointCorruptError):
        asyncckpt.load(root, 1, per_rank="rank0")
    # the step is known bad now: without --step there is nothing resumable (issue 26), but a
    # key whose bytes are all intact still exports from it by name
    code, err = export(capsys, root, tmp_path / "model.safetensors", "--key", "model")
    assert code == 1 and "passed over: step 1: known bad" in err, err
    code, err = export(capsys, root, tmp_path / "model.safetensors", "--key", "model", "--step", "1")
    assert code == 0, err


def test_plain_checkpoint_corrupt_byte_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    state = {"model": Net(4).state_dict(), "big": torch.arange(100_000.0)}
    with asyncckpt.Checkpointer(root) as ck:
        ck.save(1, state)
    dest = tmp_path / "x.safetensors"
    code, err = export(capsys, root, dest, "--key", "model")
    assert code == 0 and all(equal(load_file(str(dest))[k], v) for k, v in state["model"].items())
    shard = root / STEP / "rank00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x40  # in "big", outside the exported key: the whole shard is verified all the same
    shard.write_bytes(bytes(raw))
    code, err = export(capsys, root, tmp_path / "y.safetensors", "--key", "model")
    assert code == 1 and "checksum mismatch" in err and "rank00000.safetensors" in err
    assert not (tmp_path / "y.safetensors").exists()


# ---------------------------------------------------------------------------- 2 ranks
@pytest.mark.timeout(300)
def test_ddp_export_per_rank_with_and_without_dedupe(
    on2: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = on2[0]
    for name in ("ddp", "ddp_dedupe"):
        for rank in (0, 1):
            dest = tmp_path / f"{name}{rank}.safetensors"
            code, err = export(capsys, root / name, dest, "--rank", str(rank))
            assert code == 0 and "epoch" in err, err
            want = ddp_state(rank)
            got = load_file(str(dest))
            assert set(got) == {f"model.{k}" for k in want["model"]} | {"rng"}
            assert equal(got["rng"], want["rng"])
            assert all(equal(got[f"model.{k}"], v) for k, v in want["model"].items())
    assert json.loads((root / "ddp_dedupe" / STEP / "index.json").read_text())["dedupe"]


@pytest.mark.timeout(300)
def test_fsdp2_gpt2_export_loads_with_transformers_from_pretrained(
    on2: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    root, ref = on2
    out = tmp_path / "gpt2"
    out.mkdir()
    code, err = export(capsys, root / "gpt2", out / "model.safetensors", "--key", "model")
    assert code == 0, err
    config = GPT2Config(**ref["config"])
    config.save_pretrained(out)  # config.json beside model.safetensors: a save_pretrained directory
    model = GPT2LMHeadModel.from_pretrained(out, local_files_only=True).eval()
    torch.manual_seed(3)  # the worker's model, rebuilt here: the weights must come back bit-exact
    original = GPT2LMHeadModel(config).state_dict()
    loaded = model.state_dict()
    assert set(loaded) == set(original) and all(torch.equal(loaded[k], v) for k, v in original.items())
    with torch.no_grad():
        logits = model(ref["ids"]).logits
    # the forward's float sums may take another order in this process than in the worker (the
    # BLAS threads it gets): the logits match closely, the weights above exactly
    torch.testing.assert_close(logits, ref["logits"], rtol=1e-5, atol=1e-6)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # still tied
    # FSDP2's tied lm_head/wte are two DTensors to save(), over one local storage: stored
    # once (the index aliases the second name) and exported once, as save_model does, so
    # load_model's strict check passes
    index = json.loads(next((root / "gpt2").glob("step_*/index.json")).read_text())
    assert index["aliases"] == {"model.lm_head.weight": "model.transformer.wte.weight"}
    assert "model.lm_head.weight" not in index["tensors"]
    plain = GPT2LMHeadModel(config)
    load_model(plain, str(out / "model.safetensors"), strict=True)
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in loaded.items())
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(ref["ids"]).logits, ref["logits"], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_export_streams_a_state_larger_than_its_memory_bound(on2: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """200 MiB exported (the largest tensor 128 MiB, Shard(1) over two files) with a peak
    extra RSS far below one tensor: the export never holds a tensor, only bounded pieces."""
    root = on2[0] / "big"
    dest = tmp_path / "big.safetensors"
    env_path = str(HERE.parent)
    r = subprocess.run(
        [sys.executable, str(HERE / "support" / "_export_rss.py"), str(root), "--to", str(dest)],
        capture_output=True, text=True, timeout=200, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["code"] == 0, r.stderr
    extra_mib = (res["peak_kib"] - res["base_kib"]) / 1024
    state_mib = (dest.stat().st_size) / 2**20
    assert state_mib > 190
    assert extra_mib < 48, f"peak extra RSS {extra_mib:.1f} MiB for a {state_mib:.0f} MiB export"
    print(f"export of {state_mib:.0f} MiB: peak extra RSS {extra_mib:.1f} MiB")
    got = load_file(str(dest))
    for name, (shape, _) in BIG.items():
        assert equal(got[name], big_value(name, slice(None), slice(None), shape)), name
    assert equal(got["plain"], torch.zeros(1 << 20))


@pytest.mark.timeout(300)
def test_corrupt_plain_value_of_an_indexed_step_and_a_truncated_shard(
    on4: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Plain tensors of an indexed step carry their own CRC (in the index): a flipped byte in
    rank 0's value is named, while rank 1's values (intact) still export."""
    root = tmp_path / "root"
    shutil.copytree(on4[0], root)
    shard = root / STEP / "rank00000.safetensors"
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    raw[8 + n + json.loads(raw[8 : 8 + n])["rng"]["data_offsets"][0]] ^= 0x01
    shard.write_bytes(bytes(raw))
    code, err = export(capsys, root, tmp_path / "r0.safetensors")
    assert code == 1 and "checksum mismatch in 'rng'" in err and "rank00000.safetensors" in err
    assert not (tmp_path / "r0.safetensors").exists()
    code, err = export(capsys, root, tmp_path / "r1.safetensors", "--rank", "1", "--step", "1")  # known bad now
    assert code == 0 and equal(load_file(str(tmp_path / "r1.safetensors"))["rng"], torch.ones(3)), err
    # a shard shorter than the manifest says: the step is not complete, nothing is written
    other = root / STEP / "rank00003.safetensors"
    other.write_bytes(other.read_bytes()[:-1])
    code, err = export(capsys, root, tmp_path / "t.safetensors", "--step", "1", "--rank", "1")
    assert code == 1 and "rank00003.safetensors" in err and not (tmp_path / "t.safetensors").exists(), err


def test_export_survives_the_retirement_of_its_step(tmp_path: Path) -> None:
    """Every file is opened before anything is written: retention removing the step while
    the export runs (a job saving with keep_last) does not break it."""
    from asyncckpt.loading._export import open_export

    root, dest = tmp_path / "root", tmp_path / "o.safetensors"
    with asyncckpt.Checkpointer(root, keep_last=1) as ck:
        ck.save(1, {"w": torch.arange(1000.0), "m": Net(4).state_dict()})
        ck.flush()
        with open_export(open_root(root), 1, 0) as ex:
            ck.save(2, {"w": torch.zeros(1000), "m": Net(4).state_dict()})
            ck.flush()
            assert not (root / STEP).exists()
            ex.write(str(dest), ex.named)
    assert equal(load_file(str(dest))["w"], torch.arange(1000.0))


@pytest.mark.timeout(300)
def test_sharded_export_survives_the_removal_of_its_step(
    on4: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    """The chunks lie in every rank's file: all of them are open before the removal (as
    retention does it: rename, then remove the tree)."""
    from asyncckpt.loading._export import open_export

    root, dest = tmp_path / "root", tmp_path / "o.safetensors"
    shutil.copytree(on4[0], root)
    with open_export(open_root(root), 1, 0) as ex:
        (root / STEP).rename(root / "step_00000001.deleting-x")
        shutil.rmtree(root / "step_00000001.deleting-x")
        ex.write(str(dest), [(n, s) for n, s in ex.named if n.startswith("tp.")])
    got = load_file(str(dest))
    assert all(equal(got[k], v) for k, v in on4[1].items() if k.startswith("tp.")) and len(got) == 5


@pytest.mark.timeout(300)
def test_sharded_export_to_pt_gives_full_tensors(
    on4: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, ref = on4
    code, err = export(capsys, root, tmp_path / "tp.pt", "--key", "tp")
    assert code == 0, err
    got = torch.load(tmp_path / "tp.pt", weights_only=True)
    assert set(got) == {"s1", "s0", "rep", "bf16", "scalar"}
    assert all(equal(v, ref[f"tp.{k}"]) for k, v in got.items())
