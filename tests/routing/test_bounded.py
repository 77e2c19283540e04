"""Consistent hashing with bounded loads: the cap and what it guarantees."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.routing import Router, RouteRequest
from tests.routing.conftest import key_with_walk, routing

replica_counts = st.integers(min_value=1, max_value=8)
epsilons = st.sampled_from([0.05, 0.1, 0.25, 0.5, 1.0])
# each step: (conversation index, prompt tokens, complete-an-earlier-request?)
steps = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 3000), st.booleans()),
                 min_size=1, max_size=120)


@settings(max_examples=60, deadline=None)
@given(replica_counts, epsilons, steps, st.sampled_from(["requests", "tokens"]))
def test_never_above_the_cap_while_a_replica_under_it_exists(n, epsilon, ops, unit) -> None:
    router = Router(routing(policy="bounded", epsilon=epsilon, load_unit=unit),
                    [f"llm-{i}" for i in range(n)])
    open_ids: list[str] = []
    for index, (conversation, prompt, complete) in enumerate(ops):
        if complete and open_ids:
            router.complete(open_ids.pop(0))
        loads = dict(router.ledger.loads(unit))
        decision = router.route(RouteRequest(str(index), f"c{conversation}", prompt, 16)).decision
        open_ids.append(str(index))
        cap = decision.trace.details.cap
        fits = [name for name, load in loads.items() if load + decision.cost <= cap]
        if fits:
            assert loads[decision.replica] + decision.cost <= cap
            assert decision.reason in ("home", "overflow")
        elif decision.reason != "least-loaded":  # only an idle replica may take it above the cap
            assert loads[decision.replica] == 0


@settings(max_examples=60, deadline=None)
@given(replica_counts, epsilons, st.lists(st.integers(0, 10_000), min_size=1, max_size=300))
def test_request_mode_max_load_within_paper_bound(n, epsilon, conversations) -> None:
    router = Router(routing(policy="bounded", epsilon=epsilon, load_unit="requests"),
                    [f"llm-{i}" for i in range(n)])
    for index, conversation in enumerate(conversations):
        router.route(RouteRequest(str(index), f"c{conversation}", 100, 16))
        m = index + 1
        bound = math.ceil((1 + epsilon) * m / n - 1e-9)
        assert max(router.ledger.loads("requests").values()) <= bound


def test_average_includes_the_new_request() -> None:
    """3 replicas, loads 1/0/0 requests; the new request makes total 2, avg 2/3, cap ⌈1.25·2/3⌉ = 1."""
    router = Router(routing(policy="bounded", load_unit="requests"), ["llm-0", "llm-1", "llm-2"])
    conversation = key_with_walk(router, "llm-0", "llm-1")
    router.ledger.charge("busy", "llm-0", 10)
    decision = router.route(RouteRequest("r", conversation, 10, 1)).decision
    assert decision.trace.details.total == 2
    assert decision.trace.details.average == 2 / 3
    assert decision.trace.details.cap == 1
    assert (decision.replica, decision.reason) == ("llm-1", "overflow")


def test_light_traffic_goes_home_even_when_one_request_exceeds_its_token_share() -> None:
    router = Router(routing(policy="bounded", load_unit="tokens"), ["llm-0", "llm-1", "llm-2"])
    conversation = key_with_walk(router, "llm-2")
    decision = router.route(RouteRequest("r", conversation, 900, 100)).decision
    assert decision.trace.details.cap < 1000  # 1.25 x 1000 / 3
    assert (decision.replica, decision.reason) == ("llm-2", "home")


def test_everyone_over_the_cap_takes_the_least_loaded() -> None:
    router = Router(routing(policy="bounded", load_unit="tokens"), ["llm-0", "llm-1", "llm-2"])
    for name, load in {"llm-0": 100, "llm-1": 50, "llm-2": 80}.items():
        router.ledger.charge(f"bg-{name}", name, load)
    decision = router.route(RouteRequest("r", key_with_walk(router, "llm-0"), 5000, 0)).decision
    assert (decision.replica, decision.reason) == ("llm-1", "least-loaded")
