"""The save lifecycle transition table, exhaustively."""

from __future__ import annotations

import itertools

import pytest

from asyncckpt.format._lifecycle import TRANSITIONS, InvalidTransition, SaveEvent, SaveState, advance

HAPPY = [SaveEvent.START_WRITE, SaveEvent.FILES_DURABLE, SaveEvent.START_COMMIT, SaveEvent.COMMITTED]


def test_happy_path_leader_and_follower() -> None:
    s = SaveState.STAGED
    for e in HAPPY:
        s = advance(s, e)
    assert s is SaveState.COMMITTED
    s = advance(advance(SaveState.STAGED, SaveEvent.START_WRITE), SaveEvent.FILES_DURABLE)
    assert advance(s, SaveEvent.COMMITTED) is SaveState.COMMITTED  # follower


@pytest.mark.parametrize(("state", "event"), list(itertools.product(SaveState, SaveEvent)))
def test_every_pair(state: SaveState, event: SaveEvent) -> None:
    if (state, event) in TRANSITIONS:
        nxt = advance(state, event)
        assert not state.final
        if event is SaveEvent.FAIL:
            assert nxt is SaveState.FAILED
    else:
        with pytest.raises(InvalidTransition):
            advance(state, event)


def test_final_states_never_change() -> None:
    for state in (SaveState.COMMITTED, SaveState.FAILED):
        assert state.final
        assert not [e for e in SaveEvent if (state, e) in TRANSITIONS]
