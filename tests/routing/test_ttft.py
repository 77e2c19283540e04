"""llm-aware on predicted time to first token, with each replica's learnt speed."""

from __future__ import annotations

from extproc.routing import Router, RouteRequest, render_trace
from extproc.routing.speeds import AnswerTimings
from tests.routing.conftest import key_with_walk, routing

REPLICAS = ["llm-0", "llm-1", "llm-2"]


def timed(**knobs: object) -> Router:
    return Router(routing(policy="llm-aware", ttft_decisions=True, **knobs), REPLICAS)


def busy(router: Router, replica: str, requests: int, tokens: int) -> None:
    for number in range(requests):
        router.ledger.charge(f"bg-{replica}-{number}", replica, tokens // requests)


def test_a_follow_up_stays_with_its_cache_beside_a_long_prefill_on_an_idle_fleet() -> None:
    router = timed()
    conversation = key_with_walk(router, "llm-0", "llm-1")
    router.memory.remember(router.conversation_key(conversation), "llm-0", 400)
    busy(router, "llm-0", 1, 1200)  # one document's prefill; the others idle
    decision = router.route(RouteRequest("r", conversation, 440, 8)).decision
    assert (decision.replica, decision.reason) == ("llm-0", "home")
    predicted = dict(decision.trace.details.predicted_ttft_s)
    # it shares llm-0 with one request (delayed by at most its own 48 tokens) against 448 tokens elsewhere
    assert predicted["llm-0"] < predicted["llm-1"]
    assert decision.trace.details.checks == ()  # the walk was not asked
    assert "predicted first token: llm-0=" in render_trace(decision)
    # the bounded walk alone sends it away: 1200 + 48 > (1 + ε) × average
    walk = Router(routing(policy="llm-aware", ttft_decisions=False, long_stickiness=False), REPLICAS)
    walk.memory.remember(walk.conversation_key(conversation), "llm-0", 400)
    busy(walk, "llm-0", 1, 1200)
    moved = walk.route(RouteRequest("r", conversation, 440, 8)).decision
    assert moved.reason == "overflow"


def test_it_moves_only_when_predicted_faster_by_the_margin() -> None:
    def pick(margin: float, queued: int) -> tuple[str, str]:
        router = timed(ttft_margin=margin, slots=4, ttft_guard_factor=100.0, ttft_recompute_cost=False)
        conversation = key_with_walk(router, "llm-0", "llm-1")
        router.memory.remember(router.conversation_key(conversation), "llm-0", 400)
        busy(router, "llm-0", 4, queued)  # all slots taken: it waits behind all of it
        decision = router.route(RouteRequest("r", conversation, 440, 8)).decision
        return decision.replica, decision.reason

    # stay: queued + 48 tokens; move: 448 tokens. Margin 1: move once 448 × 2 < queued + 48
    assert pick(1.0, 800) == ("llm-0", "home")
    assert pick(1.0, 900) != ("llm-0", "home")
    assert pick(1.0, 900)[1] == "faster"
    assert pick(0.0, 500)[1] == "faster"


def test_a_move_pays_the_tokens_it_computes_again() -> None:
    def reason(recompute: bool) -> str:
        router = timed(ttft_margin=0.0, slots=4, ttft_guard_factor=100.0, ttft_recompute_cost=recompute)
        conversation = key_with_walk(router, "llm-0", "llm-1")
        router.memory.remember(router.conversation_key(conversation), "llm-0", 400)
        busy(router, "llm-0", 4, 600)
        decision = router.route(RouteRequest("r", conversation, 440, 8)).decision
        return decision.reason

    # stay 648 tokens; move 448, plus the 400 cached tokens computed again: 848
    assert (reason(False), reason(True)) == ("faster", "home")


def test_past_the_guard_rail_the_bounded_walk_decides() -> None:
    light = timed(ttft_guard_factor=1.5)
    cached = key_with_walk(light, "llm-0")
    light.memory.remember(light.conversation_key(cached), "llm-0", 400)
    busy(light, "llm-0", 1, 3000)  # past it in tokens, but one long prefill on a light fleet is no imbalance
    decision = light.route(RouteRequest("r", cached, 440, 8)).decision
    assert decision.trace.details.predicted_ttft_s and decision.replica == "llm-0"

    router = timed(ttft_guard_factor=1.5, long_stickiness=False)
    conversation = key_with_walk(router, "llm-0", "llm-1")
    router.memory.remember(router.conversation_key(conversation), "llm-0", 400)
    busy(router, "llm-0", 4, 3000)  # past 1.5 x the average in tokens and in requests
    busy(router, "llm-1", 1, 100)
    decision = router.route(RouteRequest("r", conversation, 440, 8)).decision
    assert decision.trace.details.checks and decision.trace.details.predicted_ttft_s == ()
    assert decision.reason == "overflow"


def test_a_full_replica_makes_a_request_wait_behind_all_its_work() -> None:
    def predicted(slots: int) -> float:
        router = timed(slots=slots)
        conversation = key_with_walk(router, "llm-0")
        busy(router, "llm-0", 2, 2000)
        busy(router, "llm-1", 2, 2000)
        busy(router, "llm-2", 2, 2000)
        decision = router.route(RouteRequest("r", conversation, 100, 8)).decision
        return dict(decision.trace.details.predicted_ttft_s)[decision.replica]

    prior = 1 / 167
    assert abs(predicted(4) - (0.019 + (2 * 108 + 108) * prior)) < 1e-9  # shares: each delays it by 108 at most
    assert abs(predicted(2) - (0.019 + (2000 + 108) * prior)) < 1e-9  # full: behind all 2000


def test_new_conversations_go_to_the_replica_learnt_faster() -> None:
    router = timed()
    for number in range(50):  # llm-2 answers three times faster than the others
        for name, factor in (("llm-0", 1.0), ("llm-1", 1.0), ("llm-2", 1 / 3)):
            tokens = 100 + 10 * number
            router.report_cached(RouteRequest(f"{name}-{number}", "x", 100, 8), name, 0, 0,
                                 AnswerTimings(tokens, tokens / 167 * factor * 1000, 8, 48.0, 0))
    assert router.speeds.answers["llm-2"] == 50
    picks = set()
    for number in range(10):
        decision = router.route(RouteRequest(f"n{number}", f"new-{number}", 600, 8)).decision
        picks.add(decision.replica)
        router.complete(f"n{number}")
    assert picks == {"llm-2"}


def test_reconfigure_keeps_the_learnt_speeds_unless_the_prior_changes() -> None:
    router = timed()
    router.report_cached(RouteRequest("a", "x", 100, 8), "llm-1", 0, 0, AnswerTimings(500, 100.0, 8, 80.0, 0))
    learnt = router.speeds.speed("llm-1")
    router.reconfigure(routing(policy="llm-aware", ttft_decisions=True, ttft_margin=0.5))
    assert router.speeds.speed("llm-1") == learnt
    router.reconfigure(routing(policy="llm-aware", ttft_decisions=True, prior_prefill_tokens_per_s=1000.0))
    assert router.speeds.speed("llm-1").prefill_s_per_token == 1 / 1000
    router.report_cached(RouteRequest("b", "x", 100, 8), "gone", 0, 0, AnswerTimings(500, 100.0, 8, 80.0, 0))
    assert "gone" not in router.speeds.speeds()


def test_the_prefix_index_predicts_the_last_prompt_where_it_was_served() -> None:
    """Blocks are whole only: the index counts them as covering the prompt; placement memory knows
    the last prompt's length, tail included, and that nothing of this turn's text is cached."""
    router = Router(routing(policy="llm-aware", ttft_decisions=True, prefix_index=True), REPLICAS)
    first = RouteRequest("t1", "c", 86, 8, (11,))  # one whole block of 64 tokens and a tail
    made = router.route(first).decision
    router.complete("t1")
    follow = router.route(RouteRequest("t2", "c", 127, 8, (11,))).decision  # the same one whole block
    assert follow.replica == made.replica
    assert follow.predicted_cached_tokens == 86 and follow.cost == 127 - 86 + 8
    deeper = router.route(RouteRequest("t3", "other", 300, 8, (11, 12, 13, 14))).decision  # a prompt never served
    assert deeper.predicted_cached_tokens == 75  # one block of four


def test_a_large_fleet_weighs_a_few_candidates_the_fastest_among_them() -> None:
    names = [f"llm-{number}" for number in range(40)]
    router = Router(routing(policy="llm-aware", ttft_decisions=True), names)
    for number in range(30):  # llm-17 learnt ten times faster than the prior; llm-3 slower
        tokens = 100 + 50 * number
        for name, factor in (("llm-17", 1 / 10), ("llm-3", 2.0)):
            router.report_cached(RouteRequest(f"{name}-{number}", "x", 100, 8), name, 0, 0,
                                 AnswerTimings(tokens, tokens / 167 * factor * 1000, 8, 48.0, 0))
    assert router.speeds.fastest == "llm-17"
    decision = router.route(RouteRequest("r", key_with_walk(router, "llm-0"), 600, 8)).decision
    assert (decision.replica, decision.reason) == ("llm-17", "faster")
    for number in range(100):  # it slows down past llm-3: of the replicas that answered, llm-3 is the fastest
        router.report_cached(RouteRequest(f"s{number}", "x", 100, 8), "llm-17", 0, 0,
                             AnswerTimings(100 + number, (100 + number) / 167 * 5000, 8, 48.0, 0))
    assert router.speeds.fastest == "llm-3"


def test_a_replica_that_answered_a_few_short_prompts_is_not_starved() -> None:
    """A CPU prior on a fleet of fast replicas: one that answered only short prompts (which fix no
    slope) is taken as fast as the fleet, so a new conversation stays on its ring home there
    (before: it was learnt near the prior, 150 times slower, and every request moved away)."""
    names = [f"llm-{number}" for number in range(16)]
    router = Router(routing(policy="llm-aware", ttft_decisions=True), names)
    fast = 1 / 30_000  # s per token, 180 times the prior's speed

    def answer(name: str, number: int, tokens: int) -> None:
        router.report_cached(RouteRequest(f"{name}-{number}", "x", tokens, 8), name, 0, 0,
                             AnswerTimings(tokens, (0.01 + tokens * fast) * 1000, 8, 48.0, 0))

    for name in names[:-1]:
        for number in range(20):
            answer(name, number, 1_000 + 500 * number)
    for number in range(3):
        answer("llm-15", number, 40 + number)
    assert router.speeds.speed("llm-15") == router.speeds.fleet
    decision = router.route(RouteRequest("new", key_with_walk(router, "llm-15"), 2_000, 8)).decision
    assert (decision.replica, decision.reason) == ("llm-15", "home")
