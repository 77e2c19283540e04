"""Many decisions of every policy on one deterministic workload, as data: what
tests/routing/test_decisions_unchanged.py compares with the decisions recorded in
tests/routing/data/decisions.json.gz, field by field.

The workload exercises what changes a decision: multi-turn conversations sharing system
prompts (prefix blocks), requests in flight, failures, a failed-over answer, reported cached
tokens with timings, replicas avoided, a replica leaving and coming back.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from extproc.routing import Router, RouteRequest, Ticket
from extproc.routing.blocks import prefix_blocks
from extproc.routing.speeds import AnswerTimings

# (label, knobs over tests/routing/conftest.py's BASE); the label names the recorded run
CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("round-robin", {"policy": "round-robin"}),
    ("mod-n", {"policy": "mod-n"}),
    ("consistent", {"policy": "consistent"}),
    ("bounded", {"policy": "bounded"}),
    ("bounded-tokens", {"policy": "bounded", "load_unit": "tokens"}),
    ("llm-aware", {"policy": "llm-aware"}),
    ("llm-aware-ttft", {"policy": "llm-aware", "ttft_decisions": True}),
    ("llm-aware-index", {"policy": "llm-aware", "prefix_index": True, "prefix_feedback": True,
                         "replicas.cache_tokens": 3_000, "ttft_decisions": True}),
    ("llm-aware-index-walk", {"policy": "llm-aware", "prefix_index": True, "replicas.cache_tokens": 3_000}),
    ("prefix-affinity", {"policy": "prefix-affinity"}),
    ("radix-balance", {"policy": "radix-balance"}),
    ("chwbl", {"policy": "chwbl"}),
    ("kv-cost", {"policy": "kv-cost"}),
)
DECISIONS = 400
REPLICAS = tuple(f"llm-{index}" for index in range(5))
SYSTEM = ("You are a careful assistant. " * 12, "Answer in French, briefly. " * 9, "")


def decisions(router: Router, decisions: int = DECISIONS) -> list[dict[str, Any]]:
    """Drive ``router`` (on REPLICAS) through the workload; each decision as data (None: no pick)."""
    rng = random.Random(7)
    block_chars = router.policy.prefix_block_chars
    in_flight: list[Ticket] = []
    turns: dict[int, int] = {}
    out: list[dict[str, Any]] = []
    for index in range(decisions):
        if index == decisions // 2:
            router.set_replicas(REPLICAS[:-1])  # one leaves with its requests in flight
        elif index == decisions * 3 // 4:
            router.set_replicas(REPLICAS)
        slot = rng.randrange(24)
        turn = turns[slot] = turns.get(slot, -1) + 1
        text = SYSTEM[slot % 3] + f"conversation {slot}: " * 20 + "".join(f"turn {t}: " * 30 for t in range(turn))
        request = RouteRequest(str(index), f"c-{slot}", len(text) // 4 + rng.randrange(20), rng.choice((32, 64, 256)),
                               prefix_blocks(text, block_chars) if block_chars else ())
        avoid = (rng.choice(REPLICAS),) if rng.random() < 0.1 else ()
        ticket = router.route(request, avoid)
        decision = None if ticket is None else ticket.decision
        out.append(None if decision is None else {
            "replica": decision.replica, "reason": decision.reason, "cost": decision.cost,
            "charged_tokens": decision.charged_tokens, "predicted_cached_tokens": decision.predicted_cached_tokens,
            "trace": decision.trace.as_dict()})
        if ticket is not None:
            in_flight.append(ticket)
        while len(in_flight) > 6 or (in_flight and rng.random() < 0.3):
            done = in_flight.pop(rng.randrange(len(in_flight)))
            _finish(router, rng, done)
    return out


def _finish(router: Router, rng: random.Random, ticket: Ticket) -> None:
    ok = rng.random() > 0.08
    served = rng.choice(REPLICAS) if ok and rng.random() < 0.05 else None
    request, decision = ticket.request, ticket.decision
    if ticket.release(ok, served) and ok:  # False: its replica left, its load with it
        cached = max(0, decision.predicted_cached_tokens - rng.choice((0, 0, 0, 64, 200)))
        timings = AnswerTimings(request.prompt_tokens - cached, 10.0 + request.prompt_tokens / 50,
                                request.max_tokens, request.max_tokens * 18.0, cached)
        router.report_cached(request, decision.replica, decision.predicted_cached_tokens, cached, timings)


def record(make_router: Callable[[dict[str, Any]], Router]) -> dict[str, list[dict[str, Any]]]:
    """Every case's decisions: ``make_router(knobs)`` builds a router on REPLICAS."""
    return {label: decisions(make_router(knobs)) for label, knobs in CASES}
