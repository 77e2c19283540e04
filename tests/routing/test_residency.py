"""Router mode and sleep as locality: the residency of models on replicas, and llm-aware's use of it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extproc.routing import Router, RouteRequest
from extproc.routing.residency import Residency, Status
from tests.routing.conftest import key_with_walk, routing

REPLICAS = ["llm-0", "llm-1", "llm-2"]
MODELS = ("smollm2", "tiny", "third")


def fleet(capacity: int, loaded: dict[str, str]) -> Router:
    """Three router-mode replicas serving MODELS, ``loaded``: replica -> its one loaded model."""
    router = Router(routing(policy="llm-aware", ttft_decisions=True), REPLICAS)
    for replica in REPLICAS:
        statuses: dict[str, Status] = {model: "unloaded" for model in MODELS}
        if replica in loaded:
            statuses[loaded[replica]] = "loaded"
        router.residency.observe(replica, statuses, capacity)
    return router


def test_a_replica_reporting_nothing_waits_for_nothing() -> None:
    residency = Residency(1.5, 0.8)
    assert not residency.tracked
    assert residency.penalty("llm-0", "tiny") == 0.0 and not residency.cold("llm-0", "tiny")
    assert residency.sent("llm-0", "tiny") is None


def test_waits_by_status_and_the_eviction_charge() -> None:
    residency = Residency(1.5, 0.8)
    residency.observe("llm-0", {"smollm2": "loaded", "tiny": "unloaded", "third": "sleeping"}, 2)
    assert residency.penalty("llm-0", "smollm2") == 0.0
    assert residency.penalty("llm-0", "third") == 0.8  # a wake
    assert residency.penalty("llm-0", "tiny") == 3.0  # two running of two: its load evicts one, loaded again later
    residency.status_changed("llm-0", "third", "unloaded")
    assert residency.penalty("llm-0", "tiny") == 1.5  # room for it
    assert residency.cold("llm-0", "tiny") and not residency.cold("llm-0", "smollm2")


def test_a_send_past_the_capacity_unloads_the_least_recently_used() -> None:
    residency = Residency(1.5, 0.8)
    residency.observe("llm-0", {"smollm2": "loaded", "tiny": "loaded", "third": "unloaded"}, 2)
    residency.sent("llm-0", "smollm2")  # tiny is now the least recently used
    assert residency.sent("llm-0", "third") == "tiny"
    assert residency.statuses("llm-0") == {"smollm2": "loaded", "tiny": "unloaded", "third": "loaded"}


def test_load_times_are_learnt() -> None:
    residency = Residency(1.0, 1.0)
    residency.learn("load", 3.0)
    residency.learn("wake", -1.0)  # a clock that went back: ignored
    assert 1.0 < residency.load_s < 3.0 and residency.wake_s == 1.0


@given(capacity=st.integers(1, 3), sends=st.lists(st.sampled_from(MODELS + ("unknown",)), max_size=40))
def test_the_router_never_believes_more_models_loaded_than_the_capacity(capacity: int, sends: list[str]) -> None:
    residency = Residency(1.0, 1.0)
    residency.observe("llm-0", {model: "unloaded" for model in MODELS}, capacity)
    for model in sends:
        evicted = residency.sent("llm-0", model)
        statuses = residency.statuses("llm-0")
        running = [name for name, status in statuses.items() if status != "unloaded"]
        assert len(running) <= capacity
        if model in MODELS:
            assert statuses[model] == "loaded" and evicted != model
        assert evicted is None or statuses[evicted] == "unloaded"


def test_llm_aware_sends_a_new_conversation_where_its_model_is_loaded() -> None:
    router = fleet(1, {"llm-0": "smollm2", "llm-1": "tiny"})
    conversation = key_with_walk(router, "llm-0", "llm-1", "llm-2")  # its ring home has the other model
    decision = router.route(RouteRequest("r1", conversation, 200, 16, model="tiny")).decision
    assert (decision.replica, decision.reason) == ("llm-1", "warm")
    predicted = dict(decision.trace.details.predicted_ttft_s)
    others = [seconds for name, seconds in predicted.items() if name != "llm-1"]
    assert others and all(seconds > predicted["llm-1"] + 1.0 for seconds in others)  # a load (1.5 s) elsewhere
    # the same request through bounded, which does not look, loads tiny on llm-0
    bounded = Router(routing(policy="bounded"), REPLICAS)
    assert bounded.route(RouteRequest("r1", conversation, 200, 16, model="tiny")).decision.replica == "llm-0"


def test_a_follow_up_whose_model_was_unloaded_has_no_cache_to_keep() -> None:
    router = fleet(1, {"llm-0": "smollm2", "llm-1": "tiny"})
    conversation = key_with_walk(router, "llm-0", "llm-1", "llm-2")
    router.memory.remember(router.conversation_key(conversation), "llm-0", 300)  # served there before
    kept = router.route(RouteRequest("r1", conversation, 340, 16, model="smollm2")).decision
    assert (kept.replica, kept.predicted_cached_tokens) == ("llm-0", 300)
    router.complete("r1")
    router.residency.observe("llm-0", {"smollm2": "unloaded", "tiny": "loaded", "third": "unloaded"}, 1)
    router.residency.observe("llm-1", {"smollm2": "loaded", "tiny": "unloaded", "third": "unloaded"}, 1)
    moved = router.route(RouteRequest("r2", conversation, 380, 16, model="smollm2")).decision
    assert (moved.replica, moved.predicted_cached_tokens) == ("llm-1", 0)


def test_the_router_predicts_its_own_loads_between_reports() -> None:
    router = fleet(1, {"llm-0": "smollm2"})
    first = key_with_walk(router, "llm-2", "llm-1", "llm-0")
    router.route(RouteRequest("r1", first, 40, 16, model="tiny"))  # llm-2, nothing loaded there: it loads
    assert router.residency.statuses("llm-2")["tiny"] == "loaded"
    second = key_with_walk(router, "llm-1", "llm-2", "llm-0")
    decision = router.route(RouteRequest("r2", second, 40, 16, model="tiny")).decision
    assert decision.replica == "llm-2"  # where the first one's load is, not a second load on llm-1


def test_without_a_cache_to_keep_the_walk_starts_where_the_model_is_loaded() -> None:
    router = Router(routing(policy="llm-aware"), REPLICAS)  # the bounded walk alone (no time decision)
    for replica, loaded in (("llm-0", "smollm2"), ("llm-1", "smollm2"), ("llm-2", "tiny")):
        router.residency.observe(replica, {"smollm2": "unloaded", "tiny": "unloaded", loaded: "loaded"}, 1)
    conversation = key_with_walk(router, "llm-2", "llm-0", "llm-1")  # home: tiny loaded there
    decision = router.route(RouteRequest("r1", conversation, 200, 16, model="smollm2")).decision
    assert (decision.replica, decision.reason) == ("llm-0", "warm")  # the first warm one clockwise
    router.ledger.charge("busy", "llm-0", 10_000)  # over the cap: the walk goes on to the next warm one
    decision = router.route(RouteRequest("r2", conversation, 200, 16, model="smollm2")).decision
    assert decision.replica == "llm-1"
    plain = Router(routing(policy="llm-aware"), REPLICAS)  # no replica reports models: its ring home
    assert plain.route(RouteRequest("r1", conversation, 200, 16, model="smollm2")).decision.replica == "llm-2"
