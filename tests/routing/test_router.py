from __future__ import annotations

import typing

import pytest

from extproc.routing import Router, RouteRequest, reasons
from extproc.routing.policies.llm_aware import LlmAware
from extproc.routing.replica_facts import ReplicaFacts
from tests.routing.conftest import routing

REPLICAS = ["llm-0", "llm-1", "llm-2"]


@pytest.mark.parametrize("policy", ["round-robin", "mod-n", "consistent", "bounded", "llm-aware"])
def test_route_then_complete_returns_every_counter_to_zero(policy: str) -> None:
    router = Router(routing(policy=policy), REPLICAS)
    for index in range(50):
        decision = router.route(RouteRequest(str(index), f"c{index % 7}", 100 + index, 32)).decision
        assert decision.reason in reasons()  # every reason is documented
    assert router.ledger.total_requests() == 50
    for index in range(50):
        assert router.complete(str(index)) is not None
        assert router.complete(str(index)) is None  # exactly once
    assert router.ledger.total_requests() == router.ledger.total_tokens() == router.in_flight() == 0


def test_no_replicas_means_no_decision() -> None:
    router = Router(routing(), [])
    assert router.route(RouteRequest("r", "c", 10, 10)) is None
    router.set_replicas(["llm-0"])
    assert router.route(RouteRequest("r", "c", 10, 10), avoid={"llm-0"}) is None


def test_round_robin_rotates_and_mod_n_hashes() -> None:
    rr = Router(routing(policy="round-robin"), REPLICAS)
    picks = [rr.route(RouteRequest(str(i), "same", 10, 1)).decision.replica for i in range(6)]  # type: ignore[union-attr]
    assert picks == REPLICAS * 2
    mod = Router(routing(policy="mod-n"), REPLICAS)
    assert len({mod.route(RouteRequest(str(i), "same", 10, 1)).decision.replica for i in range(6)}) == 1  # type: ignore[union-attr]


def test_avoided_replicas_are_never_picked() -> None:
    for policy in ["round-robin", "mod-n", "consistent", "bounded", "llm-aware"]:
        router = Router(routing(policy=policy), REPLICAS)
        for index in range(30):
            decision = router.route(RouteRequest(f"{policy}{index}", f"c{index}", 50, 5), avoid={"llm-1"}).decision
            assert decision.replica != "llm-1"


def test_a_duplicate_request_id_is_refused() -> None:
    router = Router(routing(), REPLICAS)
    router.route(RouteRequest("r", "c", 10, 1))
    with pytest.raises(ValueError, match="already in flight"):
        router.route(RouteRequest("r", "c", 10, 1))


def test_removing_a_replica_drops_its_load_and_its_requests_complete_harmlessly() -> None:
    router = Router(routing(policy="consistent"), REPLICAS)
    decisions = [router.route(RouteRequest(str(i), f"c{i}", 10, 1)).decision for i in range(30)]
    router.set_replicas(["llm-0", "llm-2"])
    for index, decision in enumerate(decisions):
        assert decision is not None
        completed = router.complete(str(index))
        assert (completed is None) == (decision.replica == "llm-1")
    assert router.ledger.total_requests() == 0


def test_a_ticket_releases_its_request_once_and_never_a_later_request_under_the_same_id() -> None:
    router = Router(routing(), REPLICAS)
    first = router.route(RouteRequest("r", "c", 10, 1))
    assert first is not None and first.held and router.ledger.total_requests() == 1
    assert first.release() and not first.held and router.ledger.total_requests() == 0
    assert not first.release() and router.complete("r") is None  # once, by ticket or by id
    again = router.route(RouteRequest("r", "c", 10, 1))  # the id is free again
    assert again is not None and not first.release() and again.held  # the old ticket is not this request's
    assert router.complete("r") == again.decision and not again.held and not again.release()
    assert router.ledger.total_requests() == router.in_flight() == 0


def test_the_tickets_of_a_replica_that_left_release_nothing_and_its_caches_are_still_found_there() -> None:
    router = Router(routing(policy="consistent"), REPLICAS)
    tickets = [router.route(RouteRequest(str(i), f"c{i}", 10 + i, 1)) for i in range(30)]
    router.set_replicas(["llm-0", "llm-2"])
    gone = [ticket for ticket in tickets if ticket is not None and ticket.decision.replica == "llm-1"]
    assert gone and not any(ticket.held or ticket.release() for ticket in gone)
    # a migration looks for them there: the load went, their caches did not
    assert dict(router.placed_on("llm-1")) == {ticket.key: ticket.request.prompt_tokens for ticket in gone}
    assert all(ticket.release() for ticket in tickets if ticket is not None and ticket not in gone)
    assert router.ledger.total_requests() == router.in_flight() == 0


def test_failed_requests_are_not_remembered() -> None:
    router = Router(routing(), REPLICAS)
    router.route(RouteRequest("r", "c", 10, 1))
    router.complete("r", ok=False)
    assert router.memory.get(router.conversation_key("c")) is None


def test_an_answer_from_another_replica_is_remembered_there() -> None:
    """The proxy failed over: the cache is now where the answer came from, not on the pick."""
    router = Router(routing(), REPLICAS)
    decision = router.route(RouteRequest("r", "c", 10, 1)).decision
    other = next(name for name in REPLICAS if name != decision.replica)
    router.complete("r", ok=True, served=other)
    remembered = router.memory.get(router.conversation_key("c"))
    assert remembered is not None and remembered.replica == other
    assert router.ledger.total_requests() == 0  # the load was charged to the pick and released there


def test_reconfigure_switches_policy_and_keeps_load_reset_forgets() -> None:
    router = Router(routing(policy="bounded"), REPLICAS)
    router.route(RouteRequest("r", "c", 10, 1))
    router.complete("r")
    ticket = router.route(RouteRequest("r2", "c", 10, 1))
    router.reconfigure(routing(policy="round-robin", virtual_nodes=7))
    assert router.policy.name == "round-robin" and router.ledger.total_requests() == 1
    assert ticket is not None and ticket.held
    router.reset()
    assert router.ledger.total_requests() == 0 and router.memory.get(router.conversation_key("c")) is None
    assert router.complete("r2") is None and not ticket.held and not ticket.release()


def test_placement_memory_is_keyed_by_the_ring_hash_and_a_new_seed_starts_it_afresh() -> None:
    router = Router(routing(), REPLICAS)
    router.route(RouteRequest("r", "c", 10, 1))
    router.complete("r")
    assert router.memory.get(router.conversation_key("c")) is not None
    router.reconfigure(routing(hash_seed=7))
    assert len(router.memory) == 0


def test_a_request_is_routed_under_the_key_it_carries() -> None:
    """The key is computed where the request is read and carried: the router does not hash again."""
    router = Router(routing(), REPLICAS)
    unkeyed = RouteRequest("r", "c", 10, 1)
    keyed = router.keyed(unkeyed)
    assert keyed.key == router.conversation_key("c") and router.keyed(keyed) is keyed
    carried = unkeyed._replace(key=router.conversation_key("other"))
    ticket = router.route(carried)
    assert ticket is not None and ticket.key == router.conversation_key("other")
    ticket.release()
    assert router.memory.get(router.conversation_key("other")) is not None
    assert router.memory.get(router.conversation_key("c")) is None
    assert router.route(RouteRequest("r2", "c", 10, 1)).key == keyed.key  # type: ignore[union-attr]  # unkeyed


def test_a_request_readdressed_to_another_conversation_takes_its_key() -> None:
    router = Router(routing(), REPLICAS)
    moved = router.readdressed(router.keyed(RouteRequest("r", "c", 10, 1)), "c-2")
    assert (moved.conversation, moved.key) == ("c-2", router.conversation_key("c-2"))


def test_the_replicas_facts_are_the_router_s_and_its_policy_is_built_with_them() -> None:
    router = Router(routing(prefix_index=True, ttft_decisions=True, slots=3, cache_tokens=5000), REPLICAS)
    assert router.facts("llm-1") == ReplicaFacts(slots=3, cache_tokens=5000)
    policy = typing.cast(LlmAware, router.policy)
    assert policy.index is not None and policy.ttft is not None
    assert (policy.ttft.slots, policy.index.capacity) == (3, 5000)
    router.reconfigure(routing(prefix_index=True, ttft_decisions=True, slots=2, cache_tokens=700))  # Admin.SetRouting
    policy = typing.cast(LlmAware, router.policy)
    assert router.facts("llm-1").slots == 2 and policy.ttft is not None and policy.ttft.slots == 2
    assert policy.index is not None and policy.index.capacity == 700
