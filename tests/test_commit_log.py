"""Sizes and rates in log lines are printed with units picked by magnitude."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from asyncckpt import Checkpointer
from asyncckpt.saving._savestats import format_bytes, format_rate


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (999, "999 B"), (1000, "1.00 kB"), (12_345, "12.3 kB"), (4_000_000, "4.00 MB"),
     (812_000_000, "812 MB"), (2_410_000_000, "2.41 GB"), (3e12, "3.00 TB")],
)  # fmt: skip
def test_format_bytes(n: float, text: str) -> None:
    assert format_bytes(n) == text


def test_format_rate_picks_the_unit_by_size() -> None:
    assert format_rate(4_000, 0.01) == "400 kB/s"
    assert format_rate(5e9, 2.0) == "2.50 GB/s"
    assert format_rate(1, 0.0) == "n/a"


def test_small_single_rank_save_logs_a_readable_rate(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="asyncckpt")
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"w": torch.zeros(10)}).result(timeout=60)
    (line,) = [r.getMessage() for r in caplog.records if "committed step" in r.getMessage()]
    assert line.startswith("committed step 1: 40 B in ") and "0.00 GB/s" not in line and "B/s;" in line
