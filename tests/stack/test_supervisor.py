"""The supervisor's backoff: at once, then 1, 2, 4 ... s (at most MAX_DELAY_S) while a process
keeps dying; at once again after it stayed up STABLE_S."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extproc.stack.supervisor import FIRST_DELAY_S, MAX_DELAY_S, STABLE_S, Restarts


def test_a_process_that_keeps_dying_waits_longer_each_time() -> None:
    record, now, waits = Restarts(), 1000.0, []
    for _ in range(8):
        began = now
        while not record.due(now):
            now += 0.25
        waits.append(now - began)
        record.restarted(now)
    assert waits[:4] == [0.0, FIRST_DELAY_S, 2 * FIRST_DELAY_S, 4 * FIRST_DELAY_S]
    assert max(waits) == MAX_DELAY_S and waits == sorted(waits)
    assert record.count == 8


@given(restarts=st.integers(1, 20), up_for=st.floats(0, 2 * STABLE_S))
def test_a_stable_process_is_restarted_at_once_next_time(restarts: int, up_for: float) -> None:
    record = Restarts()
    for _ in range(restarts):
        record.restarted(0.0)
    record.still_up(up_for)
    assert record.due(up_for) == (up_for >= min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** (restarts - 1)) or up_for >= STABLE_S)
    assert record.count == restarts
