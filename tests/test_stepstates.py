"""The one rule of resumability (``_stepstates``), exhaustively in memory: what is retired,
what stands in the way of a save."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from asyncckpt.format._stepstates import Fault, Mark, Seen, decide, save_action, state_of, victims


def seen(step: int, state_: str) -> Seen:
    if state_ == "bad":
        return Seen(step, f"step_{step:08d}", "committed", "a", float(step), mark=Mark("/x", "checksum mismatch"))
    if state_ == "corrupt":
        return Seen(step, f"step_{step:08d}", "committed", fault=Fault("corrupt", "bad", proven=True))
    if state_ == "incomplete":
        return Seen(step, f"step_{step:08d}", "committed", fault=Fault("no-marker", "none"))
    return Seen(step, f"step_{step:08d}", "committed", "a", float(step))


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.integers(0, 50), st.sampled_from(["complete", "bad", "corrupt", "incomplete"]), max_size=12),
    st.integers(1, 5),
    st.booleans(),
)
def test_victims_are_resumable_and_never_the_newest(states: dict[int, str], keep_last: int, by_order: bool) -> None:
    steps = decide(seen(s, k) for s, k in states.items())
    good = [(x.step, x.created) for x in steps.resumable()]
    doomed = victims(good, keep_last, by_commit_order=by_order)
    resumable = {s for s, _ in good}
    assert set(doomed) <= resumable  # nothing known bad or incomplete is ever retired
    newest = steps.newest()
    assert newest is None or newest.step not in doomed
    assert len(resumable) - len(doomed) == min(keep_last, len(resumable))
    assert all(states[s] in ("bad", "corrupt") for s in (x.step for x in steps.bad()))


def test_save_actions() -> None:
    assert [save_action(x) for x in (None, "complete", "bad", "incomplete")] == [
        "proceed", "committed", "set-aside", "refuse"]  # fmt: skip
    assert state_of(Seen(1, "step_00000001.bad-ab", "aside", "ab")) == "aside"
    assert state_of(Seen(1, "step_00000001.tmp-ab", "save")) == "leftover"
