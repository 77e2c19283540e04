"""A request's LoRA adapters normalised as llama.cpp compares them (routing/adapters.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.routing import RouteRequest, adapters
from tests.routing.conftest import key_with_walk
from tests.routing.test_ttft import busy, timed

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


def test_in_flight_names_the_replicas_running_another_configuration_of_the_model() -> None:
    running = adapters.InFlight()
    running.sent("tiny", "lora:0=1.0", "llm-0")
    running.sent("tiny", "lora:0=1.0", "llm-0")
    running.sent("tiny", "", "llm-1")
    running.sent("smollm2", "lora:1=1.0", "llm-2")  # another model: its own server, its own batches
    assert running.unbatched("tiny", "lora:0=1.0") == {"llm-1"}
    assert running.unbatched("tiny", "") == {"llm-0"}
    assert running.unbatched("tiny", "lora:1=1.0") == {"llm-0", "llm-1"}
    running.ended("tiny", "lora:0=1.0", "llm-0")
    assert running.unbatched("tiny", "") == {"llm-0"}  # one of the two still runs
    running.ended("tiny", "lora:0=1.0", "llm-0")
    running.ended("tiny", "lora:0=1.0", "llm-0")  # ended twice: nothing more to end
    assert running.unbatched("tiny", "") == frozenset() and running.unbatched("tiny", "lora:0=1.0") == {"llm-1"}


def test_a_replica_running_another_configuration_is_seen_with_no_free_slot() -> None:
    running = {"llm-0": 1, "llm-1": 0}
    assert adapters.seen_running(running, 4, frozenset()) is running
    assert adapters.seen_running(running, 4, frozenset({"llm-0"})) == {"llm-0": 4, "llm-1": 0}


def test_llm_aware_predicts_the_wait_behind_another_configuration_and_moves_a_follow_up() -> None:
    router = timed()
    conversation = key_with_walk(router, "llm-0", "llm-1")

    def route(unbatched: frozenset[str]) -> tuple[str, dict[str, float]]:
        router.reset()
        router.memory.remember(router.conversation_key(conversation), "llm-0", 400)
        busy(router, "llm-0", 1, 2400)  # one request decoding there
        decision = router.route(RouteRequest("r", conversation, 440, 8, unbatched=unbatched)).decision
        return decision.replica, dict(decision.trace.details.predicted_ttft_s)

    batched, together = route(frozenset())
    apart, behind = route(frozenset({"llm-0"}))
    assert batched == "llm-0" and apart != "llm-0"  # beside the same configuration it stays with its cache
    assert behind["llm-0"] > together["llm-0"]  # behind another: after all of its 2,400 tokens
