"""DCP is the oracle: drawn meshes, placements, shapes and target layouts, saved by asyncckpt
and by ``dcp.save`` on real gloo ranks, loaded by both into the drawn target layout, must be
bit-equal to each other and to torch's own sharding of the global tensor.

One world of 4 ranks serves every drawn case (``_oracle_worker.py``, one JSON line per case),
so hypothesis can draw, and shrink, many cases in the time one spawn would take. A case:
1-3 tensors of 0-3 dims (sizes with primes, ones and zeros; float32, bfloat16, float16,
int64), each on a drawn source layout and a drawn target layout. A layout: a 1-D to 3-D mesh
of every rank, or a sub-mesh of it (its other mesh dims then hold twins of every box: the
FSDP-over-``mesh["dp"]`` case of issue 28), and per mesh dim ``Replicate``, ``Shard(d)`` or,
where two mesh dims shard one tensor dim, FSDP2 + TP's ``_StridedShard`` on the first.
Beyond the loads, every save must write each box of each global tensor exactly once (no
byte twice: at most DCP's data), pass ``verify``, and load whole in one process.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _oracle_worker import global_tensor
from _ranks import free_port
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

import asyncckpt
from asyncckpt import reading
from asyncckpt.loading._verify import verify_step

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

WORKER = str(Path(__file__).parent / "support" / "_oracle_worker.py")
#: per world size, every mesh of it the cases draw from (sub-meshes are drawn from their dims)
MESHES = {
    4: [(4,), (2, 2), (1, 4), (4, 1), (2, 1, 2), (1, 2, 2), (2, 2, 1)],
    8: [(8,), (2, 4), (4, 2), (2, 2, 2), (1, 2, 4), (2, 1, 4), (4, 2, 1)],
}
SIZES = [0, 1, 2, 3, 4, 5, 7, 8, 11, 13, 16]
CASE_S = 60.0


class Ranks:
    """The ranks of one world, fed cases over their stdin, answering on their stdout."""

    def __init__(self, tmp: Path, world: int) -> None:
        self.world = world
        self.root = tmp / "ck"
        self.logs = [open(tmp / f"rank{r}.log", "wb") for r in range(world)]
        port = free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.procs = [
            subprocess.Popen(
                [sys.executable, WORKER, str(r), str(world), str(port), str(self.root)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.logs[r],
                env=env,
            )
            for r in range(world)
        ]
        self.n = 0
        self.dead: str | None = None  # why the ranks can serve no more cases
        self.answers(120.0)  # every rank joined and built its Checkpointer

    def answers(self, timeout: float) -> list[dict[str, Any]]:
        """One JSON line from every rank, within ``timeout`` seconds."""
        sel = selectors.DefaultSelector()
        got: dict[int, dict[str, Any]] = {}
        for r, p in enumerate(self.procs):
            assert p.stdout is not None
            sel.register(p.stdout, selectors.EVENT_READ, r)
        end = time.monotonic() + timeout
        try:
            while len(got) < self.world:
                left = end - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.world)) - set(got))
                    raise AssertionError(f"ranks {missing} did not answer in {timeout}s")
                for key, _ in sel.select(left):
                    r = key.data
                    line = key.fileobj.readline()  # type: ignore[union-attr]
                    if not line:
                        raise AssertionError(f"rank {r} died:\n{self.tail(r)}")
                    got[r] = json.loads(line)
                    sel.unregister(key.fileobj)
        finally:
            sel.close()
        return [got[r] for r in range(self.world)]

    def tail(self, r: int) -> str:
        self.logs[r].flush()
        return Path(self.logs[r].name).read_text(errors="replace")[-3000:]

    def run(self, case: dict[str, Any]) -> list[dict[str, Any]]:
        if self.dead is not None:
            raise AssertionError(f"the ranks stopped at an earlier case: {self.dead}")
        try:
            return self._run(case)
        except AssertionError as e:
            self.dead = str(e)[:3000]
            raise

    def _run(self, case: dict[str, Any]) -> list[dict[str, Any]]:
        self.n += 1
        case = dict(case, n=self.n)
        line = (json.dumps(case) + "\n").encode()
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(line)
            p.stdin.flush()
        res = self.answers(CASE_S)
        for r in res:
            assert "crash" not in r, f"rank {r['rank']} on {case}:\n{r['crash']}"
        return res

    def close(self) -> None:
        for p in self.procs:
            try:
                assert p.stdin is not None
                p.stdin.write(b'{"quit": true}\n')
                p.stdin.close()
            except (BrokenPipeError, OSError):
                pass
        end = time.monotonic() + 30
        for p in self.procs:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for p in self.procs:
            if p.stdout is not None:
                p.stdout.close()
        for f in self.logs:
            f.close()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    world = Ranks(tmp_path_factory.mktemp("oracle"), 4)
    try:
        yield world
    finally:
        world.close()


@st.composite
def layouts(draw: Any, ndim: int, world: int) -> dict[str, Any]:
    """A mesh (or sub-mesh) and a placement per mesh dim for a tensor of ``ndim`` dims."""
    shape = draw(st.sampled_from(MESHES[world]))
    subsets = [list(c) for k in range(1, len(shape) + 1) for c in itertools.combinations(range(len(shape)), k)]
    dims = draw(st.sampled_from(subsets))
    choices: list[list[Any]] = [["R"]] + [["S", d] for d in range(ndim)]
    placements = [draw(st.sampled_from(choices)) for _ in dims]
    if ndim and len(dims) > 1 and draw(st.booleans()):
        # FSDP over the first mesh dim after TP over a later one, on the same tensor dim
        d, tp = draw(st.integers(0, ndim - 1)), draw(st.integers(1, len(dims) - 1))
        placements[tp] = ["S", d]
        placements[0] = ["SS", d, math.prod(shape[dims[i]] for i in range(1, len(dims)) if placements[i] == ["S", d])]
    # FSDP2 + TP: the first of two or more mesh dims sharding one tensor dim is a _StridedShard
    # whose split factor is the product of the later ones (right-to-left sharding)
    for d in range(ndim):
        on = [i for i, p in enumerate(placements) if p == ["S", d]]
        if len(on) > 1 and draw(st.booleans()):
            placements[on[0]] = ["SS", d, math.prod(shape[dims[i]] for i in on[1:])]
    return {"mesh": list(shape), "dims": dims, "placements": placements}


@st.composite
def tensors(draw: Any, name: str, world: int) -> dict[str, Any]:
    ndim = draw(st.integers(0, 3))
    return {
        "name": name,
        "shape": [draw(st.sampled_from(SIZES)) for _ in range(ndim)],
        "dtype": draw(st.sampled_from(["float32", "bfloat16", "float16", "int64"])),
        "seed": draw(st.integers(0, 2**31)),
        "src": draw(layouts(ndim, world)),
        "dst": draw(layouts(ndim, world)),
    }


@st.composite
def cases(draw: Any, world: int) -> dict[str, Any]:
    count = draw(st.integers(1, 3))
    return {"tensors": [draw(tensors(n, world)) for n in "abc"[:count]]}


def check_step(root: Path, case: dict[str, Any], n: int) -> None:
    """The step on disk: verify passes, each global tensor's bytes are written exactly once
    (the default dedupe: twins outside a DTensor's mesh too), and it loads whole in one process."""
    step = root / f"step_{n:08d}"
    assert [str(p) for p in verify_step(str(root), n, record=False)] == []
    index = json.loads((step / "index.json").read_text())
    written = 0
    for f in sorted(step.glob("rank*.safetensors")):
        slots = reading.read_shard_slots(str(f), f.stat().st_size)
        written += sum(s.end - s.begin for name, s in slots.items() if name in index["tensors"])
    unique = 0
    whole = asyncckpt.load(root, n, per_rank="rank0")
    for t in case["tensors"]:
        g = global_tensor(t["seed"], t["shape"], t["dtype"])
        unique += g.numel() * g.element_size()
        got = whole[f"t{n}"][t["name"]]
        assert got.dtype == g.dtype and got.shape == g.shape and torch.equal(got.view(-1), g.view(-1)), t["name"]
    assert written == unique, f"{written} bytes of DTensor data written for {unique} bytes of global tensors"


def check_case(ranks: Ranks, case: dict[str, Any]) -> None:
    for t in case["tensors"] if currently_in_test_context() else ():
        for side in ("src", "dst"):
            lay = t[side]
            if math.prod(lay["mesh"][i] for i in lay["dims"]) < ranks.world:
                event(f"{side}: a sub-mesh (twins outside it)")
            if any(p[0] == "SS" for p in lay["placements"]):
                event(f"{side}: _StridedShard")
            if len(lay["mesh"]) == 3:
                event(f"{side}: on a 3-D mesh")
        if 0 in t["shape"]:
            event("a zero-size dim")
    res = ranks.run(case)
    for r in res:
        assert r["saved"], f"asyncckpt refused {case}: {r.get('refused')}"
        assert "load_error" not in r, f"rank {r['rank']}: {r['load_error']} for {case}"
        assert r["diff"] == [], f"rank {r['rank']}: asyncckpt loaded {r['diff']} wrong for {case}"
        assert r["dcp_saved"], f"dcp.save refused {case}: {r.get('dcp_refused')}"
        assert r["dcp_diff"] == [], f"rank {r['rank']}: asyncckpt and DCP differ on {r['dcp_diff']} for {case}"
        assert r["case"] == ranks.n
    check_step(ranks.root, case, ranks.n)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(4))
def test_asyncckpt_and_dcp_load_every_drawn_layout_bit_equal(ranks: Ranks, case: dict[str, Any]) -> None:
    check_case(ranks, case)


def one(name: str, shape: list[int], mesh: list[int], placements: list[list[Any]]) -> dict[str, Any]:
    src = {"mesh": mesh, "dims": list(range(len(mesh))), "placements": placements}
    return {"name": name, "shape": shape, "dtype": "float32", "seed": 1, "src": src, "dst": src}


def test_partial_is_refused_at_save_naming_the_key(ranks: Ranks) -> None:
    """A pending reduction is not the tensor's values: refused by save() on every rank, typed,
    naming the key and what to do (a reduction would be a collective on the training group)."""
    res = ranks.run({"tensors": [one("a", [4, 3], [2, 2], [["S", 0], ["P"]])]})
    for r in res:
        assert not r["saved"] and f"'t{ranks.n}.a'" in r["refused"] and "Partial" in r["refused"], r
        assert "redistribute" in r["refused"], r
    assert not (ranks.root / f"step_{ranks.n:08d}").exists()


def test_strided_shards_that_are_not_boxes_are_refused(ranks: Ranks) -> None:
    """``(Shard(0), _StridedShard(0, 2))`` gives every rank two row blocks that are not one box
    (rows {0,2}, {1,3}, ...): refused by name at save(), as dcp.save refuses its overlapping
    chunks; a later save of good layouts still commits."""
    res = ranks.run({"tensors": [one("w", [8, 3], [2, 2], [["S", 0], ["SS", 0, 2]])]})
    for r in res:
        assert not r["saved"] and f"'t{ranks.n}.w'" in r["refused"] and "not contiguous" in r["refused"], r
        assert not r["dcp_saved"], r  # DCP: "overlapping chunks"
    check_case(ranks, {"tensors": [one("w", [8, 3], [2, 2], [["SS", 0, 2], ["S", 0]])]})


@pytest.fixture(scope="module")
def ranks8(tmp_path_factory: pytest.TempPathFactory) -> Any:
    world = Ranks(tmp_path_factory.mktemp("oracle8"), 8)
    try:
        yield world
    finally:
        world.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(8))
def test_on_8_ranks_with_true_3d_meshes(ranks8: Ranks, case: dict[str, Any]) -> None:
    check_case(ranks8, case)
