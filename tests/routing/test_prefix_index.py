"""llm-aware's prefix index (docs/prefix-index.md): bounded in tokens, prefers the longest
held prefix within the cap, learns from the cached tokens reported, and changes nothing
when off."""

from __future__ import annotations

import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.routing import Router, RouteRequest, render_trace
from extproc.routing.blocks import covered_tokens, prefix_blocks
from extproc.routing.policies.llm_aware import LlmAwarePrefix
from extproc.routing.prefix_views import BlockIndex
from tests.routing.conftest import routing

NAMES = ["llm-0", "llm-1", "llm-2"]
REPLICAS = [f"llm-{i}" for i in range(8)]


def blocks(*names: str) -> tuple[int, ...]:
    """Chained blocks standing for prompt pieces: equal names in equal places share blocks."""
    return prefix_blocks("".join(name.ljust(64, ".")[:64] for name in names))


def index_of(router: Router) -> BlockIndex:
    assert isinstance(router.policy, LlmAwarePrefix)
    return router.policy.index


weighted_sends = st.lists(st.tuples(st.sampled_from(NAMES), st.lists(st.integers(0, 40), max_size=12),
                                    st.integers(1, 300), st.booleans()), max_size=40)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1000), weighted_sends)
def test_the_index_never_holds_more_tokens_than_its_capacity_and_stays_consistent(capacity: int, log) -> None:
    index = BlockIndex(capacity)
    model: dict[str, dict[int, int]] = {name: {} for name in NAMES}  # block -> weight, least recent first
    for replica, sent, weight, forget in log:
        if forget:
            index.forget(replica, sent)
            for block in sent:
                model[replica].pop(block, None)
        else:
            index.add(replica, sent, weight)
            held = model[replica]
            for block in sent:
                held[block] = held.pop(block, weight)
                while sum(held.values()) > capacity:
                    del held[next(iter(held))]
        for name in NAMES:
            assert index.used(name) == sum(model[name].values()) <= capacity
            assert index.size(name) == len(model[name])
    for block in range(41):
        assert set(index.holders(block)) == {name for name in NAMES if block in model[name]}


def test_bytes_per_block_stay_bounded() -> None:
    """Memory is bounded by the capacity: ~ a few hundred bytes a block, whatever was sent."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = BlockIndex(5_000 * 16)  # 5,000 blocks of 16 tokens per replica
    for number in range(400):  # twice what fits on the 8 replicas
        index.add(REPLICAS[number % 8], reversed(blocks("system", f"user-{number}", *(f"t{n}" for n in range(198)))),
                  16)
    held = sum(index.size(name) for name in REPLICAS)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert held == 8 * 5_000
    assert all(index.used(name) == 5_000 * 16 for name in REPLICAS)
    assert grown / held < 600  # measured ~430 bytes a block (its holder set, two dict entries, the hash)


def test_expected_cache_is_the_longest_held_prefix_on_each_candidate_and_the_trace_says_so() -> None:
    router = Router(routing(prefix_index=True, placement_memory=True), NAMES)
    shared = blocks("system", "tools")
    first = router.route(RouteRequest("a", "alice", 600, 10, shared + blocks("alice")[2:]))
    assert first is not None
    router.complete("a")
    # bob shares only the opening with alice: a new conversation, cheaper where alice went
    bob = RouteRequest("b", "bob", 400, 10, shared + blocks("system", "tools", "bob", "more")[2:])
    decision = router.route(bob)
    assert decision is not None and decision.replica == first.replica
    assert decision.predicted_cached_tokens == covered_tokens(400, 4, 2) == 200
    trace = decision.trace
    assert trace.preferred_by in ("prefix", "ring") and trace.cached_tokens == 200 and trace.prompt_blocks == 4
    assert [(c.replica, c.matched_blocks, c.score) for c in trace.candidates] == [(first.replica, 2, 200)]
    assert decision.cost == 400 - 200 + 10  # charged only the new tokens there
    assert "blocks" in render_trace(decision)


def test_an_evicted_prefix_is_not_predicted_while_placement_memory_still_claims_it() -> None:
    capacity = 1000
    router = Router(routing(prefix_index=True, prefix_capacity_tokens=capacity), ["llm-0"])
    alice = blocks("alice", "a1", "a2", "a3")
    router.route(RouteRequest("a1", "alice", 400, 10, alice))
    router.complete("a1")
    for number in range(3):  # 1,200 more tokens: alice's blocks are forgotten
        router.route(RouteRequest(f"x{number}", f"x{number}", 400, 10, blocks(f"x{number}", "1", "2", "3")))
        router.complete(f"x{number}")
    assert index_of(router).used("llm-0") <= capacity
    decision = router.route(RouteRequest("a2", "alice", 500, 10, alice + blocks("alice", "a1", "a2", "a3", "a4")[4:]))
    assert decision is not None and decision.predicted_cached_tokens == 0
    assert decision.trace.remembered == "llm-0"  # placement memory alone would have said 400 cached
    off = Router(routing(prefix_index=False), ["llm-0"])
    off.route(RouteRequest("a1", "alice", 400, 10))
    off.complete("a1")
    again = off.route(RouteRequest("a2", "alice", 500, 10))
    assert again is not None and again.predicted_cached_tokens == 400


def test_a_flood_on_one_system_prompt_stays_under_the_cap_and_reuses_it_where_held() -> None:
    """1,000 conversations open with the same system prompt: a prefix router sends them all
    to its holder; here no replica goes above the cap (one request of slack on the cached
    replica), the prompt spreads, and every replica that holds it is credited with it."""
    epsilon = 0.25
    router = Router(routing(prefix_index=True, long_stickiness=False, epsilon=epsilon), REPLICAS)
    system = ("system",) * 6  # 6 shared blocks
    window = 64  # requests in flight
    reused_on: set[str] = set()
    chosen_count: dict[str, int] = {}
    for number in range(1000):
        prompt = blocks(*system, f"user-{number}", "question")
        held = {name: index_of(router).held_prefix(name, prompt) for name in REPLICAS}
        decision = router.route(RouteRequest(str(number), f"c{number}", 800, 50, prompt))
        assert decision is not None
        chosen_count[decision.replica] = chosen_count.get(decision.replica, 0) + 1
        trace = decision.trace
        assert trace.cap is not None
        chosen = trace.checks[-1] if decision.reason != "least-loaded" else None
        if chosen is not None:  # within the cap, or the cached replica's one request of slack
            assert chosen.replica == decision.replica and chosen.accepted
            assert chosen.load == 0 or chosen.load + chosen.cost <= trace.cap or chosen.load < trace.cap
            assert chosen.limit == trace.cap
        assert decision.predicted_cached_tokens == covered_tokens(800, 8, held[decision.replica])
        if held[decision.replica] >= 6:
            reused_on.add(decision.replica)
            assert decision.cost == 800 - covered_tokens(800, 8, 6) + 50
        if number >= window:
            router.complete(str(number - window))
        loads = router.ledger.loads("tokens")
        average = router.ledger.total_tokens() / len(REPLICAS)
        assert max(loads.values()) <= (1 + epsilon) * average + 850  # at most one request past the cap
    opening = blocks(*system)
    holders = {name for name in REPLICAS if index_of(router).held_prefix(name, opening) == 6}
    assert len(holders) > 1  # one replica could not take the flood: the prefix spread
    assert reused_on == {name for name in holders if chosen_count[name] > 1}  # and was reused wherever it went


requests = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 3000), st.integers(1, 200), st.integers(0, 8),
                              st.booleans()), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(requests)
def test_with_the_index_off_blocks_change_nothing_and_with_no_blocks_the_index_changes_nothing(sent) -> None:
    """Today's llm-aware ignores the blocks; the index falls back to placement memory without them."""
    off = Router(routing(), NAMES)
    off_with_blocks = Router(routing(), NAMES)
    on_without_blocks = Router(routing(prefix_index=True, prefix_feedback=True), NAMES)
    for number, (conversation, prompt, max_tokens, shared, done) in enumerate(sent):
        plain = RouteRequest(str(number), f"c{conversation}", prompt, max_tokens)
        with_blocks = plain._replace(prefix_blocks=blocks(*(["s"] * shared), f"c{conversation}", str(number)))
        reference = off.route(plain)
        assert reference == off_with_blocks.route(with_blocks) == on_without_blocks.route(plain)
        if done and number:
            for router in (off, off_with_blocks, on_without_blocks):
                router.complete(str(number - 1))
                router.report_cached(plain, "llm-0", 100, 0)


def test_a_replica_reporting_less_than_predicted_forgets_the_blocks_past_what_it_reused() -> None:
    prompt = blocks("alice", "a1", "a2", "a3", "a4")  # 5 blocks of 100 tokens
    for feedback in (True, False):
        router = Router(routing(prefix_index=True, prefix_feedback=feedback), ["llm-0"])
        router.route(RouteRequest("1", "alice", 500, 10, prompt))
        router.complete("1")
        second = RouteRequest("2", "alice", 500, 10, prompt)
        decision = router.route(second)
        assert decision is not None and decision.predicted_cached_tokens == 500
        router.complete("2")
        router.report_cached(second, "llm-0", 500, 230)  # it found 2 whole blocks and a bit
        assert index_of(router).held_prefix("llm-0", prompt) == (2 if feedback else 5)
        third = router.route(RouteRequest("3", "alice", 500, 10, prompt))
        assert third is not None
        assert third.predicted_cached_tokens == (200 if feedback else 500)


def test_a_report_at_or_above_the_prediction_or_from_an_unknown_replica_changes_nothing() -> None:
    prompt = blocks("alice", "a1", "a2")
    router = Router(routing(prefix_index=True, prefix_feedback=True), ["llm-0", "llm-1"])
    request = RouteRequest("1", "alice", 300, 10, prompt)
    decision = router.route(request)
    assert decision is not None
    router.complete("1")
    router.report_cached(request, decision.replica, 0, 0)
    router.report_cached(request, "gone", 300, 0)
    router.report_cached(request, decision.replica, 300, -5)  # nonsense from a replica: ignored
    router.report_cached(request._replace(prompt_tokens=0), decision.replica, 300, 0)
    assert index_of(router).held_prefix(decision.replica, prompt) == 3


prompts = st.lists(st.tuples(st.sampled_from(NAMES), st.integers(0, 3), st.integers(0, 6), st.integers(0, 12)),
                   max_size=40)


def replay(capacity: int, log, gaps: bool) -> tuple[BlockIndex, BlockIndex, list[tuple[int, ...]]]:
    """The same prompts through add_prompt and through add (tail first); with ``gaps`` some
    prompts first lose a middle block (the closed loop's forget) and repeat their first id."""
    index, plain = BlockIndex(capacity), BlockIndex(capacity)
    chains = []
    for replica, opening, middle, length in log:
        chain = blocks(f"o{opening}", *(f"m{middle}" for _ in range(3)), *(str(n) for n in range(length)))
        if gaps and length % 3 == 2:
            index.forget(replica, chain[1:2])
            plain.forget(replica, chain[1:2])
            chain = chain + chain[:1]
        chains.append(chain)
        index.add_prompt(replica, chain, 3)
        plain.add(replica, reversed(chain), 3)
        for name in NAMES:
            assert list(index._sent.get(name, {}).items()) == list(plain._sent.get(name, {}).items())
            assert index.used(name) == plain.used(name) <= capacity
    return index, plain, chains


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), prompts)
def test_whole_prompts_added_tail_first_stay_prefix_closed_so_the_binary_searches_agree_with_the_walks(
        capacity: int, log) -> None:
    index, _, chains = replay(capacity, log, gaps=False)
    for known in chains:
        assert {name: held for held, names in index.holders_by_depth(known) for name in names} == index.leading_matches(known)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), prompts)
def test_add_prompt_is_add_tail_first_even_with_gaps_and_repeated_ids(capacity: int, log) -> None:
    replay(capacity, log, gaps=True)  # asserts after every prompt


def test_the_rendered_trace_names_the_index_as_the_reason_for_the_preference() -> None:
    router = Router(routing(prefix_index=True), NAMES)
    first = router.route(RouteRequest("a", "alice", 600, 10, blocks("system", "tools", "alice", "x")))
    assert first is not None
    router.complete("a")
    for number in range(50):  # some conversation whose ring home is elsewhere
        decision = router.route(RouteRequest(f"b{number}", f"bob{number}", 600, 10,
                                             blocks("system", "tools", f"bob{number}", "y")))
        assert decision is not None
        router.complete(f"b{number}")
        if decision.trace.home != first.replica:
            break
    assert decision.reason == "prefix" and decision.replica == first.replica
    text = render_trace(decision)
    assert f"prefix index: {first.replica} holds the longest prefix (300 of 600 tokens; ring home " in text
    assert f"{first.replica}: matched 2 blocks" in text
