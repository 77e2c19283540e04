"""The seed's two example decision traces, rebuilt from the same inputs."""

from __future__ import annotations

from extproc.routing import Router, RouteRequest, render_trace
from tests.routing.conftest import key_with_walk, routing

LOADS = {"llm-0": 2400, "llm-1": 900, "llm-2": 900}


def loaded_router(policy: str, **overrides: object) -> Router:
    router = Router(routing(policy=policy, **overrides), LOADS)
    for name, tokens in LOADS.items():
        router.ledger.charge(f"background-{name}", name, tokens)
    return router


def test_llm_aware_keeps_long_cached_conversation_home_above_normal_cap() -> None:
    router = loaded_router("llm-aware")
    conversation = key_with_walk(router, "llm-0", "llm-2")
    router.memory.remember(router.conversation_key(conversation), "llm-0", 820)

    decision = router.route(RouteRequest("r1", conversation, prompt_tokens=860, max_tokens=48)).decision

    assert (decision.replica, decision.reason, decision.cost) == ("llm-0", "home-long", 88)
    assert decision.predicted_cached_tokens == 820
    assert render_trace(decision) == "\n".join([
        "llm-aware → llm-0 (home-long)",
        "  placement memory: last served on llm-0 with 820 prompt tokens → preferred=llm-0",
        "  cost on llm-0: max(1, 860-820)=40 + 48 = 88 (new tokens only, cache hit)",
        "  load (tokens): llm-0=2400 llm-1=900 llm-2=900; +88 → total=4288, avg=1429.3, cap=1786.7",
        "  long stickiness: prompt_tokens=860 ≥ 800 and cache_likely=True → long_cap=2858.7",
        "  llm-0: 2400+88=2488 ≤ long_cap=2858.7 (> normal cap=1786.7) → home-long",
    ])


def test_bounded_tokens_redirects_the_same_request_away_from_its_cache() -> None:
    router = loaded_router("bounded", load_unit="tokens")
    conversation = key_with_walk(router, "llm-0", "llm-2")
    router.memory.remember(router.conversation_key(conversation), "llm-0", 820)

    decision = router.route(RouteRequest("r1", conversation, prompt_tokens=860, max_tokens=48)).decision

    assert (decision.replica, decision.reason, decision.cost) == ("llm-2", "overflow", 908)
    assert decision.predicted_cached_tokens == 0  # its cache is on llm-0
    assert render_trace(decision) == "\n".join([
        "bounded (token mode) → llm-2 (overflow)",
        "  load (tokens): llm-0=2400 llm-1=900 llm-2=900; with this request total=5108, cap=2128.3",
        "  llm-0: 2400+908=3308 > 2128.3 → skip",
        "  llm-2: 900+908=1808 ≤ 2128.3 → overflow",
    ])


def test_trace_is_data_with_every_number() -> None:
    router = loaded_router("llm-aware")
    conversation = key_with_walk(router, "llm-0")
    router.memory.remember(router.conversation_key(conversation), "llm-0", 820)
    decision = router.route(RouteRequest("r1", conversation, 860, 48)).decision
    data = decision.trace.as_dict()
    assert data["loads"] == LOADS
    assert data["total"] == 4288
    assert round(data["cap"], 1) == 1786.7
    assert round(data["long_cap"], 1) == 2858.7
    assert data["preferred_by"] == "memory"
    assert data["checks"] == [{"replica": "llm-0", "load": 2400, "cost": 88, "limit": data["long_cap"],
                               "accepted": True, "long_limit": True}]
