from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.routing import Router, RouteRequest, render_trace
from tests.routing.conftest import key_with_walk, routing

REPLICAS = ["llm-0", "llm-1", "llm-2"]
ops = st.lists(
    st.tuples(st.integers(0, 30), st.integers(1, 3000), st.integers(0, 200), st.booleans()),
    min_size=1, max_size=150,
)


@settings(max_examples=60, deadline=None)
@given(ops, st.sampled_from([0.1, 0.25, 1.0]))
def test_with_every_addition_off_it_decides_exactly_as_bounded_in_tokens(steps, epsilon) -> None:
    plain = routing(policy="llm-aware", cache_aware=False, placement_memory=False,
                    long_stickiness=False, epsilon=epsilon)
    routers = [Router(plain, REPLICAS),
               Router(routing(policy="bounded", load_unit="tokens", epsilon=epsilon), REPLICAS)]
    open_ids: list[str] = []
    for index, (conversation, prompt, max_tokens, complete) in enumerate(steps):
        if complete and open_ids:
            done = open_ids.pop(0)
            for router in routers:
                router.complete(done)
        request = RouteRequest(str(index), f"c{conversation}", prompt, max_tokens)
        a, b = (router.route(request).decision for router in routers)
        assert a is not None and b is not None
        assert (a.replica, a.reason, a.cost, a.charged_tokens) == (b.replica, b.reason, b.cost, b.charged_tokens)
        open_ids.append(str(index))


def test_placement_memory_keeps_a_redirected_conversation_where_its_cache_now_is() -> None:
    router = Router(routing(policy="llm-aware", long_stickiness=False), REPLICAS)
    conversation = key_with_walk(router, "llm-0", "llm-1")
    router.ledger.charge("hot", "llm-0", 5000)
    first = router.route(RouteRequest("t1", conversation, 300, 50)).decision
    assert (first.replica, first.reason) == ("llm-1", "overflow")
    router.complete("t1")
    router.complete("hot")  # llm-0 is idle again: bounded would go back home

    second = router.route(RouteRequest("t2", conversation, 400, 50)).decision
    assert (second.replica, second.reason) == ("llm-1", "sticky")
    assert second.predicted_cached_tokens == 300
    assert second.cost == 100 + 50


def test_a_busy_replica_still_accepts_its_own_cached_conversation() -> None:
    """Cache-aware cost: the cached replica is charged new tokens only, so it still fits."""
    router = Router(routing(policy="llm-aware", long_stickiness=False), REPLICAS)
    conversation = key_with_walk(router, "llm-0")
    router.memory.remember(router.conversation_key(conversation), "llm-0", 1000)
    for name, load in {"llm-0": 1300, "llm-1": 1000, "llm-2": 1000}.items():
        router.ledger.charge(f"bg-{name}", name, load)
    decision = router.route(RouteRequest("r", conversation, 1050, 50)).decision
    assert (decision.replica, decision.reason, decision.cost) == ("llm-0", "home", 100)

    bounded = Router(routing(policy="bounded", load_unit="tokens"), REPLICAS)
    for name, load in {"llm-0": 1300, "llm-1": 1000, "llm-2": 1000}.items():
        bounded.ledger.charge(f"bg-{name}", name, load)
    other = bounded.route(RouteRequest("r", conversation, 1050, 50)).decision
    assert other.replica != "llm-0"


def test_long_stickiness_only_for_long_cached_conversations() -> None:
    router = Router(routing(policy="llm-aware"), REPLICAS)
    short, long_ = key_with_walk(router, "llm-0", "llm-1"), key_with_walk(router, "llm-0", "llm-2")
    assert short != long_
    for name, load in {"llm-0": 2400, "llm-1": 900, "llm-2": 900}.items():
        router.ledger.charge(f"bg-{name}", name, load)
    router.memory.remember(router.conversation_key(short), "llm-0", 500)
    router.memory.remember(router.conversation_key(long_), "llm-0", 820)
    short_decision = router.route(RouteRequest("s", short, 540, 48)).decision
    router.complete("s", ok=False)
    long_decision = router.route(RouteRequest("l", long_, 860, 48)).decision
    assert long_decision is not None
    assert short_decision.trace.details.long_cap is None and short_decision.reason == "overflow"
    assert long_decision.reason == "home-long"


def test_sticky_long_when_the_remembered_replica_is_not_home() -> None:
    router = Router(routing(policy="llm-aware"), REPLICAS)
    conversation = key_with_walk(router, "llm-0")
    router.memory.remember(router.conversation_key(conversation), "llm-1", 900)
    for name, load in {"llm-0": 0, "llm-1": 1200, "llm-2": 900}.items():
        if load:
            router.ledger.charge(f"bg-{name}", name, load)
    decision = router.route(RouteRequest("r", conversation, 950, 48)).decision
    assert (decision.replica, decision.reason) == ("llm-1", "sticky-long")


def test_memory_pointing_at_an_avoided_replica_is_ignored() -> None:
    router = Router(routing(policy="llm-aware"), REPLICAS)
    conversation = key_with_walk(router, "llm-0", "llm-1")
    router.memory.remember(router.conversation_key(conversation), "llm-0", 900)
    decision = router.route(RouteRequest("r", conversation, 950, 48), avoid={"llm-0"}).decision
    assert (decision.replica, decision.reason, decision.predicted_cached_tokens) == ("llm-1", "home", 0)


def test_the_cached_replica_keeps_one_request_of_slack_under_the_cap() -> None:
    """Under the cap before the request, the cached replica takes it even if it ends above."""
    router = Router(routing(policy="llm-aware"), REPLICAS)
    cached, fresh = key_with_walk(router, "llm-0", "llm-1"), key_with_walk(router, "llm-0", "llm-2")
    for name, load in {"llm-0": 300, "llm-1": 200, "llm-2": 200}.items():
        router.ledger.charge(f"bg-{name}", name, load)
    router.memory.remember(router.conversation_key(cached), "llm-0", 250)

    decision = router.route(RouteRequest("c", cached, 270, 16)).decision  # costs 20 + 16 on llm-0
    assert round(decision.trace.details.cap, 1) == 306.7 and decision.trace.details.cap < 300 + 36
    assert (decision.replica, decision.reason, decision.cost) == ("llm-0", "home", 36)
    assert render_trace(decision).endswith(
        "llm-0: 300+36=336 > 306.7 but 300 < 306.7: cached, one request of slack → home")
    router.complete("c", ok=False)

    same_size_no_cache = router.route(RouteRequest("f", fresh, 20, 16)).decision  # also 36, but nothing cached
    assert same_size_no_cache.reason == "overflow"
