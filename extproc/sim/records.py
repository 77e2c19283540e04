"""Simulated requests as rows of the live runs' schema (``extproc.records``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from extproc.sim.request import Request

# Simulated time 0 is this instant (UTC epoch seconds): fixed, so rows are reproducible.
SIM_EPOCH_S = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def request_rows(requests: Iterable[Request], run_id: str, policy: str, seed: int) -> list[dict[str, Any]]:
    rows = []
    for r in requests:
        ok = r.error is None
        rows.append({
            "run_id": run_id,
            "policy": policy,
            "seed": seed,
            "simulated": True,
            "conversation": r.conversation,
            "turn": r.turn,
            "replica": r.replica,
            "route_reason": r.reason,
            "est_prompt_tokens": r.prompt_tokens,
            "predicted_cached_tokens": r.predicted_cached,
            "cache_n": r.cache_n if ok else None,
            "prompt_n": r.prompt_n if ok else None,
            "prompt_ms": (r.first_token_at - r.started_at) * 1000.0 if ok else None,
            "predicted_n": r.max_tokens if ok else None,
            "predicted_ms": (r.finished_at - r.first_token_at) * 1000.0 if ok else None,
            "ttft_s": r.first_token_at - r.arrived_at if ok else None,
            "latency_s": r.finished_at - r.arrived_at,
            "status": r.status,
            "error": r.error,
            "started_at": SIM_EPOCH_S + r.arrived_at,
            "finished_at": SIM_EPOCH_S + r.finished_at,
        })
    return rows
