"""A rank of the DCP-oracle property test: serves drawn cases, one JSON line each on stdin.

Started once per test module (``python _oracle_worker.py RANK WORLD PORT ROOT``); for every
case it builds the source DTensors on the drawn mesh (a sub-mesh of a 1-D to 3-D mesh of
every rank), saves them with asyncckpt (step = the case's number) and with ``dcp.save``,
loads both into DTensors of the drawn target layout, and answers one JSON line: where the
asyncckpt load differs from torch's own sharding of the global tensor (``distribute_tensor``)
and from DCP's load, bit for bit, and what each refused. ``{"quit": true}`` ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from asyncckpt import Checkpointer, CheckpointError, SaveError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64, "float16": torch.float16}
_MESHES: dict[tuple[int, ...], DeviceMesh] = {}


def mesh_of(shape: list[int], dims: list[int]) -> DeviceMesh:
    """The (cached) mesh of ``shape`` over every rank, sliced to its mesh dims ``dims``."""
    key = tuple(shape)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", key, mesh_dim_names=tuple(f"m{i}" for i in range(len(key))))
    mesh = _MESHES[key]
    if len(dims) == len(shape):
        return mesh
    return mesh[tuple(f"m{i}" for i in dims)]


def placement(p: list[Any]) -> Any:
    """``["R"]``, ``["P"]``, ``["S", d]`` or ``["SS", d, split_factor]`` as a torch placement."""
    if p[0] == "R":
        return Replicate()
    if p[0] == "P":
        return Partial()
    if p[0] == "S":
        return Shard(p[1])
    return _StridedShard(p[1], split_factor=p[2])


def global_tensor(seed: int, shape: list[int], dtype: str) -> torch.Tensor:
    """The case's global tensor: the same on every rank (and in the test process)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == "int64":
        return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=torch.int64)
    return torch.randn(shape, generator=g).to(DTYPES[dtype])


def layout(spec: dict[str, Any], g: torch.Tensor) -> Any:
    mesh = mesh_of(spec["mesh"], spec["dims"])
    placements = [placement(p) for p in spec["placements"]]
    if any(p[0] == "P" for p in spec["placements"]):  # pending sums: every rank holds a summand
        return DTensor.from_local(g.clone(), mesh, placements, run_check=False)
    return distribute_tensor(g, mesh, placements, src_data_rank=None)


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def run_case(rank: int, ck: Checkpointer, dcp_root: str, case: dict[str, Any]) -> dict[str, Any]:
    n = case["n"]
    out: dict[str, Any] = {"rank": rank, "diff": [], "dcp_diff": []}
    globals_ = {t["name"]: global_tensor(t["seed"], t["shape"], t["dtype"]) for t in case["tensors"]}
    src = {t["name"]: layout(t["src"], globals_[t["name"]]) for t in case["tensors"]}
    # a fresh structure per case (key t<n>): a save of a structure seen before lays its files out
    # for the plan the last round made for it, and keeps its own copies where the new round
    # differs (correct, not deduplicated: these cases differ in everything but the names)
    key = f"t{n}"
    state: dict[str, Any] = {key: src, "case": n}
    try:
        ck.save(n, state).result(timeout=60)
        out["saved"] = True
    except TypeError as e:  # a layout asyncckpt refuses, at the call, on every rank
        out["saved"] = False
        out["refused"] = str(e)
        try:
            ck.flush()  # the other ranks' view of the same refusal: reported once, here
        except SaveError as failed:
            out["flush"] = type(failed).__name__
    try:
        dcp.save({key: src}, checkpoint_id=os.path.join(dcp_root, str(n)))
        out["dcp_saved"] = True
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        out["dcp_saved"] = False
        out["dcp_refused"] = f"{type(e).__name__}: {str(e)[:300]}"
    if not out["saved"]:
        return out
    sentinel = {name: torch.full_like(g, 7) for name, g in globals_.items()}
    ours = {t["name"]: layout(t["dst"], sentinel[t["name"]]) for t in case["tensors"]}
    theirs = {t["name"]: layout(t["dst"], sentinel[t["name"]].clone()) for t in case["tensors"]}
    target = {key: ours, "case": -1}
    t0 = time.perf_counter()
    try:
        loaded = ck.load(n, into=target)
    except CheckpointError as e:  # every rank agrees on the step's fate: they stay in step
        out["load_error"] = f"{type(e).__name__}: {e}"
        return out
    out["load_s"] = time.perf_counter() - t0
    out["case"] = loaded["case"]
    if out["dcp_saved"]:
        dcp.load({key: theirs}, checkpoint_id=os.path.join(dcp_root, str(n)))
    for t in case["tensors"]:
        name = t["name"]
        want = bits(layout(t["dst"], globals_[name]).to_local())  # torch's own sharding of the source
        got = loaded[key][name]
        if bits(got.to_local()) != want:
            out["diff"].append(name)
        if got is not ours[name] and bits(ours[name].to_local()) != want:
            out["diff"].append(f"{name} (target in place)")
        if out["dcp_saved"] and bits(theirs[name].to_local()) != bits(got.to_local()):
            out["dcp_diff"].append(name)
    return out


def main() -> None:
    rank, world, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    with Checkpointer(root, timeout=60) as ck:
        print(json.dumps({"ready": rank}), flush=True)
        for line in sys.stdin:
            case = json.loads(line)
            if case.get("quit"):
                break
            try:
                res = run_case(rank, ck, root + ".dcp", case)
            except BaseException as e:  # noqa: BLE001 - the test reads what happened
                res = {"rank": rank, "crash": "".join(traceback.format_exception(e))[-4000:]}
            print(json.dumps(res), flush=True)
            if "crash" in res:
                break  # the ranks are out of step now: the test fails and stops us
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
