"""benchmarks/growth.py end to end on tiny states: every figure there, every load bit-exact,
a state that does not fit skipped with the reason, and the limits' bounded file image."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, str(BENCH / "growth.py"), "--out", str(tmp_path / "out"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_growth_run_tiny(tmp_path: Path) -> None:
    p = _run(tmp_path, "--quick")
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["status"] for r in data["results"]] == ["ok"] * 3, data["results"]
    sizes, counts = data["figures"]["sizes"], data["figures"]["counts"]
    assert [f["n_tensors"] for f in counts] == [200, 800]
    for f in sizes + counts:
        assert f["ok"] and f["bit_exact"], f
        for key in ("blocking_x", "durable_x", "load_cold_x", "load_warm_x", "save_fixed_us", "load_above_us"):
            assert isinstance(f[key], float), key
        assert f["staging_bytes"] > 0 and f["save_rss"] > 0
    for f in counts:  # the walk, plan and tree JSON timed inside save() (SaveStatistics.prepare_s)
        assert 0 < f["save_prepare_us"] and 0 <= f["save_prepare_cpu_us"], f
    assert "load_marginal_us" in counts[1]
    assert {t["key"] for t in data["targets"]} == {
        "durable", "save_fixed", "save_prepare", "save_memory", "save_gc", "load_marginal", "load_memory",
    }  # fmt: skip
    md = (tmp_path / "out" / "results.md").read_text()
    assert "## Sizes" in md and "## Tensor counts" in md and "## Targets" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the PNG is skipped with a message, nothing else changes
        assert not (tmp_path / "out" / "growth.png").exists()
        assert "matplotlib is not installed" in p.stderr
    else:
        assert (tmp_path / "out" / "growth.png").stat().st_size > 0
    # nothing left behind in the scratch directory
    assert not [n for n in os.listdir(tmp_path) if n.startswith("asyncckpt-growth-")]


def test_growth_skips_a_state_that_does_not_fit(tmp_path: Path) -> None:
    p = _run(tmp_path, "--sizes", "4T", "--counts", "none", "--noise", "none", "--wait-for-memory", "0")
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(r["state"], r["status"]) for r in data["results"]] == [("transformer-4T", "skipped")]
    assert "of free memory" in data["results"][0]["reason"]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "skipped: needs ~" in md


def _limits_module() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_limits", BENCH / "limits.py")
        assert spec and spec.loader
        limits = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(limits)
        return limits
    finally:
        sys.path.remove(str(BENCH))


def _state() -> tuple[Any, bytes]:
    sys.path.insert(0, str(BENCH))
    try:
        from states import StateSpec, build_state, byte_view, tensors_of
    finally:
        sys.path.remove(str(BENCH))
    state = build_state(StateSpec("transformer", 40 << 20))
    return state, b"".join(bytes(byte_view(t)) for t in tensors_of(state))


@pytest.mark.parametrize("image", [None, 16 << 20])
def test_limits_bounded_image_writes_as_many_bytes(tmp_path: Path, image: int | None) -> None:
    limits = _limits_module()
    state, full = _state()
    lim = limits.Limits(state, str(tmp_path / "raw"), image_bytes=image)
    try:
        for direct in (True, False):
            lim.write(direct)
            data = Path(lim.last_file).read_bytes()
            assert data == (full if image is None else (full[:image] * 3)[: len(full)])
            lim.read(cold=True)
            assert lim.verify_read()
    finally:
        lim.close()
    for bad in (0, (16 << 20) + 4096):
        with pytest.raises(ValueError, match="multiple of"):
            limits.Limits(state, str(tmp_path / "raw2"), image_bytes=bad)


def test_limits_bounded_copy_targets_copy_every_tensor(tmp_path: Path) -> None:
    limits = _limits_module()
    state, _ = _state()
    src = list(limits.tensors_of(state))
    largest = max(t.numel() * t.element_size() for t in src)
    lim = limits.Limits(state, str(tmp_path / "raw"), copy_bytes=largest + 4096)
    try:
        lim.memcpy()
        # the targets reuse one buffer from its start: those after the last wrap-around are all intact
        base = lim.dst[0].data_ptr()
        last_wrap = max(i for i, d in enumerate(lim.dst) if d.data_ptr() == base and d.numel())
        assert last_wrap > 0
        assert all(d.equal(s) for d, s in zip(lim.dst[last_wrap:], src[last_wrap:], strict=True))
        assert len({d.untyped_storage().data_ptr() for d in lim.dst}) == 1
    finally:
        lim.close()
    with pytest.raises(ValueError, match="smaller than the largest tensor"):
        limits.Limits(state, str(tmp_path / "raw2"), copy_bytes=largest - 1)
