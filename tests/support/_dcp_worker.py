"""A rank of the DCP storage-layer tests: FSDP2 (``_global_worker.build``) on gloo.

Run as ``python _dcp_worker.py SCENARIO RANK WORLD PORT DIR OUT``.

* ``save``: train one step; ``dcp.save`` through ``StorageWriter`` (step 1), ``dcp.async_save``
  through it (step 2), and ``dcp.save`` with torch's own ``FileSystemWriter`` (DIR/dcp, for the
  importer); rank 0 keeps the gathered model and optimizer tensors as the reference (DIR/ref.pt).
* ``load``: a fresh model and optimizer on this world size; step 1 and step 2 through
  ``dcp.load`` + ``StorageReader``, and the imported step (DIR/imported, step 7) through
  ``Checkpointer.load(into=...)``; each compared bit for bit with the reference.
* ``s3save`` / ``s3load``: the same on an object store: ``$DCP_S3_URL`` (storage options:
  ``$DCP_S3_OPTIONS``, JSON) instead of DIR/ck; ``s3load`` also reads step 1 through
  ``Checkpointer(url).load(into=...)``.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _global_worker import build, full, train_step
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import asyncckpt
from asyncckpt.integrations.dcp import StorageReader, StorageWriter
from asyncckpt.roots.posix._osops import OsOps


def tensors(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, gathered whole (collective), by flat name."""
    msd, osd = get_state_dict(model, optim)
    out = {f"model.{k}": v for k, v in full(msd).items()}
    for fqn, st in full(osd["state"]).items():
        out.update({f"optim.{fqn}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def compare(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    bad = [k for k in ref if k not in got or got[k].dtype != ref[k].dtype or not torch.equal(got[k], ref[k])]
    return bad + [k for k in got if k not in ref]


def scenario_save(rank: int, world: int, base: str) -> dict[str, Any]:
    model, optim = build(world, seed=1)
    train_step(model, optim)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "meta": {"epoch": 3, "rank0": "yes"}}
    dcp.save(state, storage_writer=StorageWriter(os.path.join(base, "ck"), step=1))
    dcp.async_save(state, storage_writer=StorageWriter(os.path.join(base, "ck", "step_00000002"))).result(60)
    dcp.save(state, checkpoint_id=os.path.join(base, "dcp"))  # torch's own FileSystemWriter
    ref = tensors(model, optim)
    if rank == 0:
        torch.save(ref, os.path.join(base, "ref.pt"))
    # rank 1's disk fills up mid-write: every rank raises, nothing is committed
    ops = _NoSpace() if rank == 1 else OsOps()
    try:
        dcp.save(state, storage_writer=StorageWriter(os.path.join(base, "ck"), step=3, ops=ops))
        failed: Any = None
    except CheckpointException as e:
        failed = {str(r): [type(f[0] if isinstance(f, tuple) else f).__name__,
                           getattr(f[0] if isinstance(f, tuple) else f, "errno", None)]
                  for r, f in e.failures.items()}  # fmt: skip
    return {"keys": len(ref), "failed": failed}


class _NoSpace(OsOps):
    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        if offset > 0:  # after the header: a partial file is left
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().pwrite(fd, data, offset)


def scenario_load(rank: int, world: int, base: str) -> dict[str, Any]:
    ref = torch.load(os.path.join(base, "ref.pt"), weights_only=True)
    out: dict[str, Any] = {}
    for step in (1, 2):
        model, optim = build(world, seed=99)  # different weights: the load must replace them all
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "meta": {"epoch": 0, "rank0": ""}}
        dcp.load(state, storage_reader=StorageReader(os.path.join(base, "ck"), step=step))
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out[f"dcp{step}"] = {"bad": compare(tensors(model, optim), ref), "meta": state["meta"]}
    if os.path.isdir(os.path.join(base, "imported")):
        model, optim = build(world, seed=98)
        msd, osd = get_state_dict(model, optim)
        with asyncckpt.Checkpointer(os.path.join(base, "imported")) as ck:
            got = ck.load(7, into={"model": msd, "optim": osd, "meta": {}})
        set_state_dict(model, optim, model_state_dict=got["model"], optim_state_dict=got["optim"])
        out["imported"] = {"bad": compare(tensors(model, optim), ref), "meta": got["meta"]}
    return out


def _s3() -> tuple[str, dict[str, str]]:
    return os.environ["DCP_S3_URL"], json.loads(os.environ["DCP_S3_OPTIONS"])


def scenario_s3save(rank: int, world: int, base: str) -> dict[str, Any]:
    url, opts = _s3()
    model, optim = build(world, seed=1)
    train_step(model, optim)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "meta": {"epoch": 3, "rank0": "yes"}}
    dcp.save(state, storage_writer=StorageWriter(url, step=1, storage_options=opts))
    writer = StorageWriter(url + "/step_00000002", storage_options=opts)
    dcp.async_save(state, storage_writer=writer).result(60)
    ref = tensors(model, optim)
    if rank == 0:
        torch.save(ref, os.path.join(base, "ref.pt"))
    return {"keys": len(ref)}


def scenario_s3load(rank: int, world: int, base: str) -> dict[str, Any]:
    url, opts = _s3()
    ref = torch.load(os.path.join(base, "ref.pt"), weights_only=True)
    out: dict[str, Any] = {}
    for step in (1, 2):
        model, optim = build(world, seed=99)
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "meta": {"epoch": 0, "rank0": ""}}
        dcp.load(state, storage_reader=StorageReader(url, step=step, storage_options=opts))
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out[f"dcp{step}"] = {"bad": compare(tensors(model, optim), ref), "meta": state["meta"]}
    model, optim = build(world, seed=98)
    msd, osd = get_state_dict(model, optim)
    with asyncckpt.Checkpointer(url, storage_options=opts) as ck:
        got = ck.load(1, into={"model": msd, "optim": osd, "meta": {}})
    set_state_dict(model, optim, model_state_dict=got["model"], optim_state_dict=got["optim"])
    out["checkpointer"] = {"bad": compare(tensors(model, optim), ref), "meta": got["meta"]}
    return out


def main() -> None:
    scenario, rank, world, port, base, out = (
        sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6],
    )  # fmt: skip
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=90)
    )
    result: dict[str, Any] = {"rank": rank}
    try:
        result.update(globals()[f"scenario_{scenario}"](rank, world, base))
    except BaseException:  # noqa: BLE001 - reported in the result file
        result["crash"] = traceback.format_exc()
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
