"""Each policy's trace carries its own typed details, and as_dict flattens them by one rule."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest

from extproc.routing import Check, Router, RouteRequest, Trace
from extproc.routing.blocks import prefix_blocks
from extproc.routing.decision import Candidate, detail_fields
from extproc.routing.policies.bounded import BoundedTrace
from extproc.routing.policies.llm_aware import LlmAwareTrace
from extproc.routing.policies.situation import PeerTrace
from tests.routing.conftest import routing

REPLICAS = ["llm-0", "llm-1", "llm-2"]


@pytest.mark.parametrize(("knobs", "details_type"), [
    ({"policy": "round-robin"}, type(None)),
    ({"policy": "mod-n"}, type(None)),
    ({"policy": "consistent"}, type(None)),
    ({"policy": "bounded"}, BoundedTrace),
    ({"policy": "llm-aware"}, LlmAwareTrace),
    ({"policy": "llm-aware", "prefix_index": True}, LlmAwareTrace),
    ({"policy": "prefix-affinity"}, PeerTrace),
    ({"policy": "radix-balance"}, PeerTrace),
    ({"policy": "chwbl"}, PeerTrace),
    ({"policy": "kv-cost"}, PeerTrace),
])
def test_every_policy_traces_its_own_details_type(knobs: dict[str, Any], details_type: type) -> None:
    router = Router(routing(**knobs), REPLICAS)
    chars = router.policy.prefix_block_chars
    text = "You are helpful. " * 80
    ticket = router.route(RouteRequest("1", "alice", len(text) // 4, 32, prefix_blocks(text, chars) if chars else ()))
    assert ticket is not None
    trace = ticket.decision.trace
    assert type(trace.details) is details_type
    data = trace.as_dict()
    assert (data["policy"], data["prompt_tokens"], data["max_tokens"]) == (knobs["policy"], len(text) // 4, 32)
    if trace.details is not None:  # every field that is set is in the record, under its own name
        assert set(detail_fields(trace.details)) <= set(data) and "details" not in data


class Rule(NamedTuple):
    name: str | None
    limit: float
    loads: dict[str, int]
    checks: tuple[Check, ...]
    candidates: tuple[Candidate, ...]
    figures: tuple[tuple[str, float], ...]


def test_detail_fields_drops_what_is_unset_and_turns_records_and_pairs_into_data() -> None:
    check = Check("llm-0", 3, 1, 4.0, True)
    details = Rule(None, 2.5, {"llm-0": 3}, (check,), (), (("epsilon", 0.25), ("holders", 2)))
    assert detail_fields(details) == {
        "limit": 2.5, "loads": {"llm-0": 3},
        "checks": [{"replica": "llm-0", "load": 3, "cost": 1, "limit": 4.0, "accepted": True, "long_limit": False}],
        "figures": {"epsilon": 0.25, "holders": 2},
    }
    record = Trace("toy", 10, 5, details).as_dict()
    assert record["cached_tokens"] == 0 and record["policy"] == "toy" and record["figures"]["holders"] == 2
    assert Trace("toy", 10, 5).as_dict() == {"policy": "toy", "prompt_tokens": 10, "max_tokens": 5, "cached_tokens": 0}
