"""The two-generation LRU under placement memory, the gateway's history digests and the prefix
index's forgotten openings."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.routing.lru import TwoGenerationLru

WRITES = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 2**64 - 1)), max_size=1000)


@given(st.integers(2, 100), WRITES)
def test_bounded_and_the_latest_value_is_kept(capacity: int, writes: list[tuple[int, int]]) -> None:
    lru = TwoGenerationLru(capacity)
    for key, value in writes:
        lru.put(key, value)
        assert len(lru) <= capacity
        assert lru.get(key) == value
    assert len(dict(lru.items())) == len(lru)  # a key is in one generation only


@given(st.integers(2, 100), st.lists(st.integers(0, 150), max_size=400))
def test_a_key_is_held_until_half_the_capacity_of_other_keys_were_used_since(capacity: int,
                                                                            keys: list[int]) -> None:
    """What is forgotten went unused longest, to within one generation: the capacity // 2 keys
    used last are always held."""
    lru = TwoGenerationLru(capacity)
    recency: OrderedDict[int, None] = OrderedDict()  # keys, the least recently used first
    for key in keys:
        lru.put(key, key)
        recency[key] = None
        recency.move_to_end(key)
        held = dict(lru.items())
        assert all(recent in held for recent in list(recency)[-(capacity // 2):]), (capacity, held)


def test_a_hit_in_the_old_generation_makes_the_key_young_again() -> None:
    lru = TwoGenerationLru(4)  # generations of 2
    lru.put(1, 10)
    lru.put(2, 20)  # the young generation is full: it becomes the old one
    assert lru.get(1) == 10  # back to the young generation
    lru.put(3, 30)  # young full again: {1, 3} old, 2 dropped
    assert [key for key, _ in lru.items()] == [1, 3]
    assert lru.get(2) is None


def test_in_asks_without_making_the_key_young_again() -> None:
    lru = TwoGenerationLru(4)  # generations of 2
    lru.put(1, 10)
    lru.put(2, 20)  # {1, 2} old
    assert 1 in lru and 5 not in lru  # asked, not used: 1 stays old
    lru.put(3, 30)
    lru.put(4, 40)  # young full again: {3, 4} old, 1 and 2 dropped
    assert 1 not in lru and 3 in lru


def test_reset_forgets_and_takes_the_new_capacity() -> None:
    lru = TwoGenerationLru(10)
    for key in range(8):
        lru.put(key, key)
    lru.reset(2)
    assert len(lru) == 0
    lru.put(1, 1)
    lru.put(2, 2)
    lru.put(3, 3)
    assert len(lru) <= 2
    with pytest.raises(ValueError, match="at least 2"):
        TwoGenerationLru(1)
