"""The event loop against numbers worked out by hand."""

from __future__ import annotations

import pytest

from extproc.routing import Router
from extproc.sim.engine import ClosedLoop, Fleet, OpenLoop, simulate
from extproc.sim.request import Request
from tests.sim.helpers import request, settings, simple_cost


def run(requests, replicas=2, slots=2, cache_tokens=0, policy="round-robin", scale=()):
    router = Router(settings(policy))
    outcome = simulate(OpenLoop(requests), router, simple_cost(), Fleet(replicas, slots, cache_tokens, scale))
    assert router.in_flight() == 0 and router.ledger.total_tokens() == 0
    return {r.request_id: r for r in outcome.requests}, outcome


def test_two_replicas_shared_cpu_and_slot_cache():
    # round-robin: r1, r3, r5 -> llm-0; r2, r4 -> llm-1.
    done, outcome = run([
        request("r1", "a", 1, 100, 10, 0.0),   # llm-0 alone: prefill 1.0 s, decode 1.0 s
        request("r2", "b", 1, 50, 5, 0.0),     # llm-1 alone: prefill 0.5 s, decode 0.5 s
        request("r3", "c", 1, 50, 5, 0.5),     # llm-0 beside r1: both at half speed
        request("r4", "a", 2, 120, 10, 3.5),   # llm-1: a's history is on llm-0 -> miss
        request("r5", "a", 3, 140, 10, 6.0),   # llm-0: slot still holds a's 100 + 10 tokens
    ])
    r1, r2, r3, r4, r5 = (done[f"r{i}"] for i in range(1, 6))
    assert [r.replica for r in (r1, r2, r3, r4, r5)] == ["llm-0", "llm-1", "llm-0", "llm-1", "llm-0"]
    assert (r2.first_token_at, r2.finished_at) == pytest.approx((0.5, 1.0))
    # 0.5 s alone, then r1 and r3 share: both prefills (0.5 s solo each) end at 1.5;
    # r3's decode (0.5 s solo) at half speed ends at 2.5; r1 then finishes its last 0.5 s alone.
    assert (r1.first_token_at, r1.finished_at) == pytest.approx((1.5, 3.0))
    assert (r3.first_token_at, r3.finished_at) == pytest.approx((1.5, 2.5))
    assert (r4.cache_n, r4.prompt_n) == (0, 120)
    assert (r4.first_token_at, r4.finished_at) == pytest.approx((4.7, 5.7))
    assert (r5.cache_n, r5.prompt_n) == (110, 30)
    assert (r5.first_token_at, r5.finished_at) == pytest.approx((6.3, 7.3))
    assert outcome.end_s == pytest.approx(7.3)


def test_a_request_is_keyed_as_it_arrives_so_the_router_routes_it_under_the_key_it_carries():
    done, _ = run([request("x", "a", 1, 100, 10, 0.0), request("y", "b", 1, 100, 10, 0.1)])
    router = Router(settings("round-robin"))  # the same hash_seed
    assert {r.route.key for r in done.values()} == {router.conversation_key("a"), router.conversation_key("b")}
    assert all(r.ticket is not None and r.ticket.key == r.route.key for r in done.values())


def test_fifo_queue_when_slots_are_busy():
    done, _ = run([request("x", "a", 1, 100, 10, 0.0), request("y", "b", 1, 100, 10, 0.1)], replicas=1, slots=1)
    assert done["x"].finished_at == pytest.approx(2.0)
    assert (done["y"].started_at, done["y"].finished_at) == pytest.approx((2.0, 4.0))


def test_a_queued_arrival_leaves_the_running_requests_untouched():
    # One slot: y and z only queue behind x. x still ends at 2.0 s (its wake-up holds, no
    # event per queued arrival), then y and z run one after the other, in arrival order.
    done, outcome = run([request("x", "a", 1, 100, 10, 0.0), request("y", "b", 1, 100, 10, 0.3),
                         request("z", "c", 1, 100, 10, 0.7)], replicas=1, slots=1)
    assert done["x"].finished_at == pytest.approx(2.0)
    assert [t for r in "yz" for t in (done[r].started_at, done[r].finished_at)] == pytest.approx([2.0, 4.0, 4.0, 6.0])
    assert outcome.events == 3 + 3 * 2  # 3 arrivals + end of prefill and of decode per request


@pytest.mark.parametrize(("capacity", "cached"), [(0, 0), (1000, 110), (150, 0)])
def test_host_ram_cache_restores_a_swapped_out_conversation(capacity, cached):
    # One slot: b evicts a's prefix from the slot into host RAM; a's next turn restores it,
    # unless the cache is off (--cache-ram 0) or too small to keep a once b is saved too.
    done, _ = run([
        request("a1", "a", 1, 100, 10, 0.0),
        request("b1", "b", 1, 100, 10, 10.0),
        request("c1", "c", 1, 100, 10, 20.0),
        request("a2", "a", 2, 150, 10, 30.0),
    ], replicas=1, slots=1, cache_tokens=capacity)
    assert done["a2"].cache_n == cached
    assert done["a2"].prompt_n == 150 - cached


def test_scale_up_adds_a_replica_and_scale_down_drains():
    requests = [request(f"q{i}", f"k{i}", 1, 10, 1, float(i)) for i in range(8)]
    done, outcome = run(requests, replicas=1, slots=1, scale=((2.5, 2), (5.5, 1)))
    used = {r.request_id: r.replica for r in done.values()}
    assert {used[f"q{i}"] for i in range(3)} == {"llm-0"}
    assert {used["q3"], used["q4"], used["q5"]} == {"llm-0", "llm-1"}
    assert {used[f"q{i}"] for i in range(6, 8)} == {"llm-0"}
    assert outcome.scale_times == [(0.0, 1), (2.5, 2), (5.5, 1)]
    assert len(done) == 8 and all(r.status == 200 for r in done.values())


def test_no_replica_gives_503_rows():
    done, _ = run([request("z", "a", 1, 10, 1, 1.0)], replicas=0)
    assert (done["z"].status, done["z"].error, done["z"].replica) == (503, "no replica", None)


@pytest.mark.parametrize(("cores", "r1_done", "r2_first", "r2_done"), [(1, 3.0, 3.0, 4.0), (2, 2.0, 2.0, 3.0)])
def test_replicas_on_one_host_share_its_cores(cores, r1_done, r2_first, r2_done):
    # One core: while both replicas are busy (1.0 s to 3.0 s) each runs at half speed.
    # r1: prefill alone 0-1, decode 1.0 s solo at half speed -> 3.0.
    # r2 (from 1.0): 1.0 s solo of prefill by 3.0, then decode alone -> 4.0. Two cores: no slowdown.
    router = Router(settings("round-robin"))
    fleet = Fleet(2, 1, 0, host_cores=cores, replica_threads=1)
    outcome = simulate(OpenLoop([request("r1", "a", 1, 100, 10, 0.0), request("r2", "b", 1, 100, 10, 1.0)]),
                       router, simple_cost(), fleet)
    done = {r.request_id: r for r in outcome.requests}
    assert (done["r1"].first_token_at, done["r1"].finished_at) == pytest.approx((1.0, r1_done))
    assert (done["r2"].first_token_at, done["r2"].finished_at) == pytest.approx((r2_first, r2_done))


def test_requests_ending_on_the_same_wake_up_complete_in_the_order_they_started():
    # One replica, three slots. c starts last but its phases are shortest: it ends first.
    # a and b (identical, started together) end on the same wake-up: recorded in start order.
    done, outcome = run([
        request("a", "a", 1, 100, 10, 0.0),
        request("b", "b", 1, 100, 10, 0.0),
        request("c", "c", 1, 10, 1, 0.0),
    ], replicas=1, slots=3)
    assert [r.request_id for r in outcome.requests] == ["c", "a", "b"]
    assert done["a"].finished_at == done["b"].finished_at
    assert done["c"].finished_at < done["a"].finished_at


class _WatchedRouter(Router):
    """Records, at every decision, which requests the router still holds as in flight."""

    def __init__(self, *args, **kwargs):  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.seen: dict[str, set[str]] = {}

    def route(self, request, avoid=()):  # noqa: ANN001, ANN201
        self.seen[request.request_id] = set(self._in_flight)
        return super().route(request, avoid)


def _closed_loop(*turns: Request, sides: tuple[Request, ...] = ()):  # noqa: ANN202
    for previous, turn in zip(turns, turns[1:], strict=False):
        previous.next, turn.previous = turn, previous
    if sides:
        turns[0].sides, turns[0].waiting = sides, 1 + len(sides)
        for side in sides:
            side.head = turns[0]
    return ClosedLoop([turns[0]], users=1, spawn_rate=1.0, max_duration_s=100.0)


def _turn(name: str, prompt: int, output: int, think: float = 0.0) -> Request:
    return Request(name, "a", int(name[-1]), "a", None, prompt, output, think_s=think)


def test_a_finished_request_is_released_after_the_lag_unless_its_next_turn_comes_first():
    # Lag 0.5 s. t1 ends at 2.0 s and t2 follows at once: t1 is released by t2 itself, before
    # t2's decision. t3 comes 1 s after t2's end: the lag released t2 by then.
    router = _WatchedRouter(settings("llm-aware"))
    t1, t2, t3 = _turn("t1", 100, 10), _turn("t2", 120, 10), _turn("t3", 140, 10, think=1.0)
    outcome = simulate(_closed_loop(t1, t2, t3), router, simple_cost(), Fleet(2, 2, 0, release_lag_s=0.5))
    assert [r.request_id for r in outcome.requests] == ["t1", "t2", "t3"]
    assert t2.arrived_at == t1.finished_at == pytest.approx(2.0)
    assert router.seen == {"t1": set(), "t2": set(), "t3": set()} and router.in_flight() == 0


def test_a_request_of_the_conversation_that_shows_no_answer_sees_its_predecessor_charged():
    # open loop: y follows x in conversation a, but its body shows no history of x's (a trace's
    # requests carry none): x waits for the lag, as the gateway releases only what a body shows answered
    router = _WatchedRouter(settings("llm-aware"))
    x, y = request("x", "a", 1, 10, 1, 0.0), request("y", "a", 2, 10, 1, 0.3)
    simulate(OpenLoop([x, y]), router, simple_cost(), Fleet(2, 2, 0, release_lag_s=0.5))
    assert x.finished_at == pytest.approx(0.2)
    assert router.seen == {"x": set(), "y": {"x"}} and router.in_flight() == 0


def test_another_conversation_sees_a_finished_request_until_the_lag_has_passed():
    # x ends at 0.2 s, released at 0.7 s; y (0.3 s) still sees it. y ends at 0.5 s, released at
    # 1.0 s; z (1.1 s) sees nothing.
    router = _WatchedRouter(settings("bounded"))
    x, y, z = request("x", "a", 1, 10, 1, 0.0), request("y", "b", 1, 10, 1, 0.3), request("z", "c", 1, 10, 1, 1.1)
    simulate(OpenLoop([x, y, z]), router, simple_cost(), Fleet(2, 2, 0, release_lag_s=0.5))
    assert x.finished_at == pytest.approx(0.2)
    assert router.seen == {"x": set(), "y": {"x"}, "z": set()} and router.in_flight() == 0


def test_a_fan_out_is_sent_at_once_and_the_next_turn_waits_for_every_answer():
    # t1 and its two sides go out together; t2 follows the last answer at once. t1 is released
    # by t2 (t2 carries t1's answer); the sides, whose answers t2 does not carry, by the lag.
    router = _WatchedRouter(settings("llm-aware"))
    t1, t2 = _turn("t1", 100, 2), _turn("t2", 150, 2)
    sides = tuple(Request(f"t1-p{k}", f"a/p{k}", 1, "a", None, 100 + 10 * k, 20) for k in (1, 2))
    for side in sides:
        side.route = side.route._replace(conversation="a")
    outcome = simulate(_closed_loop(t1, t2, sides=sides), router, simple_cost(), Fleet(2, 4, 0, release_lag_s=0.5))
    assert {r.arrived_at for r in (t1, *sides)} == {0.0}
    assert t2.arrived_at == max(r.finished_at for r in (t1, *sides)) > t1.finished_at
    recent = {s.request_id for s in sides if s.finished_at > t2.arrived_at - 0.5}
    assert router.seen["t2"] == recent and recent
    assert len(outcome.requests) == 4 and router.in_flight() == 0
