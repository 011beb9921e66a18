"""One rank of the DDP prefix test: save a DDP-wrapped model with strip_prefixes=("module.",),
then load it back into a fresh DDP model and into a plain one.

argv: rank world port root out
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from asyncckpt import Checkpointer, load


def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def main() -> None:
    rank, world, port, root, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    # the test also reads each rank's asyncckpt log lines (stdout goes to rank<R>.log)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("LOG %(levelname)s %(message)s"))
    logging.getLogger("asyncckpt").addHandler(handler)
    logging.getLogger("asyncckpt").setLevel(logging.DEBUG)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    result: dict[str, object] = {}
    try:
        ddp = DistributedDataParallel(net(1))
        assert all(k.startswith("module.") for k in ddp.state_dict())
        with Checkpointer(root, strip_prefixes=("module.",), timeout=30) as ck:
            ck.save(1, {"model": ddp}).result(timeout=30)
            fresh_ddp = DistributedDataParallel(net(2))
            ck.load(into={"model": fresh_ddp})
            plain = net(3)
            ck.load(into={"model": plain})
        saved = load(root, rank=rank)["model"]
        result["saved_keys"] = sorted(saved)
        result["ddp_equal"] = all(
            torch.equal(a, b) for a, b in zip(ddp.parameters(), fresh_ddp.parameters(), strict=True)
        )
        result["plain_equal"] = all(
            torch.equal(a, b) for a, b in zip(ddp.module.parameters(), plain.parameters(), strict=True)
        )
        # without the option the prefix is kept, so DDP users who rely on it keep it
        with Checkpointer(root + "-keep", timeout=30) as ck:
            ck.save(1, {"model": ddp}).result(timeout=30)
        result["kept_keys"] = sorted(load(root + "-keep", rank=rank)["model"])
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result["crash"] = repr(e)
    finally:
        with open(f"{out}.{rank}.json", "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
