"""What a policy may look at for one request, and the bounded-load walk they share."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import NamedTuple

from extproc.routing.decision import Check, Decision, RouteRequest, Trace
from extproc.routing.ledger import LoadLedger, LoadUnit
from extproc.routing.placement import Placement
from extproc.routing.ring import HashRing


class Situation(NamedTuple):
    """Everything a policy may look at for one request (read-only)."""

    request: RouteRequest
    key_hash: int  # stable hash of the conversation (ring position)
    ring: HashRing
    ledger: LoadLedger
    placement: Placement | None  # remembered placement, only if that replica is eligible
    avoid: frozenset[str]  # replicas not to pick (unhealthy)

    @property
    def eligible(self) -> tuple[str, ...]:
        if not self.avoid:
            return self.ring.replicas
        return tuple(name for name in self.ring.replicas if name not in self.avoid)

    def walk(self) -> Iterator[str]:
        """Eligible replicas clockwise from the conversation's ring position."""
        avoid = self.avoid
        if not avoid:
            return self.ring.walk(self.key_hash)
        return (name for name in self.ring.walk(self.key_hash) if name not in avoid)

    def home(self) -> str | None:
        if not self.avoid:
            return self.ring.home(self.key_hash)
        return next(self.walk(), None)

    def total(self, unit: LoadUnit) -> int:
        loads = self.ledger.loads(unit)
        return self.ledger.total(unit) - sum(loads.get(name, 0) for name in self.avoid)

    def load_items(self, unit: LoadUnit) -> tuple[tuple[str, int], ...]:
        loads = self.ledger.loads(unit)
        if not self.avoid:
            return tuple(loads.items())
        return tuple((name, loads[name]) for name in self.eligible)

    def cached_tokens_on(self, replica: str) -> int:
        """The prefix the router expects ``replica`` to hold for this conversation."""
        placement = self.placement
        if placement is None or placement.replica != replica:
            return 0
        return min(placement.prompt_tokens, self.request.prompt_tokens)


def average_and_cap(total: int, replicas: int, epsilon: float, unit: LoadUnit) -> tuple[float, float]:
    """Mean load including this request, and the bound (1 + ε) × mean.

    In requests the cap rounds up to a whole request (the paper's ⌈(1+ε)·m/n⌉), which
    guarantees some replica always fits; tokens are fine-grained and are not rounded.
    """
    average = total / replicas
    cap = (1 + epsilon) * average
    if unit == "requests":
        cap = math.ceil(cap - 1e-9)  # tolerate float noise: 1.1 * 10 is 11.000000000000002
    return average, cap


def first_fit(
    order: Iterable[str],
    loads: Mapping[str, int],
    cost_of: Callable[[str], int],
    cap: float,
    cached: str | None = None,
    long_cap: float | None = None,
) -> tuple[str | None, tuple[Check, ...]]:
    """Walk ``order`` and take the first replica whose load + cost stays within its limit.

    An idle replica always accepts: in tokens a single request can exceed its share of
    the cap on its own, and sending it past an idle home would only lose the cache.
    This never overrides the cap while some replica fits under it (an idle replica
    fits whenever any other does, since loads are never negative).

    ``cached`` names the replica holding this request's cache (llm-aware only). Its
    limit is ``long_cap`` when given, and it has one request of slack: it accepts while
    its load *before* the request is under its limit. That is the token analogue of the
    paper's ⌈(1+ε)·m/n⌉, which in requests also lets a replica under the cap take one more;
    without it one large prefill elsewhere on the replica pushes every small cached
    follow-up away at light load, each redirect paying a full reprocess.
    """
    checks: list[Check] = []
    for name in order:
        cost = cost_of(name)
        load = loads[name]
        is_cached = name == cached
        is_long = is_cached and long_cap is not None
        limit = long_cap if is_long else cap
        accepted = load == 0 or load + cost <= limit or (is_cached and load < limit)  # type: ignore[operator]
        checks.append(Check(name, load, cost, limit, accepted, is_long))  # type: ignore[arg-type]
        if accepted:
            return name, tuple(checks)
    return None, tuple(checks)


def least_loaded(candidates: Iterable[str], loads: Mapping[str, int], cost_of: Callable[[str], int]) -> str:
    return min(candidates, key=lambda name: (loads[name] + cost_of(name), name))


def unbounded_decision(policy: str, situation: Situation, replica: str, reason: str,
                       home: str | None = None) -> Decision:
    """A pick made without looking at load: counts as one request, brings its whole prompt."""
    request = situation.request
    trace = Trace(policy, request.prompt_tokens, request.max_tokens, home=home)
    return Decision(replica, reason, 1, request.prompt_tokens + request.max_tokens,
                    situation.cached_tokens_on(replica), trace)
