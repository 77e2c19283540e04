"""What a policy is given and what it returns: the pick, why, and the numbers that led there, as data.

Text is made from these fields only at the edge (``render.render_trace``); logs and
the simulator store ``Trace.as_dict()`` so every decision can be queried later.
Immutable NamedTuples, not frozen dataclasses: a frozen dataclass's __init__ costs
~8x more, and one is built on every request.

On the per-request path (bounded, llm-aware) a Trace is built positionally, in field
order, with ``tuple.__new__`` (``situation.new``; each slot named by a comment), not with
``Trace(...)`` and keywords. Measured on a 2-core x86_64 machine (2026-12-01): the
keyword call costs 1.96 µs against 0.64 µs (timeit, llm-aware's 18 fields), and in one
``llm-ring bench decisions --fleets 3 64`` run each, llm-aware's median went from 6.8 /
8.4 µs (3 / 64 replicas) to 7.6 / 9.3 µs with keywords: +11 %, so the positional form
stays. The peer policies, slower by far for other reasons, use keywords
(``situation.peer_decision``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple


class RouteRequest(NamedTuple):
    """One request as the router sees it."""

    request_id: str
    conversation: str
    prompt_tokens: int  # estimated from the body's text
    max_tokens: int  # the output the client asked for
    prefix_blocks: tuple[int, ...] = ()  # chained hashes of fixed-size prompt blocks, oldest first (empty: unknown)


class Check(NamedTuple):
    """One candidate the bounded walk looked at."""

    replica: str
    load: int
    cost: int
    limit: float
    accepted: bool
    long_limit: bool = False  # ``limit`` is the long-conversation cap

    def as_dict(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "load": self.load,
            "cost": self.cost,
            "limit": self.limit,
            "accepted": self.accepted,
            "long_limit": self.long_limit,
        }


class Candidate(NamedTuple):
    """One replica as a peer policy scored it."""

    replica: str
    matched_blocks: int  # leading prompt blocks the policy's view says the replica holds
    load: int  # what the policy weighs as load (requests in flight; kv-cost: active blocks)
    score: float  # the policy's number for it (see the policy's rule: higher or lower wins)

    def as_dict(self) -> dict[str, Any]:
        return {"replica": self.replica, "matched_blocks": self.matched_blocks, "load": self.load,
                "score": self.score}


class Trace(NamedTuple):
    policy: str
    prompt_tokens: int
    max_tokens: int
    unit: str | None = None  # "requests" or "tokens" for load-aware policies
    home: str | None = None  # ring home (or mod-n pick)
    preferred: str | None = None
    preferred_by: str | None = None  # "ring" | "memory" | "prefix" | "lru"
    remembered: str | None = None  # placement memory: last replica
    remembered_tokens: int | None = None  # ... and the prompt size served there
    cached_tokens: int = 0  # predicted cached prefix on the preferred replica
    preferred_cost: int | None = None
    loads: Mapping[str, int] = MappingProxyType({})  # the eligible replicas' loads at the decision (a copy)
    total: int | None = None
    average: float | None = None
    cap: float | None = None
    long_cap: float | None = None
    long_threshold: int | None = None  # prompt tokens from which a conversation counts as long
    checks: tuple[Check, ...] = ()
    # peer policies
    prompt_blocks: int | None = None  # len(request.prefix_blocks)
    candidates: tuple[Candidate, ...] = ()
    figures: tuple[tuple[str, float], ...] = ()  # named numbers of the policy's rule (thresholds, spreads)
    # llm-aware on predicted time: (replica, predicted seconds to the first token) of the candidates weighed
    predicted: tuple[tuple[str, float], ...] = ()
    # a policy's own typed details, a NamedTuple of its file (None: it has none beyond the fields above)
    details: tuple[Any, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"policy": self.policy, "prompt_tokens": self.prompt_tokens,
                                "max_tokens": self.max_tokens, "cached_tokens": self.cached_tokens}
        for name in ("unit", "home", "preferred", "preferred_by", "remembered", "remembered_tokens",
                     "preferred_cost", "total", "average", "cap", "long_cap", "long_threshold",
                     "prompt_blocks"):
            value = getattr(self, name)
            if value is not None:
                data[name] = value
        if self.loads:
            data["loads"] = dict(self.loads)
        if self.checks:
            data["checks"] = [check.as_dict() for check in self.checks]
        if self.candidates:
            data["candidates"] = [candidate.as_dict() for candidate in self.candidates]
        if self.figures:
            data["figures"] = dict(self.figures)
        if self.predicted:
            data["predicted_ttft_s"] = dict(self.predicted)
        if self.details is not None:
            data["details"] = self.details._asdict()  # type: ignore[attr-defined]
        return data


class Decision(NamedTuple):
    replica: str
    reason: str
    cost: int  # charged in the policy's load unit (1 in requests mode)
    charged_tokens: int  # charged to the token ledger (the work this request brings)
    predicted_cached_tokens: int  # prefix the router expects the replica to have cached
    trace: Trace
