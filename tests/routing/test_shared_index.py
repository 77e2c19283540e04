"""llm-aware's prefix index kept alike by several routers (docs/shared-state.md#the-prefix-index):
a router's changes, made by another in the same order, give the same index; a router whose index
never saw a conversation follows placement memory, one whose index forgot it does not."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.routing import Router, RouteRequest
from extproc.routing.prefix_index import SENT, IndexChange, PrefixIndex
from tests.routing.conftest import key_with_walk, routing
from tests.routing.test_prefix_index import NAMES, blocks, chain_of, holders_by_depth, index_of

# (replica, opening, middle, length, weight, what follows: 0 nothing, 1 used, 2 failed, 3 resized)
steps = st.lists(st.tuples(st.sampled_from(NAMES), st.integers(0, 3), st.integers(0, 6), st.integers(0, 12),
                           st.integers(1, 5), st.integers(0, 3), st.integers(-30, 30)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 60), steps)
def test_a_routers_changes_made_by_another_give_the_same_index(capacity: int, log) -> None:
    mine, theirs = PrefixIndex(capacity), PrefixIndex(capacity)
    mine.journal = []
    theirs.journal = []  # a router that also shares: what it applies is not its own to send
    chains = []
    for replica, opening, middle, length, weight, then, resize in log:
        chain = chain_of(opening, middle, length)
        chains.append(chain)
        held = mine.held_prefix(replica, chain)
        mine.add_prompt(replica, chain, weight, held)
        if then == 1:
            mine.touch(replica, chain)
        elif then == 2:
            mine.forget(replica, chain, held)
        elif then == 3:
            mine.resize(replica, resize, floor=weight)
        theirs.apply(mine.journal)
        mine.journal = []
        assert theirs.journal == []
        for name in NAMES:
            assert (theirs.used(name), theirs.size(name), theirs.capacity_of(name)) == (
                mine.used(name), mine.size(name), mine.capacity_of(name))
            assert theirs.least_recent_use(name, capacity) == mine.least_recent_use(name, capacity)
        for known in chains:
            assert holders_by_depth(theirs, known) == holders_by_depth(mine, known)
            assert theirs.forgot(known[0]) == mine.forgot(known[0]) if known else True


def test_two_routers_sharing_their_changes_route_a_shared_opening_alike() -> None:
    a, b = Router(routing(prefix_index=True), NAMES), Router(routing(prefix_index=True), NAMES)
    a.share_view()
    b.share_view()
    system = blocks("system", "tools")
    first = a.route(RouteRequest("a1", "alice", 600, 10, system + blocks("alice")[2:])).decision
    a.complete("a1")
    changes = a.view_changes()
    assert [change.kind for change in changes] == [SENT, 1] and a.view_changes() == []
    bob = key_with_walk(b, *(name for name in NAMES if name != first.replica))  # its ring home is elsewhere
    request = RouteRequest("b1", bob, 400, 10, system + blocks("system", "tools", "bob", "more")[2:])
    alone = Router(routing(prefix_index=True), NAMES).route(request).decision
    assert alone.replica != first.replica and alone.predicted_cached_tokens == 0  # the control
    b.apply_view_changes(changes)
    decision = b.route(request).decision
    assert decision.replica == first.replica and decision.reason == "prefix" and decision.predicted_cached_tokens == 200
    assert b.view_changes()[0] == IndexChange(SENT, first.replica, request.prefix_blocks, 100, 0)  # b's own send


def test_changes_naming_a_replica_this_router_does_not_route_to_are_left_out() -> None:
    router = Router(routing(prefix_index=True), NAMES)
    router.apply_view_changes([IndexChange(SENT, "llm-9", blocks("x", "y"), 50, 0),
                               IndexChange(SENT, "llm-1", blocks("x", "y"), 50, 0)])
    assert index_of(router).size("llm-9") == 0 and index_of(router).size("llm-1") == 2


def test_a_router_whose_index_never_saw_a_conversation_follows_placement_memory() -> None:
    """Another router sent its last turn, and its changes have not come (a store down or late):
    placement memory (the store's placement) still knows where the conversation is."""
    router = Router(routing(prefix_index=True), NAMES)
    alice = blocks("alice", "a1", "a2")
    remembered = next(name for name in NAMES if name != router.ring.home(router.conversation_key("alice")))
    router.memory.remember(router.conversation_key("alice"), remembered, 300)  # as read from the store
    follow_up = alice + blocks("alice", "a1", "a2", "a3")[3:]
    decision = router.route(RouteRequest("a2", "alice", 500, 10, follow_up)).decision
    assert decision.replica == remembered and decision.reason == "sticky" and decision.predicted_cached_tokens == 300
    assert decision.trace.details.preferred_by == "memory"


def test_a_router_whose_index_forgot_a_conversation_does_not_follow_placement_memory() -> None:
    """Its replica forgot it (evicted there, as the index knows): the cache placement memory
    claims is gone, and the prompt goes where no replica holds it (test_prefix_index's eviction)."""
    router = Router(routing(prefix_index=True, cache_tokens=1000), ["llm-0", "llm-1"])
    alice = blocks("alice", "a1", "a2", "a3")
    served = router.route(RouteRequest("a1", "alice", 400, 10, alice)).decision.replica
    router.complete("a1")
    for number in range(6):  # 2,400 more tokens: alice's blocks are forgotten everywhere
        router.route(RouteRequest(f"x{number}", f"x{number}", 400, 10, blocks(f"x{number}", "1", "2", "3")))
        router.complete(f"x{number}")
    assert index_of(router).held_prefix(served, alice) == 0 and index_of(router).forgot(alice[0])
    decision = router.route(RouteRequest("a2", "alice", 500, 10, alice + blocks("alice", "a1", "a2", "a3", "a4")[4:]))
    assert decision.decision.predicted_cached_tokens == 0 and decision.decision.reason == "least-recent"
