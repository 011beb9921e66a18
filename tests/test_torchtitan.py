"""asyncckpt.integrations.torchtitan with torchtitan 0.3.0 itself: its Llama3 ``debugmodel``
through its own ``parallelize_llama`` (FSDP2) on 4 real gloo processes, trained with the loop
torchtitan's ``Trainer.train`` runs (``tests/support/_torchtitan_worker.py``).

One uninterrupted run with torchtitan's own ``CheckpointManager`` (async DCP) is the reference.
A second job starts from that run's DCP ``step-1`` (a job switching to asyncckpt), saves steps 2
and 3 with :class:`AsyncckptCheckpointManager` and is SIGKILLed while step 3's save is in
flight. It then resumes:

* on 4 ranks: every later loss, and the final model-only export (bfloat16), bit-identical to
  the reference (same world size, same reduction order, and the data resume where they were:
  the dataloader state is restored);
* on 2 ranks, with ``exclude_from_loading=["dataloader", "lr_scheduler"]``: the data cannot
  resume (torchtitan cannot reshard its dataloader state) and 2 ranks reduce in another order,
  so no loss can match; what must match is the state: every model and optimizer value loaded
  is bit-identical to the reference run's at that step, ``train_state`` is restored, and the
  excluded scheduler is not. Without excluding the dataloader the load is refused up front.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import _torchtitan
import pytest
import torch
from _ranks import free_port, log_tail, run_ranks

import asyncckpt
import asyncckpt.reading

WORKER = str(Path(__file__).parent / "support" / "_torchtitan_worker.py")
STEPS = 4
pytestmark = [pytest.mark.timeout(400)]


def _base() -> str:
    base = _torchtitan.path()
    if base is None:
        pytest.skip(_torchtitan.SKIP)
    got = _torchtitan.version(base)
    if got != _torchtitan.VERSION:
        pytest.skip(f"needs torchtitan/ {_torchtitan.VERSION} (the version tested), found {got}")
    return base


def _run(tmp: Path, world: int, job: dict[str, Any], on_started: Any = None, deadline: float = 240) -> dict[str, Any]:
    """Run the job on ``world`` ranks; rank 0's result (``result.json``, else ``progress.json``)."""
    base = _base()
    out = Path(job.setdefault("out", str(tmp / "out")))
    out.mkdir(parents=True, exist_ok=True)
    logs = tmp / "logs"
    logs.mkdir(exist_ok=True)
    path = tmp / "job.json"
    path.write_text(json.dumps(job))
    port = free_port()
    hung = run_ranks(
        lambda r: [WORKER, str(r), str(world), str(port), str(path)], world, logs, deadline,
        extra_env={"ASYNCCKPT_TORCHTITAN_PATH": base} if base else None, on_started=on_started,
    )  # fmt: skip
    assert not hung, f"ranks {hung} hung: {log_tail(logs, hung[0])}"
    for name in ("result.json", "progress.json"):
        if (out / name).exists():
            return json.loads((out / name).read_text())  # type: ignore[no-any-return]
    raise AssertionError(f"rank 0 wrote no result: {log_tail(logs, 0)}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torchtitan's own CheckpointManager (async DCP), uninterrupted: losses and the gathered
    state after every step (``out/state-N.pt``); DCP ``step-1`` .. ``step-4`` (model only)."""
    tmp = tmp_path_factory.mktemp("reference")
    job = {"manager": "dcp", "dump": str(tmp), "steps": STEPS, "interval": 1, "export_dtype": "bfloat16",
           "dump_at": list(range(1, STEPS + 1))}  # fmt: skip
    result = _run(tmp, 4, job)
    assert sorted(result["losses"]) == [str(s) for s in range(1, STEPS + 1)]
    assert sorted(p.name for p in (tmp / "checkpoint").iterdir()) == [f"step-{s}" for s in range(1, STEPS + 1)]
    return tmp


@pytest.fixture(scope="module")
def killed(reference: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job that starts from the reference's DCP ``step-1``, saves steps 2 and 3 with
    asyncckpt and is SIGKILLed (every rank) once step 3's save was staged."""
    tmp = tmp_path_factory.mktemp("killed")
    (tmp / "checkpoint").mkdir()
    shutil.copytree(reference / "checkpoint" / "step-1", tmp / "checkpoint" / "step-1")
    marker = tmp / "saved-3"
    when: list[float] = []

    def kill_when_saved(procs: list[subprocess.Popen[bytes]]) -> None:
        end = time.monotonic() + 200
        while not marker.exists() and time.monotonic() < end and all(p.poll() is None for p in procs):
            time.sleep(0.02)
        when.append(time.monotonic())
        for p in procs:
            p.send_signal(signal.SIGKILL)

    job = {"manager": "asyncckpt", "dump": str(tmp), "steps": STEPS, "interval": 1, "keep": 2,
           "export_dtype": "bfloat16", "kill_after": 3}  # fmt: skip
    progress = _run(tmp, 4, job, on_started=kill_when_saved)
    assert marker.exists(), "the run died before step 3's save returned"
    ref = json.loads((reference / "out" / "result.json").read_text())
    # it started from torchtitan's DCP step-1 and trained on exactly as the reference did
    assert progress["resumed_at"] == 1
    assert {s: progress["losses"][s] for s in ("2", "3")} == {s: ref["losses"][s] for s in ("2", "3")}
    steps = [i.step for i in asyncckpt.reading.complete_checkpoints(str(tmp / "checkpoint"))]
    print(f"\nSIGKILL once step 3's save was staged: complete steps {steps}")
    assert steps in ([2], [2, 3]), steps  # step 2 committed before save(3) got its buffer
    return tmp


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src / "checkpoint", dst / "checkpoint")
    return dst


def _equal(got: dict[str, Any], want: dict[str, Any], keys: list[str]) -> list[str]:
    bad = []
    for k in keys:
        a, b = got.get(k), want[k]
        same = (
            isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
            if isinstance(b, torch.Tensor)
            else a == b
        )
        if not same:
            bad.append(k)
    return bad


@pytest.mark.slow  # with the next test: three 4-rank torchtitan trainings (~3 min); the config and export tests stay
def test_killed_run_resumes_on_4_ranks_bit_identically(reference: Path, killed: Path, tmp_path: Path) -> None:
    dump = _copy(killed, tmp_path)
    job = {"manager": "asyncckpt", "dump": str(dump), "steps": STEPS, "interval": 1, "keep": 2,
           "export_dtype": "bfloat16", "dump_loaded": True}  # fmt: skip
    result = _run(tmp_path, 4, job)
    ref = json.loads((reference / "out" / "result.json").read_text())
    start = result["resumed_at"]
    assert start in (2, 3), start
    # the loaded state is the reference's at that step, bit for bit
    loaded = torch.load(tmp_path / "out" / "loaded.pt", weights_only=False)
    want = torch.load(reference / "out" / f"state-{start}.pt", weights_only=False)
    assert _equal(loaded, want, list(want)) == []
    # every later loss is the uninterrupted run's
    assert result["losses"] == {str(s): ref["losses"][str(s)] for s in range(start + 1, STEPS + 1)}
    # the last save is model-only, in export_dtype: the reference's final weights, cast
    final = torch.load(reference / "out" / f"state-{STEPS}.pt", weights_only=False)
    export = asyncckpt.load(str(dump / "checkpoint"), STEPS)
    assert export["asyncckpt_torchtitan"] == {"format": "asyncckpt-torchtitan/1", "model_only": True,
                                              "export_dtype": "bfloat16"}  # fmt: skip
    assert sorted(export) == ["asyncckpt_torchtitan", "model"]
    model = {k[len("model.") :]: v for k, v in final.items() if k.startswith("model.")}
    assert sorted(export["model"]) == sorted(model)
    assert [k for k, v in model.items() if not torch.equal(export["model"][k], v.to(torch.bfloat16))] == []
    # keep_latest_k=2 kept the newest two asyncckpt steps; torchtitan's DCP step-1 is untouched
    names = sorted(p.name for p in (dump / "checkpoint").iterdir() if not p.name.startswith("."))
    assert "step-1" in names and (dump / "checkpoint" / "step-1" / ".metadata").is_file()
    assert [i.step for i in asyncckpt.reading.complete_checkpoints(str(dump / "checkpoint"))] == [3, 4]


@pytest.mark.slow  # shares the 4-rank reference and killed runs above
def test_resumes_on_2_ranks_with_the_dataloader_excluded(reference: Path, killed: Path, tmp_path: Path) -> None:
    dump = _copy(killed, tmp_path)
    job = {"manager": "asyncckpt", "dump": str(dump), "steps": STEPS, "interval": 1, "keep": 0,
           "export_dtype": "bfloat16", "dump_loaded": True, "expect_error": True,
           "exclude": ["dataloader", "lr_scheduler"]}  # fmt: skip
    result = _run(tmp_path, 2, job)
    # without the exclusion: refused before anything was read, naming the way out
    assert result["refused"] is not None and "exclude_from_loading" in result["refused"]
    assert "saved by 4 ranks and this job has 2" in result["refused"]
    start = result["resumed_at"]
    assert start in (2, 3), start
    loaded = torch.load(tmp_path / "out" / "loaded.pt", weights_only=False)
    want = torch.load(reference / "out" / f"state-{start}.pt", weights_only=False)
    resharded = [k for k in want if k.startswith(("model.", "optimizer."))]
    assert len(resharded) > 600
    assert _equal(loaded, want, resharded) == []
    assert loaded["train_state"] == want["train_state"] == {"step": start, "ntokens_seen": 64 * start}
    # the excluded scheduler was not loaded: still at its start
    assert result["lr_last_epoch_after_load"] == 0 and want["lr_scheduler.last_epoch"] == start
    # and the job trained on from there, on 2 ranks
    assert sorted(result["losses"], key=int) == [str(s) for s in range(start + 1, STEPS + 1)]


def test_config_refuses_what_it_does_not_support() -> None:
    _base()
    _torchtitan.prepare()
    from asyncckpt.integrations.torchtitan import AsyncckptCheckpointManager

    Config = AsyncckptCheckpointManager.Config
    with pytest.raises(NotImplementedError, match="last_save_in_hf"):
        Config(enable=True, last_save_in_hf=True)
    with pytest.raises(NotImplementedError, match="local folders"):
        Config(enable=True, folder="s3://bucket/ck")
    with pytest.raises(ValueError, match="timeout"):
        Config(enable=True, timeout=0)
    with pytest.raises(ValueError, match="max_pending"):
        Config(enable=True, max_pending=0)
    with pytest.raises(ValueError, match="exclude_from_loading"):
        Config(enable=True, exclude_from_loading=["model"])  # torchtitan's own rule, kept
    assert Config(enable=False).build(
        dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None,
    ).save(10) is False  # fmt: skip


def _one_process_manager(folder: Path, model: torch.nn.Module, ts: Any, **options: Any) -> Any:
    """The manager as torchtitan's trainer builds it, for one process (no process group)."""
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from asyncckpt.integrations.torchtitan import AsyncckptCheckpointManager

    opt = default_adamw(lr=0.1)
    opt.implementation = "for-loop"
    optimizers = opt.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=10)
    config = AsyncckptCheckpointManager.Config(enable=True, folder=folder.name, interval=2, **options)
    return config.build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": ts}, sd_adapter=None, base_folder=str(folder.parent),
    )  # fmt: skip


# torchtitan's LRSchedulersContainer.load_state_dict calls get_lr() outside step(): torch warns
@pytest.mark.filterwarnings("ignore:To get the last learning rate computed by the scheduler:UserWarning")
def test_model_only_export_load_step_and_initial_load_path(tmp_path: Path) -> None:
    """One process: the last save is the model alone in export_dtype; a resume refuses it (it is
    a finished run's export) but ``load_step`` reaches it and full steps; another run starts
    from a step via ``initial_load_path`` (model only); an excluded key that is no state raises."""
    _base()
    _torchtitan.prepare()
    from _torchtitan_worker import TrainState

    torch.manual_seed(0)
    model, ts = torch.nn.Linear(4, 3), TrainState()
    ck = _one_process_manager(tmp_path / "ck", model, ts, export_dtype="bfloat16")
    assert ck.load() is False  # a fresh start
    ts.step = 2
    assert ck.save(1) is False and ck.save(2) is True  # interval 2
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    ts.step = 3
    assert ck.save(3, last_step=True) is True  # durable when it returns
    ck.close()
    export = asyncckpt.load(str(tmp_path / "ck"), 3)
    assert sorted(export) == ["asyncckpt_torchtitan", "model"] and export["model"]["weight"].dtype == torch.bfloat16
    assert torch.equal(export["model"]["weight"], model.weight.detach().to(torch.bfloat16))

    fresh, ts2 = torch.nn.Linear(4, 3), TrainState()
    ck = _one_process_manager(tmp_path / "ck", fresh, ts2)
    with pytest.raises(ValueError, match="model-only export of a finished run"):
        ck.load()
    assert ck.load(step=2) is True and ts2.step == 2
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
    with pytest.raises(FileNotFoundError, match="load_step=7"):
        ck.load(step=7)
    ck.close()

    other, ts3 = torch.nn.Linear(4, 3), TrainState()
    ck = _one_process_manager(tmp_path / "new", other, ts3, initial_load_path=str(tmp_path / "ck" / "step_00000002"))
    assert ck.load() is True and ts3.step == 0  # model only: the new run starts at step 0
    assert all(torch.equal(other.state_dict()[k], v) for k, v in saved.items())
    ck.close()
    ck = _one_process_manager(tmp_path / "ck", torch.nn.Linear(4, 3), TrainState(), exclude_from_loading=["ema"])
    with pytest.raises(ValueError, match="ema not found in state_dict"):
        ck.load(step=2)
    ck.close()


def test_example_keeps_the_checkpoint_options_and_the_cli_overrides_them() -> None:
    """examples/torchtitan_asyncckpt.py swaps the manager keeping torchtitan's options, and
    torchtitan's launcher (tyro, with its registry) parses ``--checkpoint.*`` into the new Config."""
    _base()
    _torchtitan.prepare()
    import tyro
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.config.manager import custom_registry

    from asyncckpt.integrations.torchtitan import AsyncckptCheckpointManager

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        import torchtitan_asyncckpt as example
    finally:
        sys.path.pop(0)
    theirs = CheckpointManager.Config(folder="ck", interval=7, keep_latest_k=4, exclude_from_loading=["dataloader"])
    config = example.use_asyncckpt(SimpleNamespace(checkpoint=theirs), timeout=120.0)
    ours = config.checkpoint
    assert type(ours) is AsyncckptCheckpointManager.Config and ours.enable
    assert (ours.folder, ours.interval, ours.keep_latest_k, ours.exclude_from_loading, ours.timeout) == (
        "ck", 7, 4, ["dataloader"], 120.0,
    )  # fmt: skip
    args = [
        "--interval",
        "5",
        "--timeout",
        "60",
        "--max_pending",
        "2",
        "--exclude_from_loading",
        "dataloader",
        "lr_scheduler",
    ]
    parsed = tyro.cli(type(ours), args=args, default=ours, registry=custom_registry)
    assert (parsed.interval, parsed.timeout, parsed.max_pending, parsed.exclude_from_loading) == (
        5, 60.0, 2, ["dataloader", "lr_scheduler"],
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
