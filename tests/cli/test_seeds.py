"""--seeds: integers and ranges, in order; empty ranges and repeats refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.cli_input import UsageError, parse_seeds


@given(st.lists(st.integers(0, 10_000), unique=True, max_size=20))
def test_distinct_integers_come_back_in_order(seeds):
    assert parse_seeds([str(seed) for seed in seeds]) == seeds


@given(st.integers(0, 1000), st.integers(0, 50))
def test_a_range_holds_both_ends(low, width):
    assert parse_seeds([f"{low}-{low + width}"]) == list(range(low, low + width + 1))


@given(st.integers(1, 1000), st.integers(1, 50))
def test_a_reversed_range_is_refused(high, width):
    with pytest.raises(UsageError, match="empty range"):
        parse_seeds([f"{high + width}-{high}"])


@given(st.lists(st.integers(0, 100), min_size=1, max_size=10))
def test_any_repeat_is_refused(seeds):
    with pytest.raises(UsageError, match="given twice"):
        parse_seeds([str(seed) for seed in [*seeds, seeds[0]]])
