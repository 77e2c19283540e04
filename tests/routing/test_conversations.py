"""Conversations without a gateway: its requests waiting for a next turn, the store's digest in a
claim, and branch points by cache scope (extproc/routing/conversations.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extproc.routing.continuation import Shown, unclaimed
from extproc.routing.conversations import Conversations
from extproc.routing.hashing import stable_hash
from extproc.routing.placement import PlacementMemory

SEED = 7  # the router's hash_seed


def conversations() -> Conversations:
    return Conversations(64, PlacementMemory(64))


def key(conversation: str) -> int:
    return stable_hash(conversation, SEED)


# a step: ("sent", conversation, request, history), ("answered", conversation, histories)
# or ("settled", conversation, request)
steps = st.lists(st.one_of(
    st.tuples(st.just("sent"), st.sampled_from("ab"), st.integers(0, 5), st.integers(0, 3)),
    st.tuples(st.just("answered"), st.sampled_from("ab"), st.frozensets(st.integers(1, 3))),
    st.tuples(st.just("settled"), st.sampled_from("ab"), st.integers(0, 5)),
), max_size=40)


@given(steps)
def test_a_request_waits_from_its_sending_until_a_next_turn_shows_it_answered_or_it_ends(run: list) -> None:
    held = conversations()
    model: dict[str, dict[str, int]] = {"a": {}, "b": {}}
    for step in run:
        kind, conversation = step[0], step[1]
        waiting = model[conversation]
        if kind == "sent":
            if step[3]:
                waiting[str(step[2])] = step[3]
            held.sent(conversation, str(step[2]), step[3])
        elif kind == "answered":
            expected = sorted(rid for rid, history in waiting.items() if history in step[2])
            assert sorted(held.answered(conversation, step[2])) == expected
            for rid in expected:
                del waiting[rid]
        else:
            held.settled(conversation, str(step[2]))
            waiting.pop(str(step[2]), None)
        assert held.unanswered == {name: value for name, value in model.items() if value}  # no empty entry kept
        assert sorted(held.waiting()) == sorted(item for value in model.values() for item in value.items())
        for name, value in model.items():
            assert sorted(held.known(name, SEED)) == sorted(value.values())  # no tips: nothing completed


def test_the_stores_digest_is_known_for_the_conversation_it_was_read_for_alone() -> None:
    held = conversations()
    body = Shown(7, frozenset((5, 7)))
    assert held.claim("chat", "open", body, "chat", 5, SEED) == (("chat", True, False))
    held.completed(key("chat"), Shown(9, frozenset((9,))), "r1", 10, None)  # a tip this body does not show
    stranger = held.claim("chat", "open", body, "elsewhere", 5, SEED)
    assert stranger.conversation == unclaimed("chat", "open") and not stranger.continues and stranger.foreign


def test_a_branch_starts_where_its_history_was_served_under_the_same_scope_on_a_live_replica() -> None:
    held = conversations()
    held.completed(key("chat"), Shown(3, frozenset((3,))), "r1", 100, "m")
    held.completed(key("chat"), Shown(4, frozenset((3, 4))), "r2", 200, "m")
    assert not held.branch(key("edit"), frozenset((3, 4)), "other-model", {"r1", "r2"})
    assert not held.branch(key("edit"), frozenset((3, 4)), "m", {"r1"})  # the longest proven prefix's replica is gone
    assert held.branch(key("edit"), frozenset((3, 4)), "m", {"r1", "r2"})
    assert held.memory.get(key("edit")) == ("r2", 200)
    assert not held.branch(key("edit"), frozenset((3,)), "m", {"r1", "r2"})  # placed already: left alone
    held.completed(key("plain"), Shown(5, frozenset((5,))), "r1", 50, None)  # a completion: no branch point
    assert not held.branch(key("other"), frozenset((5,)), "", {"r1"})


def test_a_conversations_tips_are_found_under_the_seed_its_key_was_hashed_with() -> None:
    held = conversations()
    held.completed(key("chat"), Shown(9, frozenset((9,))), "r1", 10, None)
    assert held.known("chat", SEED) == (9,)
    assert held.known("chat", SEED + 1) == ()  # another hash_seed keys it elsewhere
