"""The field's routers as peer policies: each on a hand-built scenario whose answer follows
from its source's rule (cited per test), plus what every policy owes the Router."""

from __future__ import annotations

import pytest

from extproc.routing import Decision, Router, RouteRequest, Trace, reasons, render_trace
from extproc.routing.blocks import prefix_blocks
from extproc.routing.hashing import stable_hash
from extproc.routing.policies.kv_cost import KvCost
from extproc.routing.policies.prefix_affinity import PrefixAffinity
from extproc.routing.policies.situation import Situation
from extproc.routing.ring import HashRing
from tests.routing.conftest import BASE, routing

PEERS = ["prefix-affinity", "radix-balance", "chwbl", "kv-cost"]
REPLICAS = ["llm-0", "llm-1", "llm-2"]


def blocks(*names: str) -> tuple[int, ...]:
    """Chained blocks standing for prompt pieces: equal names in equal places share blocks."""
    return prefix_blocks("".join(name.ljust(64, ".")[:64] for name in names))


def situation(policy_router: Router, request: RouteRequest) -> Situation:
    ring = policy_router.ring
    return Situation(request, stable_hash(request.conversation), ring, policy_router.ledger, None, frozenset(),
                     ring.replicas, policy_router.speeds, policy_router.residency)


def sent(replica: str, cached: int = 0) -> Decision:
    return Decision(replica, "min-cost", 1, 0, cached, Trace("kv-cost", 0, 0))


@pytest.mark.parametrize("policy", PEERS)
def test_route_then_complete_leaves_nothing_charged_and_every_reason_is_documented(policy: str) -> None:
    router = Router(routing(policy=policy), REPLICAS)
    for index in range(60):
        prompt = blocks("system", f"user-{index % 5}", f"turn-{index}")
        decision = router.route(RouteRequest(str(index), f"c{index % 5}", 300, 16, prompt)).decision
        assert decision.reason in reasons()
        assert 0 <= decision.predicted_cached_tokens <= 300
        assert render_trace(decision).startswith(f"{policy} → {decision.replica}")
        if index >= 6:
            router.complete(str(index - 6))
    for index in range(54, 60):
        router.complete(str(index))
    assert router.ledger.total_requests() == router.ledger.total_tokens() == router.in_flight() == 0
    assert router.policy.prefix_block_chars


@pytest.mark.parametrize("policy", PEERS)
def test_peers_route_requests_without_blocks_and_never_pick_an_avoided_replica(policy: str) -> None:
    router = Router(routing(policy=policy), REPLICAS)
    for index in range(30):
        decision = router.route(RouteRequest(str(index), f"c{index % 4}", 200, 8), avoid={"llm-1"}).decision
        assert decision.replica != "llm-1"
    assert router.route(RouteRequest("none", "c", 10, 1), avoid=set(REPLICAS)) is None


def test_prefix_affinity_scores_three_prefix_two_queue_two_kv() -> None:
    """llm-d defaults.go loadDefaultConfig: prefix-cache-scorer weight 3, queue-scorer 2,
    kv-cache-utilization-scorer 2; prefix/plugin.go Score = MatchBlocks / TotalBlocks;
    queuedepth/queue.go (max - q) / (max - min); max-score picker takes the highest."""
    router = Router(routing(policy="prefix-affinity"), REPLICAS)
    first = router.route(RouteRequest("a", "c", 400, 100, blocks("s", "u1", "a1", "u2"))).decision
    held = first.replica
    follow_up = router.route(RouteRequest("b", "c", 500, 100, blocks("s", "u1", "a1", "u2", "u3"))).decision
    assert follow_up.replica == held  # 3 x 4/5 = 2.4 beats the queue's 2
    scores = {c.replica: c.score for c in follow_up.trace.details.candidates}
    capacity = BASE["prefix-affinity"]["kv_capacity_tokens"]
    assert scores[held] == pytest.approx(3 * 4 / 5 + 2 * 0 + 2 * (1 - 500 / capacity))
    assert all(score == pytest.approx(2 * 1 + 2 * 1) for name, score in scores.items() if name != held)
    other = router.route(RouteRequest("c", "c2", 500, 100, blocks("s", "x1", "x2", "x3", "x4"))).decision
    assert other.replica != held  # 3 x 1/5 = 0.6 < 2 x (queue 2 -> 0 vs 1)


def test_radix_balance_leaves_the_cache_only_when_both_imbalance_thresholds_are_crossed() -> None:
    """SGLang cache_aware.rs select_worker: imbalanced iff max - min > balance_abs_threshold (64)
    and max > min x balance_rel_threshold (1.5): then the least loaded; else the longest tree
    match if match_rate > cache_threshold (0.3), else the least loaded (router_args.py defaults)."""
    router = Router(routing(policy="radix-balance"), REPLICAS)
    prompt = blocks("s", "u", "a", "u2")
    reasons = []
    for index in range(65):
        decision = router.route(RouteRequest(str(index), "c", 400, 10, prompt)).decision
        assert decision.replica == "llm-0"  # first by name, then the match
        reasons.append(decision.reason)
    assert reasons == ["min-load"] + ["cache-match"] * 64  # 64 - 0 is not > 64: still balanced
    spill = router.route(RouteRequest("65", "c", 400, 10, prompt)).decision
    assert (spill.replica, spill.reason) == ("llm-1", "imbalanced")  # 65 - 0 > 64
    router.complete("0")  # 64 - 0 again: balanced, a full match wins despite the load
    # both trees hold it (imbalanced mode inserts too)
    back = router.route(RouteRequest("66", "c", 400, 10, prompt)).decision
    assert back.reason == "cache-match" and back.replica in {"llm-0", "llm-1"}
    weak = router.route(RouteRequest("67", "c", 400, 10, blocks("s", "v", "w", "x"))).decision
    assert weak.reason == "min-load" and weak.replica == "llm-2"  # 1/4 <= 0.3


def test_chwbl_compares_the_load_before_the_request_with_one_and_a_quarter_of_the_mean() -> None:
    """KubeAI balance_chwbl.go chwblLoadOK: ok = load <= (total + 1) / n x loadFactor (1.25,
    model_types.go meanLoadFactor 125); chwblGetAddr walks the ring (256 points per endpoint)."""
    router = Router(routing(policy="chwbl"), ["llm-0", "llm-1", "llm-2", "llm-3"])
    prompt = blocks("opening", "rest")
    walk = list(HashRing(router.replicas, BASE["chwbl"]["replication"], 0).walk(prompt[0]))
    home, second = walk[0], walk[1]
    for index, name in enumerate([home, second, walk[2]]):  # 3 in flight: cap = 4 / 4 x 1.25
        router.ledger.charge(f"x{index}", name, 1)
    at_home = router.route(RouteRequest("r1", "c", 100, 1, prompt)).decision
    assert (at_home.replica, at_home.reason) == (home, "home")  # 1 <= 1.25
    assert at_home.trace.details.cap == pytest.approx(4 / 4 * BASE["chwbl"]["load_factor"])
    router.complete("r1")
    router.ledger.charge("x3", home, 1)  # home 2 of 4 in flight: cap = 5 / 4 x 1.25 = 1.5625
    moved = router.route(RouteRequest("r2", "c", 100, 1, prompt)).decision
    assert (moved.replica, moved.reason) == (second, "overflow")  # 1 <= 1.5625
    assert [(check.replica, check.accepted) for check in moved.trace.details.checks] == [(home, False), (second, True)]


def test_kv_cost_is_prefill_blocks_after_overlap_plus_active_decode_blocks() -> None:
    """Dynamo selector/default.rs worker_logit with config.rs defaults (overlap_score_credit 1,
    prefill_load_scale 1, decode_active_request_weight 0, temperature 0 = lowest cost):
    logit = max(0, raw_prefill_blocks - overlap) + decode_blocks, where selector/mod.rs row()
    gives raw_prefill_blocks = (active prefill tokens + prompt) / block size."""
    router = Router(routing(policy="chwbl"), ["llm-a", "llm-b"])  # only for its ring and ledger
    policy = KvCost(routing(policy="kv-cost").params["kv-cost"])
    policy.set_replicas(router.replicas)
    first = RouteRequest("1", "c", 400, 10, blocks("p1", "p2", "p3", "p4"))  # 100 tokens a block
    policy.routed(first, sent("llm-a"))
    policy.completed(first, sent("llm-a"), True)
    follow_up = RouteRequest("2", "c", 800, 10, blocks("p1", "p2", "p3", "p4", "p5", "p6", "p7", "p8"))
    decision = policy.decide(situation(router, follow_up))
    assert decision is not None and decision.replica == "llm-a"
    assert {c.replica: c.score for c in decision.trace.details.candidates} == {"llm-a": 8 - 4 + 8, "llm-b": 8 + 8}
    busy = RouteRequest("3", "other", 1000, 10, blocks(*(f"q{i}" for i in range(10))))
    policy.routed(busy, sent("llm-a"))  # in flight: 1000 prefill tokens and 10 active blocks on llm-a
    decision = policy.decide(situation(router, follow_up))
    assert decision is not None and decision.replica == "llm-b"
    assert {c.replica: c.score for c in decision.trace.details.candidates} == {"llm-a": 18 - 4 + 10 + 8, "llm-b": 16}
    text = render_trace(decision).splitlines()  # lowest cost first for kv-cost
    assert text[0] == "kv-cost → llm-b (min-cost)"
    assert text[-2:] == ["  llm-b: matched 0 blocks, load 0, score 16.000 ← pick",
                         "  llm-a: matched 4 blocks, load 10, score 32.000"]


def test_prefix_affinity_forgets_the_least_recently_sent_blocks_per_replica() -> None:
    """approximateprefix/indexer.go: one LRU per server (lruCapacityPerServer); a block
    evicted there is no longer matched."""
    policy = PrefixAffinity(routing(policy="prefix-affinity", blocks_per_replica=4).params["prefix-affinity"])
    old, new = blocks("a", "b", "c", "d"), blocks("w", "x", "y", "z")
    policy.routed(RouteRequest("1", "c", 40, 1, old), sent("llm-0"))
    policy.routed(RouteRequest("2", "c", 40, 1, new), sent("llm-0"))
    assert policy.index.matches(old) == (0, {})
    assert policy.index.matches(new) == (4, {"llm-0": 4})


@pytest.mark.parametrize("policy", ["prefix-affinity", "radix-balance", "kv-cost"])
def test_a_removed_replica_leaves_the_view_and_a_switch_starts_from_an_empty_one(policy: str) -> None:
    router = Router(routing(policy=policy), REPLICAS)
    prompt = blocks("system", "question")
    first = router.route(RouteRequest("1", "c", 200, 8, prompt)).decision
    router.complete("1")
    again = router.route(RouteRequest("2", "c", 200, 8, prompt)).decision
    assert again.replica == first.replica and again.predicted_cached_tokens == 200
    router.complete("2")
    router.set_replicas([name for name in REPLICAS if name != first.replica])  # its cache went with it
    moved = router.route(RouteRequest("3", "c", 200, 8, prompt)).decision
    assert moved.replica != first.replica and moved.predicted_cached_tokens == 0
    router.reconfigure(routing(policy=policy, speed_ewma_weight=0.5))  # a new policy object: nothing remembered
    fresh = router.route(RouteRequest("4", "c", 200, 8, prompt)).decision
    assert fresh.predicted_cached_tokens == 0
    router.complete("3")  # routed before the switch: the new view knows nothing of it
    router.complete("4")
    assert router.in_flight() == router.ledger.total_requests() == 0
