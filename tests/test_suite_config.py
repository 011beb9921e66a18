"""The test suite's own configuration: what keeps its workers alive."""

from __future__ import annotations

import pytest


def test_no_faulthandler_watchdog(pytestconfig: pytest.Config) -> None:
    """pytest's ``faulthandler_timeout`` dumps the stacks of a test still running after that many
    seconds, from a watchdog thread that holds no GIL: it reads thread states that are being
    freed and segfaults the process (CI lost a pytest-xdist worker 110 s into a long test that
    starts threads for each of its 20,000 loads). Reproduced alone: 4 threads started and joined in a
    loop under ``faulthandler.dump_traceback_later(0.001, repeat=True)`` die by SIGSEGV within
    seconds. pytest-timeout dumps the stacks from the main thread, under the GIL."""
    assert float(pytestconfig.getini("faulthandler_timeout") or 0) == 0
    assert pytestconfig.getini("timeout")
