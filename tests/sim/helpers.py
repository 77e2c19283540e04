"""Small builders for simulator tests: settings, a hand-checkable cost model, requests."""

from __future__ import annotations

from typing import Any

from extproc.routing.settings import RoutingSettings
from extproc.sim.costmodel import CostModel, parse_cost_model
from extproc.sim.request import Request
from extproc.sim.runs import load_sim_config, parse_policy

POLICIES = ("round-robin", "mod-n", "consistent", "bounded", "llm-aware")


def settings(policy: str) -> RoutingSettings:
    return parse_policy(policy, load_sim_config().routing)


def simple_cost(**overrides: Any) -> CostModel:
    """10 ms per prompt token, 100 ms per output token, no overhead; k busy slots share the CPU evenly."""
    raw: dict[str, Any] = {
        "name": "simple",
        "kv_bytes_per_token": 1024,
        "prefill": {"overhead_s": 0.0, "per_token_s": 0.01, "per_token_ctx_s": 0.0},
        "decode": {"per_token_s": 0.1, "per_token_ctx_s": 0.0},
        "concurrency": {"prefill_slowdown": [1.0, 2.0], "decode_slowdown": [1.0, 2.0]},
        "measured": {"how": "hand-made for tests"},
    }
    raw.update(overrides)
    return parse_cost_model(raw)


def request(name: str, conversation: str, turn: int, prompt: int, output: int, at: float) -> Request:
    return Request(name, conversation, turn, conversation, None, prompt, output, arrival_s=at)
