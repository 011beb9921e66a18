"""Deferred staging (``save(step, state, until=optimizer)``): every pattern of the torn-state
bugs reported against asynchronous checkpointing (Lightning #20953, nvidia-resiliency-ext
#376, NeMo RL #3312, pytorch #144657), each of which must either save exactly the state at
``save()`` or fail that save with ``StateChangedError`` naming the key, the previous
checkpoint still the latest and loadable."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import asyncckpt
from asyncckpt.saving import _deferred


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # ~2 MiB of weights: several staging groups, so the copy is not over before save() returns
    return nn.Sequential(nn.Linear(256, 1024), nn.BatchNorm1d(1024), nn.ReLU(inplace=True), nn.Linear(1024, 256))


def train_step(m: nn.Module, opt: torch.optim.Optimizer, micro: int = 1, set_to_none: bool = True) -> None:
    opt.zero_grad(set_to_none=set_to_none)
    for i in range(micro):
        x = torch.randn(16, 256, generator=torch.Generator().manual_seed(i))
        m(x).square().mean().backward()
    opt.step()


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """What a correct save of ``state`` holds, taken now."""
    out = {}
    for k, v in state.items():
        out[k] = copy.deepcopy(v.state_dict() if hasattr(v, "state_dict") else v)
    return out


def assert_same(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), path
    elif isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}.{i}")
    else:
        assert got == want, path


@pytest.fixture
def setup(tmp_path: Path) -> Any:
    m = model()
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    train_step(m, opt)  # optimizer state exists
    ck = asyncckpt.Checkpointer(tmp_path / "root")
    yield m, opt, ck, tmp_path / "root"
    ck.close()


def test_step_after_save_saves_the_state_at_save(setup: Any) -> None:
    m, opt, ck, root = setup
    state = {"model": m, "optim": opt, "epoch": 3}
    want = snapshot(state)
    h = ck.save(1, state, until=opt)
    train_step(m, opt)  # forward, backward, step: the step waits for the copy
    h.result(60)
    assert_same(asyncckpt.load(root, step=1), want)
    assert not torch.equal(m[0].weight, want["model"]["0.weight"])  # the step did run


def test_batchnorm_buffers_and_scalars_are_copied_in_save(setup: Any) -> None:
    m, opt, ck, root = setup
    want = snapshot({"model": m, "optim": opt})
    h = ck.save(1, {"model": m, "optim": opt}, until=opt)
    m(torch.randn(16, 256)).sum()  # forward moves running_mean/var and num_batches_tracked
    assert not torch.equal(m[1].running_mean, want["model"]["1.running_mean"])
    ck.wait_staged(60)
    h.result(60)
    assert_same(asyncckpt.load(root, step=1)["model"], want["model"])


def test_gradient_accumulation_and_zero_grad_in_place(setup: Any) -> None:
    m, opt, ck, root = setup
    for step, (micro, to_none) in enumerate([(4, False), (3, True), (1, False)], start=1):
        want = snapshot({"model": m, "optim": opt})
        h = ck.save(step, {"model": m, "optim": opt}, until=opt)
        train_step(m, opt, micro=micro, set_to_none=to_none)
        h.result(60)
        assert_same(asyncckpt.load(root, step=step), want)


def test_inplace_activation_in_forward_is_harmless(setup: Any) -> None:
    m, opt, ck, root = setup  # ReLU(inplace=True) writes activations, never weights
    want = snapshot({"model": m})
    h = ck.save(1, {"model": m}, until=opt)
    with torch.no_grad():
        m(torch.randn(16, 256))
    train_step(m, opt)
    h.result(60)
    assert_same(asyncckpt.load(root, step=1), want)


def test_inplace_write_to_a_weight_in_forward_fails_by_name(setup: Any) -> None:
    m, opt, ck, root = setup
    before = snapshot({"model": m, "optim": opt})
    ck.save(1, {"model": m, "optim": opt})  # a good checkpoint first, today's mode
    ck.flush()
    h = ck.save(2, {"model": m, "optim": opt}, until=opt)
    with torch.no_grad():
        m[3].weight.clamp_(-0.01, 0.01)  # e.g. a weight constraint applied in forward
    train_step(m, opt)
    with pytest.raises(asyncckpt.StateChangedError) as e:
        h.result(60)
    assert e.value.keys == ("model.3.weight",) and "model.3.weight" in str(e.value)
    assert isinstance(e.value, asyncckpt.SaveError) and e.value.step == 2
    with pytest.raises(asyncckpt.StateChangedError):
        ck.flush()
    assert ck.steps() == [1]
    assert asyncckpt.find_latest(root).step == 1  # type: ignore[union-attr]
    assert_same(asyncckpt.load(root), before)


def test_write_by_hand_between_save_and_step_fails_by_name(setup: Any) -> None:
    m, opt, ck, root = setup
    h = ck.save(1, {"model": m, "optim": opt}, until=opt)
    with torch.no_grad():
        m[0].bias.add_(1.0)  # not through the optimizer: only the version counter sees it
    opt.state[m[0].weight]["exp_avg"].mul_(0.5)
    train_step(m, opt)
    with pytest.raises(asyncckpt.StateChangedError) as e:
        h.result(60)
    assert set(e.value.keys) == {"model.0.bias", "optim.state.0.exp_avg"}
    with pytest.raises(asyncckpt.StateChangedError):
        ck.flush()
    assert ck.steps() == [] and asyncckpt.find_latest(root) is None


def test_the_check_has_teeth(setup: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the version check the same hand-written save commits."""
    m, opt, ck, _ = setup
    monkeypatch.setattr(_deferred, "_CHECK_VERSIONS", False)
    h = ck.save(1, {"model": m}, until=opt)
    with torch.no_grad():
        m[0].bias.add_(1.0)
    ck.wait_staged(60)
    assert h.result(60).step == 1


def test_named_tensor_and_wait_staged_allow_writes(setup: Any) -> None:
    m, opt, ck, root = setup
    want = snapshot({"model": m})
    h = ck.save(1, {"model": m}, until=opt, copy_now=["model.0.bias"])
    with torch.no_grad():
        m[0].bias.add_(1.0)  # named: copied in save()
    ck.wait_staged(60)
    with torch.no_grad():
        m[3].weight.add_(1.0)  # after wait_staged(): the copy is complete
    h.result(60)
    assert_same(asyncckpt.load(root, step=1), want)


def test_optimizer_not_named_waits_too(setup: Any) -> None:
    m, opt, ck, root = setup
    head = nn.Linear(256, 256)
    opt2 = torch.optim.SGD(head.parameters(), lr=0.5)
    want = snapshot({"model": m, "head": head})
    h = ck.save(1, {"model": m, "head": head}, until=opt)  # opt2 not named: head copied in save()
    for o in (opt2, opt):  # the unnamed optimizer steps first
        o.zero_grad()
    (m(torch.randn(4, 256)).sum() + head(torch.randn(4, 256)).sum()).backward()
    opt2.step()
    opt.step()
    h.result(60)
    assert_same(asyncckpt.load(root, step=1), want)


def test_second_save_before_the_step(setup: Any) -> None:
    m, opt, ck, root = setup
    want = snapshot({"model": m, "optim": opt})
    h1 = ck.save(1, {"model": m, "optim": opt}, until=opt)
    h2 = ck.save(2, {"model": m, "optim": opt}, until=opt)  # the first one's guard
    train_step(m, opt)
    h1.result(60)
    h2.result(60)
    assert_same(asyncckpt.load(root, step=1), want)
    assert_same(asyncckpt.load(root, step=2), want)


def test_grad_scaler_style_loop(tmp_path: Path) -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)

    def scaled_step() -> None:
        opt.zero_grad()
        scaler.scale(m(torch.randn(16, 256)).square().mean()).backward()
        scaler.step(opt)  # unscales the grads in place, then opt.step(): the guard
        scaler.update()

    scaled_step()
    with asyncckpt.Checkpointer(tmp_path) as ck:
        for step in (1, 2):
            state = {"model": m, "optim": opt, "scaler": scaler}
            want = snapshot(state)
            h = ck.save(step, state, until=opt)
            scaled_step()
            h.result(60)
            assert_same(asyncckpt.load(tmp_path, step=step), want)


def test_compiled_module(tmp_path: Path) -> None:
    m = model()
    cm = torch.compile(m, backend="aot_eager")
    opt = torch.optim.AdamW(cm.parameters(), lr=0.1)

    def step() -> None:
        opt.zero_grad()
        cm(torch.randn(16, 256)).square().mean().backward()
        opt.step()

    step()
    with asyncckpt.Checkpointer(tmp_path) as ck:
        want = snapshot({"model": m, "optim": opt})
        h = ck.save(1, {"model": cm, "optim": opt}, until=opt)
        step()
        h.result(60)
        got = asyncckpt.load(tmp_path, step=1)
        assert_same(got, want)  # keys without the _orig_mod. prefix, values of the save


def test_flush_and_close_are_guards(tmp_path: Path) -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ck = asyncckpt.Checkpointer(tmp_path)
    want = snapshot({"model": m})
    h = ck.save(1, {"model": m}, until=opt)
    ck.close(60)  # no step ever came: close releases the copy, the save commits
    assert h.result(0).step == 1
    assert_same(asyncckpt.load(tmp_path), want)


def test_bad_arguments(setup: Any) -> None:
    m, opt, ck, _ = setup
    with pytest.raises(TypeError, match="until"):
        ck.save(1, {"model": m}, until="adam")
    with pytest.raises(TypeError, match="until"):
        ck.save(1, {"model": m}, until=[])
    with pytest.raises(TypeError, match="copy_now"):
        ck.save(1, {"model": m}, until=opt, copy_now="model.0.bias")
    ck.save(1, {"model": m}, until=opt)  # the step is still free after the refusals
    ck.flush()
    assert ck.steps() == [1]


def test_nothing_owned_falls_back_to_copy_in_save(setup: Any) -> None:
    m, _, ck, root = setup
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    want = snapshot({"model": m})
    h = ck.save(1, {"model": m}, until=other)  # owns nothing saved: today's mode
    with torch.no_grad():
        m[0].weight.add_(1.0)
    h.result(60)
    assert_same(asyncckpt.load(root, step=1), want)


def test_a_copy_that_fails_in_the_background_never_commits(setup: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """libc's memmove replaced (the one fault nothing real produces on demand): the save fails,
    through its handle and flush(), the step still runs, the previous checkpoint stays."""
    from asyncckpt.saving import _stagecopy

    m, opt, ck, root = setup
    ck.save(1, {"model": m}).result(60)
    real = _stagecopy._memmove
    calls = [0]

    def failing(dst: int, src: int, n: int) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(5, "injected copy failure")
        return real(dst, src, n)

    monkeypatch.setattr(_stagecopy, "_memmove", failing)
    h = ck.save(2, {"model": m}, until=opt)
    train_step(m, opt)  # the guard finds the copy failed: the step goes on, the save fails
    with pytest.raises(asyncckpt.SaveError, match="injected copy failure"):
        h.result(60)
    with pytest.raises(asyncckpt.SaveError):
        ck.flush()
    assert ck.steps() == [1] and asyncckpt.find_latest(root).step == 1  # type: ignore[union-attr]
