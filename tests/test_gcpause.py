"""The cyclic GC is paused only around the library's own CPU work, and left as the caller set it."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncckpt import Checkpointer, CheckpointNotFoundError, _readinto, load
from asyncckpt._gcpause import paused_gc


@pytest.fixture(autouse=True)
def gc_back_on() -> Iterator[None]:
    yield
    gc.enable()


def _state() -> dict[str, Any]:
    return {"m": {f"w{i}": torch.full((64,), float(i)) for i in range(200)}, "n": 3}


def test_a_collector_the_caller_switched_off_stays_off(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        ck.save(1, _state()).result(timeout=60)
        gc.disable()
        ck.save(2, _state()).result(timeout=60)
        ck.load(2)
        load(tmp_path, 2, into=_state())
        with pytest.raises(CheckpointNotFoundError):
            ck.load(99)
        assert not gc.isenabled()
        gc.enable()
        with pytest.raises(CheckpointNotFoundError):
            ck.load(99)
        load(tmp_path, 1, into=_state())
        assert gc.isenabled()


def test_overlapping_pauses_on_two_threads_end_with_the_collector_on() -> None:
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with paused_gc():
            inside.set()
            assert leave.wait(30)

    t = threading.Thread(target=other)
    with paused_gc():
        t.start()
        assert inside.wait(30)
    assert not gc.isenabled()  # the other thread's pause still runs
    leave.set()
    t.join(30)
    assert gc.isenabled()
    with paused_gc(), paused_gc():  # nested on one thread
        assert not gc.isenabled()
    assert gc.isenabled()


def test_reads_run_with_the_collector_as_the_caller_left_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the pause covers parsing and planning, not the I/O: another thread may switch the
    # collector off while a load reads, and that stays so
    seen: list[bool] = []
    real = _readinto.read_into

    def observed(*args: Any, **kwargs: Any) -> int:
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(_readinto, "read_into", observed)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, _state()).result(timeout=60)
    load(tmp_path, 1, into=_state())
    load(tmp_path, 1)
    assert seen and all(seen)
