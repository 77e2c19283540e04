"""The queue's orders keep their promises (extproc/routing/orders/), under any arrivals
(hypothesis): FIFO serves in arrival order across tenants; round robin takes the backlogged
flows in turn, sorted by id; VTC serves the least counter, oldest first within a flow; least
attained service prefers the flow that was served least; a baseline offers a flow's oldest
request, never a younger one that keeps a cache; and without patience a request whose cache
holder is full goes wherever there is room at once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.routing import Router, RouteRequest
from extproc.routing.flow_control import FlowControl, Queued, Routed
from extproc.routing.flows import Flow
from extproc.routing.orders import ORDERS, make_order
from extproc.routing.orders.least_attained import LeastAttainedService
from extproc.routing.queue import LOCAL, NEW, Choice, FairQueue, Waiting
from tests.routing.conftest import routing
from tests.routing.flow_support import flow_settings

TENANTS = st.sampled_from(["a", "b", "c", "d"])
ARRIVALS = st.lists(st.tuples(TENANTS, st.integers(min_value=1, max_value=400)), min_size=1, max_size=40)


def queued(order: str, arrivals: list[tuple[str, int]]) -> FairQueue:
    """A queue of ``order`` holding one request per arrival (tenant, work as prompt tokens), 1 s apart."""
    queue = FairQueue(band_size=1000, locality_deficit=0.0, order=make_order(order))
    for number, (tenant, prompt) in enumerate(arrivals):
        rid = f"r{number}"
        assert queue.push(Waiting(RouteRequest(rid, rid, prompt, 0), Flow(0, tenant), frozenset(), float(number),
                                  1e9))
    return queue


def drain(queue: FairQueue, now: float = 1000.0) -> list[Choice]:
    """Take every request, one room at a time, each charged its prompt tokens."""
    taken = []
    while (choice := queue.choose(lambda _: ("r0",), lambda _, rooms: NEW, now)) is not None:
        queue.take(choice.waiting, float(choice.waiting.request.prompt_tokens))
        taken.append(choice)
    return taken


@given(ARRIVALS)
def test_fifo_serves_in_arrival_order_whoever_sent(arrivals: list[tuple[str, int]]) -> None:
    taken = drain(queued("fifo", arrivals))
    assert [choice.waiting.arrived for choice in taken] == sorted(float(n) for n in range(len(arrivals)))


@given(ARRIVALS)
def test_round_robin_takes_the_backlogged_flows_in_turn_sorted_by_id(arrivals: list[tuple[str, int]]) -> None:
    taken = drain(queued("round-robin", arrivals))
    left = {tenant: sum(1 for t, _ in arrivals if t == tenant) for tenant, _ in arrivals}
    previous = None
    for choice in taken:
        tenant = choice.waiting.flow.tenant
        waiting = sorted(t for t, n in left.items() if n)
        after = [t for t in waiting if previous is not None and t > previous]
        assert tenant == (after or waiting)[0]  # the next backlogged flow after the last one served
        left[tenant] -= 1
        previous = tenant


@given(ARRIVALS)
def test_vtc_serves_the_least_counter_and_each_flow_oldest_first(arrivals: list[tuple[str, int]]) -> None:
    taken = drain(queued("vtc", arrivals))
    assert all(choice.counter == choice.least for choice in taken)
    for tenant in {tenant for tenant, _ in arrivals}:
        own = [choice.waiting.arrived for choice in taken if choice.waiting.flow.tenant == tenant]
        assert own == sorted(own)


@settings(max_examples=50)
@given(st.dictionaries(TENANTS, st.floats(min_value=0, max_value=1e5), min_size=2))
def test_least_attained_service_prefers_the_flow_served_least(served: dict[str, float]) -> None:
    queue = queued("las", [(tenant, 10) for tenant in served])  # one request each, heads 1 s apart
    order = queue.order
    assert isinstance(order, LeastAttainedService)
    for tenant, work in served.items():
        order.completed(Flow(0, tenant), work, 0.0)
    choice = queue.choose(lambda _: ("r0",), lambda _, rooms: NEW, 0.0)
    assert choice is not None
    least = min(served.values())
    spread = max(served.values()) - least
    # the service weighs 0.8 against the head's wait's 0.2: beyond a quarter of the range, service decides
    assert served[choice.waiting.flow.tenant] <= least + spread / 4


def test_attained_service_halves_every_minute() -> None:
    order = LeastAttainedService()
    order.completed(Flow(0, "a"), 1000.0, 0.0)
    assert order.service(Flow(0, "a"), 60.0) == pytest.approx(500.0)


@pytest.mark.parametrize("name", [name for name in ORDERS if not make_order(name).locality])
def test_a_baseline_offers_the_oldest_request_never_a_younger_one_that_keeps_a_cache(name: str) -> None:
    queue = queued(name, [("a", 10), ("a", 10)])
    choice = queue.choose(lambda _: ("r0",), lambda waiting, rooms: LOCAL if waiting.arrived else NEW)
    assert choice is not None and choice.waiting.arrived == 0.0
    local = queued("vtc-local", [("a", 10), ("a", 10)]).choose(
        lambda _: ("r0",), lambda waiting, rooms: LOCAL if waiting.arrived else NEW)
    assert local is not None and local.waiting.arrived == 1.0  # ours takes the one that keeps its cache


def test_an_unknown_order_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="fifo"):
        make_order("lifo")


def test_without_patience_a_request_whose_holder_is_full_goes_elsewhere_at_once() -> None:
    router = Router(routing(slots=2), ["llm-0", "llm-1"])
    flow_control = FlowControl(router, flow_settings(), "fifo", patience=False)
    for rid in ("f0", "f1", "f2", "f3"):
        assert isinstance(flow_control.admit(RouteRequest(rid, rid, 100, 10), Flow(0, "x"), (), 0.0), Routed)
    holder = router.complete("f0")
    assert holder is not None
    flow_control.released("f0")
    assert isinstance(flow_control.admit(RouteRequest("b", "b", 100, 10), Flow(0, "y"), (), 0.5), Routed)
    elsewhere = next(rid for rid in ("f1", "f2", "f3") if router._in_flight[rid].decision.replica != holder.replica)
    router.complete(elsewhere)
    flow_control.released(elsewhere)
    follow_up = flow_control.admit(RouteRequest("next", "f0", 150, 10), Flow(0, "x"), (), 1.0)
    assert not isinstance(follow_up, Queued)  # with patience it would wait for its holder (test_flow_control)
    assert isinstance(follow_up, Routed) and follow_up.ticket.decision.replica != holder.replica
