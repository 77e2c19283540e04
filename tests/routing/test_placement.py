from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extproc.routing import Placement, PlacementMemory, stable_hash


def key(conversation: str) -> int:
    return stable_hash(conversation)


def test_remembers_and_updates() -> None:
    memory = PlacementMemory(100)
    assert memory.get(key("c1")) is None
    memory.remember(key("c1"), "llm-0", 120)
    memory.remember(key("c1"), "llm-2", 300)
    assert memory.get(key("c1")) == Placement("llm-2", 300)


@given(st.integers(2, 200), st.lists(st.integers(0, 1000), max_size=2000))
def test_never_holds_more_than_its_capacity(capacity: int, conversations: list[int]) -> None:
    memory = PlacementMemory(capacity)
    for conversation in conversations:
        memory.remember(key(f"c{conversation}"), "llm-0", conversation)
        assert len(memory) <= capacity


def test_recently_used_conversations_survive_a_flood_of_new_ones() -> None:
    memory = PlacementMemory(1000)
    memory.remember(key("regular"), "llm-1", 50)
    for index in range(5000):
        memory.remember(key(f"one-off-{index}"), "llm-0", 10)
        if index % 400 == 0:
            assert memory.get(key("regular")) == Placement("llm-1", 50)  # a use keeps it young
    assert memory.get(key("regular")) == Placement("llm-1", 50)
    assert memory.get(key("one-off-0")) is None  # unused for longer than the capacity: forgotten


def test_large_prompt_sizes_round_trip() -> None:
    memory = PlacementMemory(10)
    memory.remember(key("c"), "replica-with-a-long-name", 2_000_000)
    assert memory.get(key("c")) == Placement("replica-with-a-long-name", 2_000_000)


def test_a_journal_keeps_the_placements_remembered_and_none_learnt() -> None:
    memory = PlacementMemory(10)
    memory.remember(key("before"), "llm-0", 5)  # no journal yet: nothing kept
    memory.journal = []
    memory.remember(key("a"), "llm-0", 100)
    memory.learn(key("b"), "llm-1", 200)  # another router's, read from a store
    memory.remember(key("a"), "llm-2", 300)
    assert memory.get(key("b")) == Placement("llm-1", 200)
    assert memory.journal == [(key("a"), "llm-0", 100), (key("a"), "llm-2", 300)]
