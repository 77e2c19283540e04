"""A request's LoRA adapters normalised as llama.cpp compares them (routing/adapters.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.routing import adapters

scales = st.floats(min_value=-4.0, max_value=4.0, allow_nan=False).map(adapters.as_float32)
entries = st.lists(st.tuples(st.integers(0, 7), scales), max_size=8)


@given(entries, st.randoms())
def test_order_of_distinct_ids_and_zero_scales_do_not_change_the_configuration(given_entries, random) -> None:
    distinct = list({adapter: scale for adapter, scale in given_entries}.items())
    shuffled = [*distinct, *((adapter + 100, 0.0) for adapter, _ in distinct)]
    random.shuffle(shuffled)
    assert adapters.normalised(shuffled) == adapters.normalised(distinct)


@given(entries)
def test_the_configuration_is_each_ids_last_nonzero_scale_sorted(given_entries) -> None:
    normal = adapters.normalised(given_entries)
    last = dict(given_entries)
    assert normal == tuple(sorted((adapter, scale) for adapter, scale in last.items() if scale != 0.0))
    assert adapters.normalised(normal) == normal


@given(entries, entries)
def test_two_configurations_share_a_label_exactly_when_llama_cpp_holds_them_equal(first, second) -> None:
    one, other = adapters.normalised(first), adapters.normalised(second)
    assert (adapters.label(one) == adapters.label(other)) == (one == other)


def test_scales_compare_as_llama_cpp_holds_them_32_bit_floats() -> None:
    assert adapters.normalised([(0, 0.1)]) == adapters.normalised([(0, 0.1 + 1e-12)])
    assert adapters.normalised([(0, 0.1)]) != adapters.normalised([(0, 0.1001)])
    assert adapters.normalised([(0, 1)]) == ((0, 1.0),)
    with pytest.raises(OverflowError):
        adapters.normalised([(0, 1e39)])


def test_labels_and_scopes() -> None:
    assert adapters.label(None) == ""  # the server's own configuration: the model alone
    assert adapters.label(()) == "lora:none"  # a list naming no applied adapter: none applied
    assert adapters.label(adapters.normalised([(1, 0.5), (0, 1.0)])) == "lora:0=1.0,1=0.5"
    assert adapters.scope("smollm2", "") == "smollm2"
    assert adapters.scope("smollm2", "lora:0=1.0") == "smollm2\x1flora:0=1.0"
