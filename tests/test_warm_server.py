"""The warm rank server (tests/support/_warm.py): a forked worker looks like ``python SCRIPT``
to the tests that use it (exit codes, logs, signals, its own seeds), and what it cannot honour
is refused at the call."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import _warm
import pytest

SCRIPT = """
import json, os, sys, time
import numpy, torch
what = sys.argv[1]
if what == "report":
    json.dump({"argv": sys.argv[1:], "env": os.environ.get("WARM_PROBE"), "main": __name__,
               "path0": sys.path[0], "torch": torch.randn(4).tolist(), "numpy": numpy.random.rand(2).tolist(),
               "pid": os.getpid()}, open(sys.argv[2], "w"))
    print("to stdout"); print("to stderr", file=sys.stderr)
elif what == "exit3":
    sys.exit(3)
elif what == "raise":
    raise KeyError("boom")
elif what == "sleep":
    open(sys.argv[2], "w").close()
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("warm") / "worker.py"
    p.write_text(SCRIPT)
    return p


def env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **extra)


def test_a_forked_worker_runs_as_its_own_main_with_its_own_seeds(script: Path, tmp_path: Path) -> None:
    argv = [[str(script), "report", str(tmp_path / f"r{i}.json")] for i in range(2)]
    procs = [_warm.spawn(argv[i], env(WARM_PROBE=f"p{i}"), str(tmp_path / f"{i}.log")) for i in range(2)]
    assert [p.wait(60) for p in procs] == [0, 0]
    got = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(2)]
    for i, g in enumerate(got):
        assert g["argv"] == ["report", str(tmp_path / f"r{i}.json")] and g["env"] == f"p{i}", g
        assert g["main"] == "__main__" and g["path0"] == str(script.parent), g
        assert g["pid"] == procs[i].pid
        log = (tmp_path / f"{i}.log").read_text()
        assert "to stdout" in log and "to stderr" in log, log
    # a fresh interpreter draws torch's and numpy's seeds anew: forked ranks must too
    assert got[0]["torch"] != got[1]["torch"] and got[0]["numpy"] != got[1]["numpy"]


@pytest.mark.parametrize(("what", "code", "says"), [("exit3", 3, ""), ("raise", 1, "KeyError: 'boom'")])
def test_exit_codes_are_those_of_python_script(script: Path, tmp_path: Path, what: str, code: int, says: str) -> None:
    p = _warm.spawn([str(script), what], env(), str(tmp_path / "log"))
    assert p.wait(60) == code and p.poll() == code
    assert says in (tmp_path / "log").read_text()


def test_signals_reach_the_worker_and_its_death_is_seen(script: Path, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    p = _warm.spawn([str(script), "sleep", str(ready)], env(), str(tmp_path / "log"))
    end = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < end:
        time.sleep(0.02)
    assert p.poll() is None
    with pytest.raises(_warm.subprocess.TimeoutExpired):
        p.wait(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == -signal.SIGTERM
    p.kill()  # after its exit: nothing is signalled (its pid may be another process's by now)


def test_an_environment_read_at_import_is_refused_at_the_call(script: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\['OMP_NUM_THREADS'\] differ .* warm=False"):
        _warm.spawn([str(script), "report", str(tmp_path / "r.json")], env(OMP_NUM_THREADS="7"), str(tmp_path / "l"))
    assert not (tmp_path / "l").exists()
