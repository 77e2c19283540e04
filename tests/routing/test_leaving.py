"""The order of a replica's leaving (extproc/routing/leaving.py): its invariants, on random histories."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.routing.leaving import Leaving, Phase, State

LEAVING, RECEIVERS = "llm-1", ("llm-0", "llm-2")
KEYS = st.integers(0, 7)
STEPS = st.lists(st.tuples(st.sampled_from(["move", "moved", "failed", "follow-up", "ended", "cold"]), KEYS,
                           st.sampled_from(RECEIVERS), st.floats(0, 2)), max_size=40)


def begun(idle: set[int], in_flight: set[int]) -> Leaving:
    return Leaving.begin(LEAVING, 0.0, 30.0, 5.0, idle - in_flight, in_flight)


def play(leaving: Leaving, steps: list[tuple[str, int, str, float]]) -> float:
    """Random steps as a caller makes them, each checked against the order's rules; the time reached."""
    now = 0.0
    running = set(leaving.states) - {k for k, s in leaving.states.items() if s is State.IDLE}
    for what, key, receiver, pause in steps:
        now += pause
        if what == "move":
            assert not set(leaving.to_move()) & running  # never one with a request in flight here
        elif what == "moved" and leaving.states.get(key) in (State.MOVING, State.IN_FLIGHT):
            leaving.moved(key, receiver, now)
        elif what == "failed":
            leaving.failed(key, now)
        elif what in ("follow-up", "cold"):
            route = leaving.route(key, now)
            check_route(leaving, key, now, route.only, route.avoid)
            # the caller: the warm copy when there is one, unless the leaving replica is unavailable
            # ("cold": its follow-up computed elsewhere); with none, anywhere but the leaving replica
            cold = what == "cold" and route.only == LEAVING
            sent = RECEIVERS[0] if cold or route.only is None else route.only
            leaving.sent(key, sent, now)
            if sent == LEAVING:
                running.add(key)
        elif what == "ended":
            leaving.ended(key)
            running.discard(key)
    return now


def check_route(leaving: Leaving, key: int, now: float, only: str | None, avoid: frozenset[str]) -> None:
    if key in leaving.receivers:  # moved: to the receiver, never cold to a third replica
        assert only == leaving.receivers[key]
    elif not leaving.holds(key) or leaving.states[key] is State.UNMOVED or leaving.near(now):
        assert LEAVING in avoid and only is None
    else:  # unmoved and not near the deadline: the leaving replica, which holds its cache
        assert only == LEAVING and not avoid


@settings(max_examples=300, deadline=None)
@given(st.sets(KEYS), st.sets(KEYS), STEPS)
def test_follow_ups_go_where_the_warm_copy_is(idle: set[int], in_flight: set[int],
                                               steps: list[tuple[str, int, str, float]]) -> None:
    play(begun(idle, in_flight), steps)


@settings(max_examples=300, deadline=None)
@given(st.sets(KEYS), st.sets(KEYS), STEPS)
def test_at_the_deadline_every_conversation_is_moved_or_counted(idle: set[int], in_flight: set[int],
                                                                 steps: list[tuple[str, int, str, float]]) -> None:
    leaving = begun(idle, in_flight)
    now = play(leaving, steps)
    moved_before = set(leaving.receivers)
    unmoved = leaving.went_down(max(now, leaving.deadline_s))
    assert set(unmoved) | moved_before == idle | in_flight
    assert not set(unmoved) & moved_before
    assert leaving.phases()["unmoved"] == unmoved
    assert leaving.to_move() == []  # nothing moves after the deadline
    for key in idle | in_flight:  # after down: a moved one to its receiver, none to the stopped replica
        route = leaving.route(key, leaving.deadline_s + 1)
        assert route.phase is Phase.AFTER_DOWN and LEAVING in route.avoid
        assert route.only == leaving.receivers.get(key)


@given(st.sets(KEYS, min_size=1), st.sets(KEYS))
def test_idle_conversations_move_at_once_and_busy_ones_when_their_request_ends(idle: set[int],
                                                                                 in_flight: set[int]) -> None:
    leaving = begun(idle, in_flight)
    assert set(leaving.to_move()) == idle - in_flight
    assert leaving.to_move() == []
    for key in in_flight:
        leaving.ended(key)
    assert set(leaving.to_move()) == in_flight


def test_a_follow_up_during_the_move_is_moved_again_to_the_same_receiver() -> None:
    leaving = begun({1}, set())
    assert leaving.to_move() == [1]
    leaving.sent(1, LEAVING, 1.0)  # came back before the restore: served here, still warm
    leaving.moved(1, "llm-2", 1.5)
    assert leaving.route(1, 2.0).only == "llm-2"
    assert leaving.to_move() == []  # its request still runs here
    leaving.ended(1)
    assert leaving.to_move() == [1]
    leaving.moved(1, "llm-2", 3.0)
    assert [e[2:] for e in leaving.phases()["events"]] == [["moved", "llm-2"], ["moved", "llm-2"]]
    assert [f[2] for f in leaving.follow_ups] == ["before move"]


def test_near_the_deadline_an_unmoved_follow_up_goes_elsewhere_and_is_counted() -> None:
    leaving = begun(set(), {4})
    assert leaving.route(4, 24.9).avoid == frozenset()
    route = leaving.route(4, 25.0)
    assert route.avoid == {LEAVING} and route.phase is Phase.UNMOVED
    leaving.sent(4, "llm-0", 25.0)
    assert leaving.went_down(30.0) == [4]
