"""The cyclic GC is paused for the library's saves and loads, and left as the caller set it."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncckpt import Checkpointer, CheckpointNotFoundError, load
from asyncckpt.format._gcpause import paused_gc
from asyncckpt.loading import _readinto


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


class _OtherThreadsPause:
    """A pause held by another thread from ``start()`` until ``end()``."""

    def __init__(self) -> None:
        self.inside, self.leave = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        with paused_gc():
            self.inside.set()
            assert self.leave.wait(30)

    def start(self) -> None:
        self.thread.start()
        assert self.inside.wait(30)

    def end(self) -> None:
        self.leave.set()
        self.thread.join(30)


def test_overlapping_pauses_on_two_threads_end_with_the_collector_on() -> None:
    other = _OtherThreadsPause()
    with paused_gc():
        other.start()
    assert not gc.isenabled()  # the other thread's pause still runs
    other.end()
    assert gc.isenabled()
    with paused_gc(), paused_gc():  # nested on one thread
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_load_is_one_pause_reads_included(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # issue 32: a pause per phase let the collections between them traverse everything the
    # earlier phases held (2.4-3.4 s of a 300 k-tensor load): the reads run paused too, and
    # the collector is on again once the load returned
    seen: list[bool] = []
    real = _readinto.read_into

    def observed(*args: Any, **kwargs: Any) -> int:
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(_readinto, "read_into", observed)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, _state()).result(timeout=60)
        ck.load(1, into=_state())
    load(tmp_path, 1, into=_state())
    load(tmp_path, 1)
    assert len(seen) == 3 and not any(seen)
    assert gc.isenabled()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_during_another_threads_pause_gets_its_collector_back() -> None:
    other = _OtherThreadsPause()
    other.start()
    try:
        assert not gc.isenabled()
        pid = os.fork()
        if pid == 0:  # the child: the pausing thread is not here
            ok = gc.isenabled()
            with paused_gc():
                ok = ok and not gc.isenabled()
            os._exit(0 if ok and gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        other.end()
    assert gc.isenabled()
