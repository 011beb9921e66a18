"""Write the golden checkpoints of ``tests/test_golden.py``. Run it only to regenerate them,
and say why in the commit that does.

The golden checkpoints are the format's memory: checkpoints written by the code of a given
day, committed, so that every later version must still load them bit for bit and must still
write the same bytes for the same state. Regenerating them throws that memory away: do it
only for an intended format change (and then bump what readers check, see ``_manifest``),
never to make a failing test pass.

What it writes, beside itself (each checkpoint step 1, well under 1 MiB):

- ``single/``: one process, :func:`_golden_worker.single_state` (every value type README
  "What a checkpoint can hold" lists; tied tensors, so format ``asyncckpt/2``);
- ``ddp2/``: 2 gloo ranks, a DDP-wrapped model and optimizer equal on both plus per-rank
  values, ``dedupe=True`` (:func:`_golden_worker.ddp_saved`);
- ``fsdp_tp4/``: 4 gloo ranks, FSDP2 over TP on a 2 x 2 mesh, with a global index
  (:func:`_golden_worker.fsdp_tp_state`);
- ``s3/single/`` and ``s3/fsdp_tp4/``: the objects ``asyncckpt push`` of those two roots
  left on a real SeaweedFS (``tests/s3fixtures.py``), one file per key, as they sat on the
  store: the tests put them back on a fresh server and load them through ``s3://``. The
  root's metadata (``.asyncckpt/``: the lease record a push leaves) is not kept.

Each local root keeps only its ``step_00000001/`` (the root's ``.asyncckpt/`` ownership
lock is not part of the checkpoint). Manifests record a creation time, an attempt id and a
run id that differ on every save: the tests compare fresh saves with these three fields
normalised. The expected values are not stored: the tests regenerate each state from its
seed (``_golden_worker``), which is why every value there comes from integer arithmetic.
They do depend on torch's own state dict shapes (Adam's ``param_groups`` keys, module
``_metadata`` versions): a torch upgrade that changes those shows up here first.

Run from the repository root: ``python tests/data/golden/make_golden.py`` (about a minute;
needs gloo, obstore and the ``weed`` binary, as the tests do).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parents[1]
sys.path[:0] = [str(TESTS), str(TESTS.parent)]

from _golden_worker import STEP, single_state  # noqa: E402
from _ranks import free_port, log_tail, run_ranks  # noqa: E402

WORKER = str(TESTS / "_golden_worker.py")
#: The checkpoints pushed to the store, and the bucket they went to.
PUSHED = ("single", "fsdp_tp4")
BUCKET = "golden"


def spawn(scenario: str, world: int, roots: list[Path], logs: Path) -> None:
    """Run ``scenario`` of ``_golden_worker`` on ``world`` gloo ranks; raise if a rank failed."""
    port = free_port()
    out = logs / scenario
    hung = run_ranks(lambda r: [WORKER, scenario, str(r), str(world), str(port), *map(str, roots), str(out)],
                     world, logs, 300.0)  # fmt: skip
    if hung:
        raise RuntimeError(f"{scenario}: ranks {hung} hung")
    for r in range(world):
        f = Path(f"{out}.{r}.json")
        res = json.loads(f.read_text()) if f.exists() else {"crash": log_tail(logs, r)}
        if not res.get("ok"):
            raise RuntimeError(f"{scenario} rank {r}: {res.get('crash') or res}")


def keep_only_step(root: Path) -> None:
    shutil.rmtree(root / ".asyncckpt", ignore_errors=True)
    assert sorted(p.name for p in root.iterdir()) == [f"step_{STEP:08d}"], list(root.iterdir())


def push_and_copy(dest: Path) -> None:
    """Push the :data:`PUSHED` roots to a fresh SeaweedFS and copy every object back as a file."""
    from s3fixtures import data_keys, get, opts, running_server

    from asyncckpt import remote

    with running_server(BUCKET) as server:
        for name in PUSHED:
            url = f"s3://{BUCKET}/{name}"
            remote.push(HERE / name, url, storage_options=opts(server.endpoint), deadline_s=120)
            for key in data_keys(server.endpoint, url):
                f = dest / name / key
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_bytes(get(server.endpoint, url, key))


def main() -> None:
    from asyncckpt import Checkpointer

    for name in ("single", "ddp2", "fsdp_tp4", "s3"):
        shutil.rmtree(HERE / name, ignore_errors=True)
    with Checkpointer(HERE / "single") as ck:
        ck.save(STEP, single_state()).result(timeout=120)
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        spawn("ddp", 2, [HERE / "ddp2"], logs)
        spawn("fsdp_tp", 4, [HERE / "fsdp_tp4"], logs)
    for name in ("single", "ddp2", "fsdp_tp4"):
        keep_only_step(HERE / name)
    push_and_copy(HERE / "s3")
    for p in sorted(HERE.rglob("*")):
        if p.is_file() and p.name != Path(__file__).name:
            assert p.stat().st_size < 1 << 20, p
            print(f"{p.stat().st_size:8d}  {p.relative_to(HERE)}")


if __name__ == "__main__":
    main()
