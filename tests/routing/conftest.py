from __future__ import annotations

from typing import Any

from extproc.routing import Router
from extproc.routing.settings import RoutingSettings, with_knobs
from extproc.settings import parse_routing

BASE: dict[str, Any] = {
    "policy": "llm-aware",
    "virtual_nodes": 100,
    "hash_seed": 0,
    "memory_capacity": 10_000,
    "speed_learning": True, "speed_ewma_weight": 0.05, "prior_prefill_tokens_per_s": 167.0,
    "prior_decode_tokens_per_s": 55.0, "prior_request_overhead_ms": 19.0,
    "prior_model_load_ms": 1500.0, "prior_model_wake_ms": 1500.0,
    "replicas": {"slots": 4, "cache_tokens": 100_000},
    "bounded": {"epsilon": 0.25, "load_unit": "requests"},
    "llm-aware": {
        "epsilon": 0.25, "cache_aware": True, "placement_memory": True, "long_stickiness": True,
        "long_prompt_tokens": 800, "long_load_factor": 2.0,
        "prefix_index": False, "prefix_feedback": False,
        # the walk's tests: llm-aware decides as before predicted times (tests/routing/test_ttft.py: on)
        "ttft_decisions": False, "ttft_margin": 1.0, "ttft_recompute_cost": True, "ttft_guard_factor": 2.0,
    },
    # the peers' sources' defaults (docs/peer-policies.md)
    "prefix-affinity": {"prefix_weight": 3.0, "queue_weight": 2.0, "kv_weight": 2.0, "max_prefix_blocks": 256,
                        "blocks_per_replica": 31_250, "kv_capacity_tokens": 500_000},
    "radix-balance": {"cache_threshold": 0.3, "balance_abs_threshold": 64, "balance_rel_threshold": 1.5,
                      "blocks_per_replica": 1_048_576},
    "chwbl": {"load_factor": 1.25, "replication": 256},
    "kv-cost": {"overlap_score_credit": 1.0, "prefill_load_scale": 1.0, "blocks_per_replica": 31_250},
}


def routing(**knobs: Any) -> RoutingSettings:
    """BASE with ``knobs`` as a policy spec gives them: shared keys, or the chosen policy's;
    ``slots`` and ``cache_tokens``: the replicas' ([routing.replicas])."""
    facts = {f"replicas.{key}": knobs.pop(key) for key in ("slots", "cache_tokens") if key in knobs}
    return parse_routing(with_knobs(BASE, {**knobs, **facts}))


def key_with_walk(router: Router, *prefix: str) -> str:
    """A conversation id whose ring walk starts with ``prefix`` (found by search: deterministic)."""
    from extproc.routing import stable_hash

    for index in range(100_000):
        key = f"conv-{index}"
        walk = list(router.ring.walk(stable_hash(key, router.settings.hash_seed)))
        if tuple(walk[: len(prefix)]) == prefix:
            return key
    raise AssertionError(f"no key walks {prefix}")
