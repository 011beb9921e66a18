"""torch.compile and wrapper prefixes: a compiled module is saved with plain keys and loads
into compiled and plain modules alike; DDP's ``module.`` the same when asked for."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _ranks import free_port, log_tail, run_ranks

from asyncckpt import Checkpointer, load
from asyncckpt.loading._restore import restore_into

# importing torch's compiler stack warns about torch.jit (not ours)
pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")

WORKER = str(Path(__file__).parent / "support" / "_ddp_prefix_worker.py")


def net(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def compiled(seed: int) -> Any:
    # torch.compile wraps lazily: the keys carry _orig_mod. before any forward (none runs here)
    m = torch.compile(net(seed))
    assert all(k.startswith("_orig_mod.") for k in m.state_dict())
    return m


PLAIN_KEYS = sorted(net(0).state_dict())


@pytest.mark.parametrize("what", ["module", "state_dict"])
def test_compiled_module_is_saved_with_plain_keys(tmp_path: Path, what: str) -> None:
    model = compiled(1)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": model if what == "module" else model.state_dict()}).result(timeout=60)
    saved = load(tmp_path / "ck")["model"]
    assert sorted(saved) == PLAIN_KEYS
    # the module metadata is the inner module's (BatchNorm's version included)
    assert saved._metadata["1"]["version"] == torch.nn.BatchNorm1d._version
    assert "" in saved._metadata and not any(k.startswith("_orig_mod") for k in saved._metadata)
    plain = net(9)
    plain.load_state_dict(saved)  # a plain module takes it directly, strict
    assert same_weights(plain, model._orig_mod)


@pytest.mark.parametrize(("src", "dst"), [("compiled", "plain"), ("plain", "compiled"), ("compiled", "compiled")])
def test_load_into_works_both_ways(tmp_path: Path, src: str, dst: str) -> None:
    source = compiled(1) if src == "compiled" else net(1)
    target = compiled(2) if dst == "compiled" else net(2)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": source, "step": 5}).result(timeout=60)
        ck.load(into={"model": target, "step": 0})
    inner = lambda m: getattr(m, "_orig_mod", m)  # noqa: E731
    assert same_weights(inner(target), inner(source))


def test_old_checkpoint_with_orig_mod_keys_loads_into_plain_module(tmp_path: Path) -> None:
    # a checkpoint written before the prefix was stripped: a plain dict with _orig_mod. keys
    model = compiled(1)
    old = collections.OrderedDict(model.state_dict())
    old._metadata = model.state_dict()._metadata  # type: ignore[attr-defined]
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": dict(old)}).result(timeout=60)
    loaded = load(tmp_path / "ck")
    assert all(k.startswith("_orig_mod.") for k in loaded["model"])
    target = net(3)
    restore_into({"model": target}, loaded)
    assert same_weights(target, model._orig_mod)


def test_compiled_forward_after_loading_matches(tmp_path: Path) -> None:
    # a cheap call of the compiled module (eager backend: no C++ toolchain needed)
    source = net(1).eval()
    target = torch.compile(net(2).eval(), backend="eager")
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": source}).result(timeout=60)
        ck.load(into={"model": target})
    x = torch.randn(5, 4)
    assert torch.equal(target(x), source(x))


def test_unrelated_dicts_keep_their_keys(tmp_path: Path) -> None:
    # only module state dicts (OrderedDict with _metadata) lose prefixes, never a user's dict
    state = {"cfg": {"module.a": 1, "module.b": 2}, "od": collections.OrderedDict([("_orig_mod.x", 1)])}
    with Checkpointer(tmp_path / "ck", strip_prefixes=("module.",)) as ck:
        ck.save(1, state).result(timeout=60)
    assert load(tmp_path / "ck") == state


@pytest.mark.parametrize("bad", ["module.", ("module",), ("",), (1,)])
def test_strip_prefixes_is_checked_at_the_call(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="strip_prefixes"):
        Checkpointer(tmp_path / "ck", strip_prefixes=bad)
    with pytest.raises(ValueError, match="strip_prefixes"):
        load(tmp_path / "ck", strip_prefixes=bad)


@pytest.mark.slow  # > 15 s in make test's parallel phase: make test-slow (and CI) runs it
@pytest.mark.timeout(90)
def test_ddp_module_prefix_is_stripped_when_asked(tmp_path: Path) -> None:
    world, port, root, out = 2, free_port(), tmp_path / "ck", tmp_path / "result"
    argv = [str(world), str(port), str(root), str(out)]
    hung = run_ranks(lambda r: [WORKER, str(r), *argv], world, tmp_path, 75, warm=True)
    assert not hung, f"ranks {hung} hung:\n{log_tail(tmp_path, hung[0])}"
    for r in range(world):
        f = Path(f"{out}.{r}.json")
        assert f.exists(), log_tail(tmp_path, r)
        res = json.loads(f.read_text())
        assert "crash" not in res, res["crash"]
        assert res["saved_keys"] == sorted(["0.weight", "0.bias", "2.weight", "2.bias"])
        assert res["kept_keys"] == sorted("module." + k for k in res["saved_keys"])
        assert res["ddp_equal"] and res["plain_equal"]
    # the commit line: once per save, by rank 0, with the bytes of both ranks in readable units
    logs = [[ln for ln in log_tail(tmp_path, r, 100_000).splitlines() if ln.startswith("LOG ")] for r in range(world)]
    committed = [ln for ln in logs[0] if "committed step 1:" in ln]
    per_rank = 4 * (4 * 3 + 3 + 3 * 2 + 2)  # float32 weights and biases of the worker's net
    assert len(committed) == 2
    # DDP replicas are identical: deduplicated (the default), the model is written once in total
    assert all(f"rank 0: committed step 1: {per_rank} B from 2 ranks" in ln for ln in committed), committed
    assert all("/s;" in ln and "GB/s" not in ln for ln in committed), committed
    assert not any("committed step" in ln for ln in logs[1])
    assert sum(f"rank 1: step 1 committed by rank 0 ({per_rank} B written here)" in ln for ln in logs[1]) == 2
