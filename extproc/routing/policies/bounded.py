"""bounded: consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2016).

A request goes to the first replica clockwise from its ring position whose load, with
the request added, stays within cap = (1 + ε) × average, where the average counts
this request too. Load is counted in requests (each costs 1) or in tokens (each
costs its whole prompt + max_tokens, wherever it goes: the cache is ignored).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, ClassVar, NamedTuple

from pydantic import Field

from extproc.routing.decision import Check, Decision, Trace
from extproc.routing.ledger import LoadUnit
from extproc.routing.policies.bounded_walk import WALK_REASONS, average_and_cap, first_fit, least_loaded
from extproc.routing.policies.plugin import PolicyPlugin
from extproc.routing.policies.situation import HOME_REASON, Situation, new
from extproc.routing.render import check_line, headline, load_line

# [routing.bounded] (plugin.py: the functional form keeps the constraints under mypyc)
BoundedParams = NamedTuple("BoundedParams", [
    ("epsilon", Annotated[float, Field(gt=0, le=10, description="cap = (1 + epsilon) x average")]),
    ("load_unit", Annotated[LoadUnit, Field(description="count load in requests or in prompt + max tokens")]),
])
REASONS = {**HOME_REASON, **WALK_REASONS}


class BoundedTrace(NamedTuple):
    """bounded's numbers: the loads it weighed, the cap they give and the walk from the home."""

    unit: LoadUnit
    home: str  # the conversation's ring home, where the walk starts
    loads: Mapping[str, int]  # the eligible replicas' loads at the decision (a copy)
    total: int  # with this request
    average: float  # total / eligible replicas
    cap: float  # (1 + epsilon) x average (in requests, rounded up to a whole request)
    checks: tuple[Check, ...]  # each replica the walk looked at, in order

    def render(self, decision: Decision) -> list[str]:
        return [headline(decision, f"bounded ({self.unit.removesuffix('s')} mode)"),
                load_line(self.unit, self.loads, self.total, self.cap),
                *(check_line(check, decision.reason) for check in self.checks)]


class Bounded:
    name: ClassVar[str] = "bounded"
    prefix_block_chars: ClassVar[int] = 0

    def __init__(self, params: BoundedParams) -> None:
        self.epsilon = params.epsilon
        self.unit: LoadUnit = params.load_unit

    def decide(self, situation: Situation) -> Decision | None:
        eligible = situation.eligible
        if not eligible:
            return None
        request = situation.request
        unit = self.unit
        work = request.prompt_tokens + request.max_tokens
        cost = 1 if unit == "requests" else work
        loads = situation.ledger.loads(unit)
        total = situation.total(unit) + cost
        average, cap = average_and_cap(total, len(eligible), self.epsilon, unit)
        home = situation.home()
        assert home is not None  # eligible is not empty
        chosen, checks = first_fit(situation, home, loads, cost, cap)
        if chosen is None:
            chosen, reason = least_loaded(eligible, loads, cost), "least-loaded"
        else:
            reason = "home" if chosen == home else "overflow"
        details = new(BoundedTrace, (unit, home, situation.load_copy(unit), total, average, cap, checks))
        trace = new(Trace, (self.name, request.prompt_tokens, request.max_tokens, details))
        return new(Decision, (chosen, reason, cost, work, situation.cached_tokens_on(chosen), trace))


PLUGIN: PolicyPlugin = PolicyPlugin("bounded", BoundedParams, lambda params, routing, facts: Bounded(params), REASONS)
