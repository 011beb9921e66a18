"""The states of the golden checkpoints (``tests/data/golden/``) and the ranks that save and
load them.

Every value comes from integer arithmetic on seeded generators (``torch.randint``, the
Mersenne Twister states, exact binary fractions): no matmul, no backward, no optimizer step,
so the same bits come out on any machine and any CPU instruction set. That is what lets the
tests regenerate each state from its seed and compare it bit for bit with what a golden
checkpoint holds, without storing expected values beside it.

As a program: ``python _golden_worker.py SCENARIO RANK WORLD PORT ROOT [ROOT2] OUT`` runs one
rank of a gloo job and writes ``OUT.RANK.json`` (``{"ok": true}`` or what went wrong):

- ``ddp``: save :func:`ddp_state` on 2 ranks (DDP-wrapped model, ``dedupe=True``) as step 1
  of ROOT.
- ``fsdp_tp``: save :func:`fsdp_tp_state` on 4 ranks (FSDP2 x TP on a 2 x 2 mesh) as step 1
  of ROOT.
- ``two``: on 2 ranks, ``ddp`` into ROOT, then load the 4-rank golden at ROOT2 into an FSDP2
  model on a 1-D mesh of 2 (another layout) and compare with :func:`fsdp_tp_full`.
"""

from __future__ import annotations

import collections
import datetime
import pathlib
import random
import sys
import zoneinfo
from typing import Any

import numpy as np
import torch
from _ranks import run_scenario
from torch import nn

#: The seeds of the golden states (a new seed means new golden files: see make_golden.py).
SINGLE_SEED = 20260101
DDP_SEED = 20260102
FSDP_TP_SEED = 20260103
#: Steps the golden checkpoints are saved as.
STEP = 1


def exact(g: torch.Generator, *shape: int) -> torch.Tensor:
    """float32 values that are exact binary fractions (integers / 1024): the same bits from
    every machine, and every sum or product of a few of them is exact too."""
    return torch.randint(-(2**20), 2**20, shape, generator=g, dtype=torch.int64).to(torch.float32) / 1024


def raw(g: torch.Generator, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    """A tensor of ``dtype`` holding seeded random bytes (every bit pattern, NaNs included)."""
    n = int(np.prod(shape)) if shape else 1
    size = torch.empty((), dtype=dtype).element_size()
    b = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.int64).to(torch.uint8)
    return b.view(dtype).reshape(shape)


class Small(nn.Module):
    """A module with parameters, a buffer and a non-persistent buffer (not saved)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.norm = nn.LayerNorm(4)
        self.emb = nn.Embedding(5, 4)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def fill(module: nn.Module, g: torch.Generator) -> None:
    """Overwrite every parameter and floating buffer of ``module`` with :func:`exact` values."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_floating_point():
                t.copy_(exact(g, *t.shape))


def adam_for(module: nn.Module, g: torch.Generator) -> torch.optim.Adam:
    """An Adam optimizer over ``module`` whose state (step, exp_avg, exp_avg_sq) is set from
    seeded exact values through ``load_state_dict`` (no step taken: see the module docstring)."""
    opt = torch.optim.Adam(module.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    sd = opt.state_dict()
    state = {
        i: {"step": torch.tensor(3.0), "exp_avg": exact(g, *p.shape), "exp_avg_sq": exact(g, *p.shape).abs()}
        for i, p in enumerate(module.parameters())
    }
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
    return opt


def small_model(seed: int) -> tuple[Small, torch.optim.Adam]:
    torch.manual_seed(seed)  # the init the values overwrite
    g = torch.Generator().manual_seed(seed)
    m = Small()
    fill(m, g)
    m.count.fill_(11)
    return m, adam_for(m, g)


def single_state() -> dict[str, Any]:
    """The single-process golden state: every kind of value README "What a checkpoint can
    hold" lists, each the same on every call."""
    g = torch.Generator().manual_seed(SINGLE_SEED)
    model, optim = small_model(SINGLE_SEED)
    gen = torch.Generator().manual_seed(SINGLE_SEED + 1)
    torch.rand(5, generator=gen)  # a state past the seed
    np_rng = np.random.RandomState(SINGLE_SEED)
    np_rng.random_sample(3)
    bitgen = np.random.Generator(np.random.PCG64(SINGLE_SEED))
    bitgen.random(2)
    py_rng = random.Random(SINGLE_SEED)
    py_rng.random()
    tied = exact(g, 3, 4)
    odict: collections.OrderedDict[str, Any] = collections.OrderedDict([("z", 1), ("a", [2, 3])])
    odict._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    ddict: collections.defaultdict[str, list[int]] = collections.defaultdict(list)
    ddict["b"].append(1)
    ddict["a"].append(2)
    return {
        "tensors": {
            "f32": exact(g, 4, 5),
            "f64": exact(g, 7).to(torch.float64) / 3,
            "f16": raw(g, torch.float16, 3, 3),
            "bf16": raw(g, torch.bfloat16, 2, 8),
            "i8": raw(g, torch.int8, 5),
            "u8": raw(g, torch.uint8, 2, 3),
            "i16": raw(g, torch.int16, 4),
            "i32": raw(g, torch.int32, 3),
            "i64": raw(g, torch.int64, 2, 2),
            "bool": torch.randint(0, 2, (6,), generator=g).bool(),
            "c64": raw(g, torch.complex64, 3),
            "scalar": torch.tensor(2.5),
            "scalar_i64": torch.tensor(-7),
            "empty": torch.zeros(0, 4),
            "empty_bf16": torch.zeros(3, 0, dtype=torch.bfloat16),
            "param": nn.Parameter(exact(g, 3)),
            "frozen": nn.Parameter(exact(g, 2), requires_grad=False),
            "noncontig": exact(g, 4, 6).t(),
        },
        "numpy": {
            **{d: np.arange(-3, 9).reshape(3, 4).astype(d) for d in (
                "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "complex128")},
            "bool": (np.arange(6) % 2).astype(bool),
            "zero_d": np.array(1.25, dtype=np.float32),
            "empty": np.zeros((0, 3), dtype=np.int32),
            "scalars": [np.float32(1.5), np.int64(-(2**40)), np.bool_(True), np.uint8(200), np.complex64(1 - 2j)],
        },
        "plain": {
            "int": 3, "neg": -12345678901234567890, "big": 2**130 + 1, "float": 0.1, "nan": float("nan"),
            "inf": float("-inf"), "negzero": -0.0, "true": True, "false": False, "none": None,
            "str": "grüße ✓ \n\t\"quoted\"", "empty_str": "", "bytes": b"\x00\xff\x10", "bytearray": bytearray(b"ab"),
            "complex": complex(1.5, -2),
        },
        "containers": {
            "list": [1, "two", [3.0, None]],
            "tuple": (1, (2, "x"), ()),
            "int_keys": {1: "a", -2: "b", 3: {4: 5}},
            "set": {3, 1, 2},
            "frozenset": frozenset({"x", "y"}),
            "odict": odict,
            "ddict": ddict,
            "empty_dict": {},
            "empty_list": [],
        },
        "torch": {"size": torch.Size([2, 0, 3]), "dtype": torch.bfloat16, "device": torch.device("cpu"),
                  "generator": gen},
        "misc": {
            "posix": pathlib.PurePosixPath("/data/a b"),
            "windows": pathlib.PureWindowsPath(r"C:\data\x.bin"),
            "path": pathlib.Path("rel/dir"),
            "date": datetime.date(2024, 2, 29),
            "delta": datetime.timedelta(days=-3, seconds=5, microseconds=7),
            "naive": datetime.datetime(2024, 1, 2, 3, 4, 5, 678901),
            "utc": datetime.datetime(2024, 1, 2, tzinfo=datetime.timezone.utc),
            "named": datetime.datetime(2024, 1, 2, tzinfo=datetime.timezone(datetime.timedelta(hours=1), "CET")),
            "zone": datetime.datetime(2024, 10, 27, 2, 30, fold=1, tzinfo=zoneinfo.ZoneInfo("Europe/Berlin")),
        },
        "rng": {
            "python": py_rng.getstate(),
            "numpy": np_rng.get_state(),
            "bitgen": bitgen.bit_generator.state,
            "torch": gen.get_state(),
        },
        "model": model,
        "optim": optim,
        "tied": {"a": tied, "b": tied},
        "step": STEP,
    }


def single_saved() -> dict[str, Any]:
    """What loading the single golden returns: :func:`single_state` with its objects as their
    state dicts."""
    s = single_state()
    s["model"] = s["model"].state_dict()
    s["optim"] = s["optim"].state_dict()
    return s


# ---------------------------------------------------------------- DDP


def ddp_module(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    fill(m, torch.Generator().manual_seed(seed))
    return m


def ddp_parts(rank: int) -> tuple[nn.Sequential, torch.optim.Adam, dict[str, Any]]:
    """The module, its optimizer (equal on every rank) and rank ``rank``'s own values."""
    m = ddp_module(DDP_SEED)
    opt = adam_for(m, torch.Generator().manual_seed(DDP_SEED + 1))
    gen = torch.Generator().manual_seed(DDP_SEED + 100 + rank)
    torch.rand(3, generator=gen)
    return m, opt, {"rng": gen.get_state(), "data_pos": 1000 * (rank + 1), "step": STEP}


def ddp_saved(rank: int) -> dict[str, Any]:
    """What rank ``rank`` of the DDP golden saved: the model's state dict without DDP's
    ``module.`` prefix (``strip_prefixes`` drops it at save), the optimizer's, its own values."""
    m, opt, own = ddp_parts(rank)
    return {"model": m.state_dict(), "optim": opt.state_dict(), **own}


# ---------------------------------------------------------------- FSDP2 x TP


class Net(nn.Module):
    """Every parameter is in the TP plan (``up`` colwise, ``down`` rowwise); ``buf`` a plain buffer."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(6, hidden)
        self.down = nn.Linear(hidden, 4)
        self.register_buffer("buf", torch.arange(4.0))


def fsdp_tp_net() -> Net:
    torch.manual_seed(FSDP_TP_SEED)
    m = Net()
    fill(m, torch.Generator().manual_seed(FSDP_TP_SEED))
    return m


def optim_like(params: dict[str, Any]) -> dict[str, Any]:
    """Adam-shaped state derived from ``params`` by exact elementwise arithmetic (so a DTensor
    keeps its placements and the full tensors can be computed on one process)."""
    return {
        "state": {k: {"step": torch.tensor(2.0), "exp_avg": p * 0.5, "exp_avg_sq": p * p} for k, p in params.items()},
        "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": list(params)}],
    }


def fsdp_tp_full() -> dict[str, Any]:
    """The full tensors of the FSDP2 x TP golden, on one process."""
    m = fsdp_tp_net()
    sd = m.state_dict()  # an OrderedDict with the modules' versions, as saved
    params = {k: sd[k] for k, _ in m.named_parameters()}
    return {"model": sd, "optim": optim_like(params), "step": STEP}


def fsdp_tp_state() -> dict[str, Any]:
    """On 4 ranks: FSDP2 over TP on a 2 x 2 mesh, so ``up.weight`` is (_StridedShard(0), Shard(0))."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    m = fsdp_tp_net()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(m, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp"])
    sd = m.state_dict()
    params = {k: p.detach() for k, p in m.named_parameters()}
    return {"model": sd, "optim": optim_like(params), "step": STEP}


def fsdp_target(world: int) -> dict[str, Any]:
    """A load target of another layout: FSDP2 on a 1-D mesh of ``world``, zero-filled."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = Net()
    fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
    sd = m.state_dict()
    with torch.no_grad():
        for v in sd.values():
            v.zero_()
    params = {k: p.detach() * 0 for k, p in m.named_parameters()}
    return {"model": sd, "optim": optim_like(params), "step": -1}


def full(obj: Any) -> Any:
    """``obj`` with every DTensor replaced by its full tensor (a collective, in key order)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.full_tensor().detach().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: full(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full(v) for v in obj)
    return obj


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two states differ (tensors byte for byte, with dtype and shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        ok = ok and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        return [] if ok else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return [f"{path}: keys {list(a)} != {list(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}.{i}")]
    return [] if a == b and type(a) is type(b) else [f"{path}: {a!r} != {b!r}"]


# ---------------------------------------------------------------- ranks


def save_ddp(rank: int, root: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from asyncckpt import Checkpointer

    m, opt, own = ddp_parts(rank)
    model = DistributedDataParallel(m)
    with Checkpointer(root, dedupe=True, strip_prefixes=("module.",)) as ck:
        ck.save(STEP, {"model": model, "optim": opt, **own}).result(timeout=120)


def save_fsdp_tp(root: str) -> None:
    from asyncckpt import Checkpointer

    with Checkpointer(root) as ck:
        ck.save(STEP, fsdp_tp_state()).result(timeout=120)


def load_fsdp_tp(world: int, root: str, res: dict[str, Any]) -> None:
    """Load the 4-rank golden into a 2-rank FSDP2 layout; compare the full tensors."""
    from asyncckpt import Checkpointer

    target = fsdp_target(world)
    with Checkpointer(root) as ck:
        loaded = ck.load(into=target)
    got = full({"model": target["model"], "optim": target["optim"]["state"]})
    want = fsdp_tp_full()
    res["diff"] = differences(got, {"model": want["model"], "optim": want["optim"]["state"]})
    res["step"] = loaded["step"]


def main() -> None:
    scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    root, out = sys.argv[5], sys.argv[-1]

    def run(res: dict[str, Any]) -> None:
        if scenario == "ddp":
            save_ddp(rank, root)
        elif scenario == "fsdp_tp":
            save_fsdp_tp(root)
        elif scenario == "two":
            save_ddp(rank, root)
            load_fsdp_tp(world, sys.argv[6], res)
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
        res["ok"] = True

    run_scenario(rank, world, port, out, run, timeout_s=90)


if __name__ == "__main__":
    main()
