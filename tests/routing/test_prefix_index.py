"""llm-aware's prefix index (docs/prefix-index.md): bounded in tokens, prefers the longest
held prefix within the cap, learns from the cached tokens reported, and changes nothing
when off."""

from __future__ import annotations

import tracemalloc

from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from extproc.routing import Router, RouteRequest, reasons, render_trace
from extproc.routing.blocks import covered_tokens, prefix_blocks
from extproc.routing.policies.llm_aware import IndexView, LlmAware, LlmAwareTrace
from extproc.routing.prefix_index import PrefixIndex
from extproc.routing.prefix_views import BlockIndex
from tests.routing.conftest import key_with_walk, routing

NAMES = ["llm-0", "llm-1", "llm-2"]
REPLICAS = [f"llm-{i}" for i in range(8)]


def blocks(*names: str) -> tuple[int, ...]:
    """Chained blocks standing for prompt pieces: equal names in equal places share blocks."""
    return prefix_blocks("".join(name.ljust(64, ".")[:64] for name in names))


def holders_by_depth(index: PrefixIndex, chain: tuple[int, ...]) -> list[tuple[int, tuple[str, ...]]]:
    return [(depth, index.names(bits)) for depth, bits in index.lookup(chain)]


def index_of(router: Router) -> PrefixIndex:
    assert isinstance(router.policy, LlmAware) and router.policy.index is not None
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
    index = PrefixIndex(5_000 * 16)  # 5,000 blocks of 16 tokens per replica
    for number in range(400):  # twice what fits on the 8 replicas
        index.add_prompt(REPLICAS[number % 8], blocks("system", f"user-{number}", *(f"t{n}" for n in range(198))), 16)
    held = sum(index.size(name) for name in REPLICAS)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert held == 8 * 5_000
    assert all(index.used(name) == 5_000 * 16 for name in REPLICAS)
    assert grown / held < 600  # measured ~400 bytes a block (its holder set, three dict entries, the hash)


def test_expected_cache_is_the_longest_held_prefix_on_each_candidate_and_the_trace_says_so() -> None:
    router = Router(routing(prefix_index=True, placement_memory=True), NAMES)
    shared = blocks("system", "tools")
    first = router.route(RouteRequest("a", "alice", 600, 10, shared + blocks("alice")[2:])).decision
    router.complete("a")
    # bob shares only the opening with alice: a new conversation, cheaper where alice went
    bob = RouteRequest("b", "bob", 400, 10, shared + blocks("system", "tools", "bob", "more")[2:])
    decision = router.route(bob).decision
    assert decision.replica == first.replica
    assert decision.predicted_cached_tokens == covered_tokens(400, 4, 2) == 200
    trace = decision.trace.details
    assert trace.preferred_by in ("prefix", "ring") and trace.cached_tokens == 200 and trace.prompt_blocks == 4
    assert [(c.replica, c.matched_blocks, c.score) for c in trace.candidates] == [(first.replica, 2, 200)]
    assert decision.cost == 400 - 200 + 10  # charged only the new tokens there
    assert "blocks" in render_trace(decision)


def test_a_turn_after_one_too_short_for_a_block_keeps_to_placement_memory() -> None:
    """The index never saw a prompt shorter than a block; placement memory did."""
    router = Router(routing(prefix_index=True), NAMES)
    first = router.route(RouteRequest("b1", "bob", 12, 10, ())).decision  # too short for one block
    router.complete("b1")
    home = router.ring.home(router.conversation_key("bob"))
    for number in range(3):  # other prompts go somewhere; bob's replica holds nothing of bob's
        router.route(RouteRequest(f"x{number}", f"x{number}", 400, 10, blocks(f"x{number}", "1")))
        router.complete(f"x{number}")
    follow_up = router.route(RouteRequest("b2", "bob", 300, 10, blocks("bob", "b1"))).decision  # 2 blocks of 150 tokens
    assert follow_up.replica == first.replica and follow_up.predicted_cached_tokens == 12
    assert follow_up.trace.details.preferred_by == "memory"
    assert follow_up.reason == ("home" if first.replica == home else "sticky")
    # once the last prompt had a block, only the index speaks: here it holds none of it
    router.complete("b2")
    router.set_replicas([name for name in NAMES if name != first.replica])
    router.set_replicas(NAMES)  # the replica came back empty; placement memory still names it
    again = router.route(RouteRequest("b3", "bob", 400, 10, blocks("bob", "b1", "b2"))).decision
    assert again.predicted_cached_tokens == 0


def test_an_evicted_prefix_is_not_predicted_while_placement_memory_still_claims_it() -> None:
    capacity = 1000
    router = Router(routing(prefix_index=True, cache_tokens=capacity), ["llm-0"])
    alice = blocks("alice", "a1", "a2", "a3")
    router.route(RouteRequest("a1", "alice", 400, 10, alice))
    router.complete("a1")
    for number in range(3):  # 1,200 more tokens: alice's blocks are forgotten
        router.route(RouteRequest(f"x{number}", f"x{number}", 400, 10, blocks(f"x{number}", "1", "2", "3")))
        router.complete(f"x{number}")
    assert index_of(router).used("llm-0") <= capacity
    follow_up = RouteRequest("a2", "alice", 500, 10, alice + blocks("alice", "a1", "a2", "a3", "a4")[4:])
    decision = router.route(follow_up).decision
    assert decision.predicted_cached_tokens == 0
    assert decision.trace.details.remembered == "llm-0"  # placement memory alone would have said 400 cached
    off = Router(routing(prefix_index=False), ["llm-0"])
    off.route(RouteRequest("a1", "alice", 400, 10))
    off.complete("a1")
    again = off.route(RouteRequest("a2", "alice", 500, 10)).decision
    assert again.predicted_cached_tokens == 400


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
        decision = router.route(RouteRequest(str(number), f"c{number}", 800, 50, prompt)).decision
        assert decision is not None
        chosen_count[decision.replica] = chosen_count.get(decision.replica, 0) + 1
        trace = decision.trace.details
        assert trace.cap is not None
        chosen = trace.checks[-1] if decision.reason not in ("least-loaded", "kept") else None
        if chosen is not None:  # within the cap, the cached replica's one request of slack, or its cap in requests
            assert chosen.replica == decision.replica and chosen.accepted
            assert chosen.load == 0 or chosen.load + chosen.cost <= trace.cap or chosen.load < trace.cap or (
                decision.reason.endswith("-requests") and within_requests_cap(trace))
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
        reference = off.route(plain).decision
        assert reference == off_with_blocks.route(with_blocks).decision == on_without_blocks.route(plain).decision
        if done and number:
            for router in (off, off_with_blocks, on_without_blocks):
                router.complete(str(number - 1))
                router.report_cached(plain, "llm-0", 100, 0)


def test_a_replica_reporting_whole_blocks_missing_gets_a_smaller_capacity_and_keeps_the_prompt() -> None:
    """The missing blocks were forgotten by the replica, not by the request that just cached
    them again: the replica's capacity drops by their tokens and its oldest blocks go."""
    old, prompt = blocks("bob", "b1", "b2"), blocks("alice", "a1", "a2", "a3", "a4")  # 100 tokens a block
    for feedback in (True, False):
        router = Router(routing(prefix_index=True, prefix_feedback=feedback, cache_tokens=1000), ["llm-0"])
        for number, (conversation, sent) in enumerate((("bob", old), ("alice", prompt))):
            router.route(RouteRequest(str(number), conversation, 100 * len(sent), 10, sent))
            router.complete(str(number))
        second = RouteRequest("2", "alice", 500, 10, prompt)
        decision = router.route(second).decision
        assert decision.predicted_cached_tokens == 500
        router.complete("2")
        router.report_cached(second, "llm-0", 500, 30)  # part of its first block: 4 whole blocks missing
        index = index_of(router)
        assert index.capacity_of("llm-0") == (1000 - 400 if feedback else 1000)
        assert index.held_prefix("llm-0", prompt) == 5  # served: all of it is cached now
        assert index.held_prefix("llm-0", old) == (1 if feedback else 3)  # the least recent went, from its end
        assert index.used("llm-0") <= index.capacity_of("llm-0")


def test_a_paged_servers_partial_last_block_is_not_taken_for_a_missing_block() -> None:
    """Blocks covering less than the prompt (whole 512-token blocks of a 1,300-token prompt):
    a report of every block cached, short of the prediction by the tail, shrinks nothing."""
    prompt = blocks("a", "b")  # 2 whole blocks of 512 tokens, a 276-token tail the router has no block for
    router = Router(routing(prefix_index=True, prefix_feedback=True, cache_tokens=5000), ["llm-0"])
    router.route(RouteRequest("1", "alice", 1300, 10, prompt))
    router.complete("1")
    second = RouteRequest("2", "alice", 1300, 10, prompt)
    decision = router.route(second).decision
    assert decision.predicted_cached_tokens == 1300
    router.report_cached(second, "llm-0", 1300, 1024)
    assert index_of(router).capacity_of("llm-0") == 5000
    router.report_cached(second, "llm-0", 1300, 512)  # one whole block missing: 650 tokens (1,300 / 2)
    assert index_of(router).capacity_of("llm-0") == 5000 - 650


def test_a_report_at_or_above_the_prediction_or_from_an_unknown_replica_changes_nothing() -> None:
    prompt = blocks("alice", "a1", "a2")
    router = Router(routing(prefix_index=True, prefix_feedback=True), ["llm-0", "llm-1"])
    request = RouteRequest("1", "alice", 300, 10, prompt)
    decision = router.route(request).decision
    router.complete("1")
    router.report_cached(request, decision.replica, 0, 0)
    router.report_cached(request, "gone", 300, 0)
    router.report_cached(request, decision.replica, 300, -5)  # nonsense from a replica: ignored
    router.report_cached(request._replace(prompt_tokens=0), decision.replica, 300, 0)
    assert index_of(router).held_prefix(decision.replica, prompt) == 3


def chain_of(opening: int, middle: int, length: int) -> tuple[int, ...]:
    """A prompt of the ``prompts`` strategy: one of a few openings, a shared middle, its own tail."""
    return blocks(f"o{opening}", *(f"m{middle}" for _ in range(3)), *(str(n) for n in range(length)))


prompts = st.lists(st.tuples(st.sampled_from(NAMES), st.integers(0, 3), st.integers(0, 6), st.integers(0, 12),
                             st.integers(1, 5), st.integers(-30, 30)), max_size=40)


class LruByBlock:
    """The reference: every block of a prompt sent is refreshed at once, deeper ones older
    (key: send number, -depth); while over capacity the least recent block goes."""

    def __init__(self, capacity: int) -> None:
        self.start = capacity
        self.capacity = dict.fromkeys(NAMES, capacity)
        self.held: dict[str, dict[int, list[int]]] = {name: {} for name in NAMES}  # block -> [send, -depth, weight]

    def add(self, replica: str, chain: tuple[int, ...], weight: int, send: int) -> None:
        held = self.held[replica]
        for depth, block in enumerate(chain):
            held[block] = [send, -depth, held.get(block, [0, 0, weight])[2]]
        self.evict(replica)

    def resize(self, replica: str, tokens: int, floor: int) -> None:
        self.capacity[replica] = min(self.start, max(1, floor, self.capacity[replica] + tokens))
        self.evict(replica)

    def evict(self, replica: str) -> None:
        held = self.held[replica]
        while sum(weight for _, _, weight in held.values()) > self.capacity[replica]:
            del held[min(held, key=lambda block: held[block][:2])]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 60), prompts)
def test_the_index_forgets_exactly_what_an_lru_by_block_forgets_and_its_lookups_agree_with_a_walk(
        capacity: int, log) -> None:
    index, reference = PrefixIndex(capacity), LruByBlock(capacity)
    chains = []
    for send, (replica, opening, middle, length, weight, resize) in enumerate(log):
        chain = chain_of(opening, middle, length)
        chains.append(chain)
        index.add_prompt(replica, chain, weight)
        reference.add(replica, chain, weight, send)
        if resize:
            index.resize(replica, resize, floor=weight)
            reference.resize(replica, resize, floor=weight)
        for name in NAMES:
            assert index.used(name) == sum(weight for _, _, weight in reference.held[name].values())
            assert index.size(name) == len(reference.held[name])
            assert index.capacity_of(name) == reference.capacity[name]
    for known in chains:
        walked = {name: next((depth for depth, block in enumerate(known) if block not in reference.held[name]),
                             len(known)) for name in NAMES}
        grouped = holders_by_depth(index, known)
        assert {name: depth for depth, names in grouped for name in names} == {n: d for n, d in walked.items() if d}
        assert [depth for depth, _ in grouped] == sorted({depth for depth, _ in grouped}, reverse=True)
        assert all(list(names) == sorted(names) for _, names in grouped)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 60), prompts, st.tuples(st.sampled_from(NAMES), st.integers(0, 3), st.integers(0, 6),
                                              st.integers(0, 12), st.integers(1, 5)), prompts)
def test_a_failed_prompt_forgotten_leaves_the_index_as_if_it_had_never_been_sent(capacity: int, before, failed,
                                                                                 after) -> None:
    """When it brought new blocks, and unless sending it made the replica forget something (that
    is not undone; nor is the refresh of a prompt the replica held whole)."""
    sent, never = PrefixIndex(capacity), PrefixIndex(capacity)
    chains = []

    def both(log) -> None:
        for replica, opening, middle, length, weight, resize in log:
            chains.append(chain_of(opening, middle, length))
            for index in (sent, never):
                index.add_prompt(replica, chains[-1], weight)
                if resize:
                    index.resize(replica, resize, floor=weight)
            agree()

    def agree() -> None:
        for name in NAMES:
            assert (sent.used(name), sent.size(name), sent.capacity_of(name)) == (
                never.used(name), never.size(name), never.capacity_of(name))
        for known in chains:
            assert holders_by_depth(sent, known) == holders_by_depth(never, known)

    both(before)
    replica, opening, middle, length, weight = failed
    chain = chain_of(opening, middle, length)
    held = sent.held_prefix(replica, chain)
    assume(held < len(chain) and sent.used(replica) + (len(chain) - held) * weight <= sent.capacity_of(replica))
    sent.add_prompt(replica, chain, weight, held)
    sent.forget(replica, chain, held)
    chains.append(chain)
    agree()
    both(after)


def test_a_failed_request_leaves_only_what_its_replica_held_before_it() -> None:
    """A replica that refused a prompt (longer than its context) cached none of it: the blocks it
    brought are forgotten, the turn before it is still held, and a retry is predicted as much."""
    first, second = blocks("system", "alice"), blocks("system", "alice", "a long paste", "more")
    router = Router(routing(prefix_index=True), NAMES)
    decision = router.route(RouteRequest("1", "alice", 200, 10, first)).decision
    router.complete("1")
    failed = router.route(RouteRequest("2", "alice", 400, 10, second)).decision
    assert failed.replica == decision.replica
    assert index_of(router).held_prefix(decision.replica, second) == 4  # sent: believed held until it fails
    router.complete("2", ok=False)
    index = index_of(router)
    assert index.held_prefix(decision.replica, second) == 2 and index.used(decision.replica) == 200
    retry = router.route(RouteRequest("3", "alice", 400, 10, second)).decision
    assert retry.predicted_cached_tokens == 200
    router.complete("3", ok=False)
    lone = router.route(RouteRequest("4", "bob", 400, 10, blocks("bob", "b1", "b2", "b3"))).decision
    router.complete("4", ok=False)  # nothing held before it: nothing left of it
    assert index.size(lone.replica) == (2 if lone.replica == decision.replica else 0)


def test_a_request_answered_by_a_fallback_leaves_nothing_new_on_its_pick() -> None:
    """The proxy failed over (the pick refused): the pick cached none of the prompt's new blocks."""
    router = Router(routing(prefix_index=True), NAMES)
    first = router.route(RouteRequest("1", "alice", 200, 10, blocks("system", "alice"))).decision
    router.complete("1")
    longer = blocks("system", "alice", "turn 2")
    second = router.route(RouteRequest("2", "alice", 300, 10, longer)).decision
    assert second.replica == first.replica
    fallback = next(name for name in NAMES if name != first.replica)
    router.complete("2", served=fallback)
    assert index_of(router).held_prefix(first.replica, longer) == 2


def test_requests_in_flight_on_a_replica_that_left_are_not_remembered() -> None:
    """The router drops the requests of a replica that left without completing them: the policy
    forgets what it kept for them (their replica's blocks before them), and only for them."""
    router = Router(routing(prefix_index=True), NAMES)
    assert isinstance(router.policy, LlmAware)
    policy = router.policy.view
    assert isinstance(policy, IndexView)
    picks = {}
    for number in range(12):
        decision = router.route(RouteRequest(str(number), f"c{number}", 200, 10, blocks(f"c{number}", "x"))).decision
        picks[str(number)] = decision.replica
    gone = picks["0"]
    router.set_replicas([name for name in NAMES if name != gone])
    assert set(policy.held_before) == {number for number, replica in picks.items() if replica != gone}
    for number in picks:
        router.complete(number)
    assert policy.held_before == {}


def test_a_prompt_no_replica_holds_goes_where_the_fleet_forgets_its_least_recent_prompt() -> None:
    """While replicas have room, a new prompt goes to the first of them clockwise (it evicts
    nothing); once all are full, to the one under the cap whose least recent prompt is oldest."""
    router = Router(routing(prefix_index=True, cache_tokens=400), NAMES)
    placed = []
    for name in ("a", "b", "c"):
        decision = router.route(RouteRequest(name, name, 400, 10, blocks(name, "1", "2", "3"))).decision
        placed.append(decision.replica)
    assert sorted(placed) == NAMES  # each one where there was room
    for name in ("c", "a", "b"):  # c's replica now holds the least recently used prompt
        router.complete(name)
    oldest, next_oldest = placed[2], placed[0]
    key = key_with_walk(router, next(name for name in NAMES if name != oldest))  # its ring home is elsewhere
    decision = router.route(RouteRequest("d", key, 400, 10, blocks("d", "1", "2", "3"))).decision
    assert decision.replica == oldest and decision.reason == "least-recent"
    assert decision.trace.details.preferred_by == "lru" and ("least_recent_use", 4) in decision.trace.details.figures
    assert f"under the cap {oldest}'s least recent prompt is the oldest (use 4)" in render_trace(decision)
    router.complete("d")
    busy = router.route(RouteRequest("d2", key, 800, 10, blocks("d", "1", "2", "3", "4", "5", "6", "7"))).decision
    assert busy.replica == oldest  # its follow-up, in flight: over the cap there now
    other = RouteRequest("e", key_with_walk(router, oldest), 400, 10, blocks("e", "1", "2", "3"))
    decision = router.route(other).decision
    assert decision.replica == next_oldest


def test_the_rendered_trace_names_the_index_as_the_reason_for_the_preference() -> None:
    router = Router(routing(prefix_index=True), NAMES)
    first = router.route(RouteRequest("a", "alice", 600, 10, blocks("system", "tools", "alice", "x"))).decision
    router.complete("a")
    for number in range(50):  # some conversation whose ring home is elsewhere
        decision = router.route(RouteRequest(f"b{number}", f"bob{number}", 600, 10,
                                             blocks("system", "tools", f"bob{number}", "y"))).decision
        router.complete(f"b{number}")
        if decision.trace.details.home != first.replica:
            break
    assert decision.reason == "prefix" and decision.replica == first.replica
    text = render_trace(decision)
    assert f"prefix index: {first.replica} holds the longest prefix (300 of 600 tokens; ring home " in text
    assert f"{first.replica}: matched 2 blocks" in text


def test_a_prompt_repeating_a_block_id_is_held_once_and_forgotten_cleanly() -> None:
    chain = blocks("a", "b", "c")
    index = PrefixIndex(10)
    index.add_prompt("llm-0", chain + chain[:1], 2)  # a hostile or broken client's ids
    assert index.size("llm-0") == 3 and index.used("llm-0") == 6
    index.add_prompt("llm-1", chain, 2)
    index.add_prompt("llm-0", blocks("x", "y", "z"), 2)  # 12 > 10: the oldest prompt goes, from its end
    assert index.held_prefix("llm-0", chain) == 2 and index.used("llm-0") == 10
    assert [(depth, names) for depth, names in holders_by_depth(index, chain)] == [(3, ("llm-1",)), (2, ("llm-0",))]
    index.add_prompt("llm-0", blocks("p", "q", "r", "s"), 2)  # nothing of the first prompt is pinned
    assert index.held_prefix("llm-0", chain) == 0 and index.used("llm-0") <= 10


def test_a_prompt_still_held_is_refreshed_when_its_request_ends_not_when_it_was_pushed_out() -> None:
    """A server frees a request's blocks, as its most recent, when it ends: a request sent
    before another outlives it in the cache; one the index already forgot is not brought back."""
    first, second, third = blocks("a", "a1"), blocks("b", "b1"), blocks("c", "c1")  # 100 tokens a block
    for capacity in (400, 300):
        router = Router(routing(prefix_index=True, cache_tokens=capacity), ["llm-0"])
        router.route(RouteRequest("a", "a", 200, 10, first))
        router.route(RouteRequest("b", "b", 200, 10, second))  # at 300, the first one's tail goes
        router.complete("a")
        router.route(RouteRequest("c", "c", 200, 10, third))
        index = index_of(router)
        if capacity == 400:  # the first one ended last: the second one goes
            assert (index.held_prefix("llm-0", first), index.held_prefix("llm-0", second)) == (2, 0)
        else:  # the first one was partly forgotten: it is not refreshed, and goes first
            assert (index.held_prefix("llm-0", first), index.held_prefix("llm-0", second)) == (0, 1)


def test_over_the_cap_the_cached_replica_keeps_a_request_unless_another_lands_a_factor_lower() -> None:
    """llm-aware with the index: alice's follow-up costs 110 tokens where her 1,000 are cached
    and 1,110 elsewhere. With the cached replica over the cap and the other idle, a redirect
    happens only if it fits under the cap there or lands (1 + ε) = 1.25 times lower."""
    opening = blocks(*(f"a{n}" for n in range(10)))
    follow_up = opening + blocks(*(f"a{n}" for n in range(11)))[10:]
    for backlog, reason, stays in ((1000, "kept", True), (1500, "least-loaded", False), (2000, "overflow", False)):
        router = Router(routing(prefix_index=True, long_stickiness=False), ["llm-0", "llm-1"])
        first = router.route(RouteRequest("1", "alice", 1000, 10, opening)).decision
        router.complete("1")
        for part in ("busy-1", "busy-2"):  # two requests: the cached replica is over the cap in requests too
            router.ledger.charge(part, first.replica, backlog // 2)
        decision = router.route(RouteRequest("2", "alice", 1100, 10, follow_up)).decision
        assert decision.reason == reason
        assert (decision.replica == first.replica) is stays
        assert decision.cost == (110 if stays else 1110)
        if stays:
            text = render_trace(decision)
            assert f"{first.replica} lands at {backlog + 110}, no other at 1.25x lower (least 1110)" in text


def within_requests_cap(details: LlmAwareTrace) -> bool:
    figures = dict(details.figures)
    return figures["requests"] + 1 <= figures["requests_cap"]


def test_over_its_limit_in_tokens_the_cached_replica_keeps_a_request_while_within_the_cap_in_requests() -> None:
    """alice's follow-up brings 110 new tokens where her 1,000 are cached. Her replica runs one
    3,000-token request, the other replica nothing: over the cap in tokens, but 2 requests are
    within ⌈1.25 × 2 / 2⌉ = 2, so it stays there. The same 3,000 tokens as two requests (3 > 2) and
    she goes to the idle replica, where 1,110 tokens fit under the cap."""
    opening = blocks(*(f"a{n}" for n in range(10)))
    follow_up = opening + blocks(*(f"a{n}" for n in range(11)))[10:]
    for parts, reason, stays in ((1, "-requests", True), (2, "overflow", False)):
        router = Router(routing(prefix_index=True, long_stickiness=False), ["llm-0", "llm-1"])
        first = router.route(RouteRequest("1", "alice", 1000, 10, opening)).decision
        router.complete("1")
        for part in range(parts):
            router.ledger.charge(f"busy-{part}", first.replica, 3000 // parts)
        decision = router.route(RouteRequest("2", "alice", 1100, 10, follow_up)).decision
        assert decision.reason.endswith(reason)
        assert (decision.replica == first.replica) is stays
        assert decision.cost == (110 if stays else 1110)
        assert dict(decision.trace.details.figures)["requests"] == parts
        if stays:
            assert decision.reason in reasons() and within_requests_cap(decision.trace.details)
            assert "3000+110=3110 > 1943.8 but 2 requests ≤ the cap in requests 2: cached" in render_trace(decision)


def test_below_one_request_a_replica_a_follow_up_stays_beside_one_long_prefill_a_new_conversation_does_not() -> None:
    """alice's replica runs one 20,000-token request, seven replicas are idle: with her follow-up
    2 requests in flight, ⌈1.25 × 2 / 8⌉ = 1. As the follow-up of her last turn there she may be
    the second request on it (110 new tokens, not 1,110 on an idle replica); bob, a new
    conversation opening with the same blocks, spreads to an idle replica as before."""
    opening = blocks(*(f"a{n}" for n in range(10)))
    follow_up = opening + blocks(*(f"a{n}" for n in range(11)))[10:]
    for conversation, stays in (("alice", True), ("bob", False)):
        router = Router(routing(prefix_index=True, long_stickiness=False), REPLICAS)
        first = router.route(RouteRequest("1", "alice", 1000, 10, opening)).decision
        router.complete("1")
        router.ledger.charge("busy", first.replica, 20_000)
        decision = router.route(RouteRequest("2", conversation, 1100, 10, follow_up)).decision
        assert decision.predicted_cached_tokens == (1000 if stays else 0)
        assert (decision.replica == first.replica) is stays
        assert decision.cost == (110 if stays else 1110)
        figures = dict(decision.trace.details.figures)
        assert (figures["requests"], figures["requests_cap"]) == (1, 2 if stays else 1)
        if stays:
            assert decision.reason == "prefix-requests" or decision.reason == "home-requests"
            assert "but 2 requests ≤ the cap in requests 2: cached" in render_trace(decision)
        else:
            assert decision.reason == "overflow"


def test_with_the_index_the_long_cap_is_measured_against_the_cached_prefix_when_that_is_larger() -> None:
    """alice's 1,000 tokens are cached on her replica; it runs five other requests of B tokens in
    all, three replicas are idle. The average, (B + 110) / 4, is below her prefix: the long cap
    is 2 × 1,000 (what a move computes again), not 2 × the average. B = 1,500: 1,610 ≤ 2,000,
    she stays (2 × the average, 805, would have sent her away); B = 2,500: 2,610 > 2,000, she goes."""
    names = ["llm-0", "llm-1", "llm-2", "llm-3"]
    opening = blocks(*(f"a{n}" for n in range(10)))
    follow_up = opening + blocks(*(f"a{n}" for n in range(11)))[10:]
    for backlog, stays in ((1500, True), (2500, False)):
        router = Router(routing(prefix_index=True), names)
        first = router.route(RouteRequest("1", "alice", 1000, 10, opening)).decision
        router.complete("1")
        for part in range(5):  # 5 requests: over the cap in requests too (5 > ⌈1.25 × 6 / 4⌉ = 2)
            router.ledger.charge(f"busy-{part}", first.replica, backlog // 5)
        decision = router.route(RouteRequest("2", "alice", 1100, 10, follow_up)).decision
        assert decision.trace.details.long_cap == 2000
        assert (decision.replica == first.replica) is stays
        assert decision.reason == (decision.reason.partition("-")[0] + "-long" if stays else "least-loaded")


flood = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(1, 8), st.integers(10, 3000),
                           st.booleans()), min_size=1, max_size=80)


@settings(max_examples=100, deadline=None)
@given(flood, st.sampled_from([0.1, 0.25, 1.0]))
def test_with_the_index_a_replica_goes_over_the_cap_only_when_none_fits_and_kept_only_within_a_factor(
        sent, epsilon) -> None:
    """The bounded-load guarantee with the index on: while some replica fits under the cap at
    its own cost, the pick is within its limit; when none does, the pick lands least loaded,
    the cached replica's landing counted (1 + ε) times lower."""
    router = Router(routing(prefix_index=True, epsilon=epsilon), NAMES)
    for number, (opening, conversation, turns, prompt, done) in enumerate(sent):
        chain = blocks(f"system-{opening}", f"c{conversation}", *(f"t{n}" for n in range(turns)))
        decision = router.route(RouteRequest(str(number), f"c{opening}-{conversation}", prompt, 10, chain)).decision
        trace = decision.trace.details
        assert trace.cap is not None
        landing = {check.replica: check.load + check.cost for check in trace.checks}
        fits = {check.replica for check in trace.checks if check.load + check.cost <= check.limit}
        if trace.long_cap is not None:  # 2 x the larger of the average and the prefix cached on the preferred
            assert trace.average is not None and trace.long_cap == 2.0 * max(trace.average, trace.cached_tokens)
        if decision.reason in ("kept", "least-loaded"):
            assert not fits and set(landing) == set(NAMES)  # every replica was checked
            factor = 1 + epsilon if decision.reason == "kept" else 1.0
            lowest = min(after for name, after in landing.items() if name != decision.replica)
            assert landing[decision.replica] <= factor * lowest
            assert (decision.reason == "kept") is (decision.replica == trace.preferred and trace.cached_tokens > 0)
        else:
            chosen = trace.checks[-1]
            assert chosen.replica == decision.replica and chosen.accepted
            if chosen.replica != trace.preferred:
                assert chosen.load + chosen.cost <= trace.cap or trace.cached_tokens == 0
            elif chosen.load and chosen.load + chosen.cost > chosen.limit and chosen.load >= chosen.limit:
                # over its limit in tokens, without slack: only the cached replica, within the cap in requests
                assert decision.reason.endswith("-requests") and trace.cached_tokens > 0
                assert within_requests_cap(trace)
        if done and number:
            router.complete(str(number - 1))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([2, 5, 12, 16]), st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30), st.integers(0, 6),
                                              st.integers(200, 4_000), st.booleans()), min_size=1, max_size=80),
       st.booleans(), st.sets(st.integers(0, 15), max_size=3))
# six requests still in flight send the walk past the preferred replica, onto the one that served
# the conversation's last prompt: predicted that prompt's 200 tokens, not its blocks' 201
@example(5, [(0, 0, 0, 200, False)] * 6 + [(0, 0, 0, 200, True), (0, 0, 0, 201, False)], False, set())
def test_every_pick_is_charged_and_predicted_what_the_index_holds_there(
        replicas: int, sent, placement_memory: bool, avoided: set[int]) -> None:
    """Only some holders are entered into a decision at once (the rest when the walk asks):
    whatever the path, the pick's predicted cache and charge are what the index holds there."""
    names = [f"llm-{i}" for i in range(replicas)]
    router = Router(routing(prefix_index=True, placement_memory=placement_memory), names)
    index = index_of(router)
    avoid = [names[i] for i in avoided if i < replicas - 1]
    last_served: dict[str, tuple[str, int]] = {}  # conversation -> (replica, prompt) of its last success
    for number, (opening, conversation, turns, prompt, done) in enumerate(sent):
        chain = blocks(f"system-{opening}", f"c{conversation}", *(f"t{n}" for n in range(turns)))
        held = {name: index.held_prefix(name, chain) for name in names}  # before the request is sent
        key = f"c{opening}-{conversation}"
        decision = router.route(RouteRequest(str(number), key, prompt, 10, chain), avoid).decision
        assert decision.replica not in avoid
        depth = held[decision.replica]
        cached = covered_tokens(prompt, len(chain), depth)
        last = last_served.get(key)
        if last is not None and last[0] == decision.replica:
            # the replica that served the conversation's last prompt, holding its whole blocks
            # and no more (one block of rounding), caches that prompt: its tokens, not the blocks'
            # (also when the walk past the preferred replica enters the other holders)
            remembered = min(last[1], prompt)
            whole = remembered * len(chain) // prompt
            if whole <= depth <= whole + 1:
                cached = remembered
        assert decision.predicted_cached_tokens == cached
        assert decision.charged_tokens == (max(1, prompt - cached) + 10 if cached else prompt + 10)
        holders = sum(1 for name in names if held[name] and name not in avoid)
        assert dict(decision.trace.details.figures)["holders"] == holders
        if done:
            router.complete(str(number))
            last_served[key] = (decision.replica, prompt)


def test_a_tie_among_more_holders_than_a_trace_lists_is_charged_as_cached_wherever_it_lands() -> None:
    names = [f"llm-{i:02d}" for i in range(16)]
    router = Router(routing(prefix_index=True), names)
    system = blocks("system", "tools")
    for name in names:  # every replica holds the system prompt: a tie of 16, a trace lists 8
        index_of(router).add_prompt(name, system, 100)
    for number in range(40):  # new conversations: each lands on its ring home, half past the 8 listed
        chain = system + blocks("system", "tools", f"user-{number}")[2:]
        decision = router.route(RouteRequest(str(number), f"user-{number}", 300, 10, chain)).decision
        assert decision.replica == router.ring.home(router.conversation_key(f"user-{number}"))
        assert decision.predicted_cached_tokens == 200 and decision.charged_tokens == 300 - 200 + 10
        assert len(decision.trace.details.candidates) == 8 and dict(decision.trace.details.figures)["holders"] == 16
        router.complete(str(number))
