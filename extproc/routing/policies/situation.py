"""What a policy may look at for one request, and the bounded-load walk they share."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from extproc.routing.blocks import covered_tokens
from extproc.routing.decision import Candidate, Check, Decision, RouteRequest, Trace
from extproc.routing.ledger import LoadLedger, LoadUnit
from extproc.routing.placement import Placement
from extproc.routing.ring import HashRing

# NamedTuple(...) goes through a Python-level __new__ (with keywords, through a dict too):
# 0.3-1.2 µs a tuple. On the per-request path tuples are built directly, positionally
# in field order, with tuple.__new__(Cls, (...)) (~0.1 µs); the tests pin every field.
new = tuple.__new__
_UNBOUNDED_REST = tuple(Trace._field_defaults[name] for name in Trace._fields[5:])  # preferred .. figures
NO_PEER_FIELDS = tuple(Trace._field_defaults[name] for name in Trace._fields[Trace._fields.index("prompt_blocks"):])


class Situation(NamedTuple):
    """Everything a policy may look at for one request (read-only)."""

    request: RouteRequest
    key_hash: int  # stable hash of the conversation (ring position)
    ring: HashRing
    ledger: LoadLedger
    placement: Placement | None  # remembered placement, only if that replica is eligible
    avoid: frozenset[str]  # replicas not to pick (unhealthy)
    eligible: tuple[str, ...]  # the ring's replicas minus ``avoid``, in name order

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
        if not self.avoid:
            return self.ledger.total(unit)
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
    situation: Situation,
    first: str,
    loads: Mapping[str, int],
    cost: int,
    cap: float,
    discounted: str | None = None,
    discounted_cost: int = 0,
    cached: str | None = None,
    long_cap: float | None = None,
) -> tuple[str | None, tuple[Check, ...]]:
    """Try ``first``, then the other eligible replicas clockwise, and take the first whose
    load + cost stays within its limit.

    The request costs ``cost``, except on ``discounted`` (llm-aware: the replica holding
    its cache) where it costs ``discounted_cost``.

    An idle replica always accepts: in tokens a single request can exceed its share of
    the cap on its own, and sending it past an idle home would only lose the cache.
    This never overrides the cap while some replica fits under it (an idle replica
    fits whenever any other does, since loads are never negative).

    ``cached`` names the replica holding this request's cache when it is also the
    preferred one (llm-aware only). Its limit is ``long_cap`` when given, and it has one
    request of slack: it accepts while its load *before* the request is under its limit.
    That is the token analogue of the paper's ⌈(1+ε)·m/n⌉, which in requests also lets a
    replica under the cap take one more; without it one large prefill elsewhere on the
    replica pushes every small cached follow-up away at light load, each redirect paying
    a full reprocess.
    """
    check = _check(first, loads, cost, cap, discounted, discounted_cost, cached, long_cap)
    if check.accepted:  # the usual case: the ring is not walked at all
        return first, (check,)
    checks = [check]
    for name in situation.walk():
        if name != first:
            check = _check(name, loads, cost, cap, discounted, discounted_cost, cached, long_cap)
            checks.append(check)
            if check.accepted:
                return name, tuple(checks)
    return None, tuple(checks)


def _check(name: str, loads: Mapping[str, int], cost: int, cap: float, discounted: str | None,
           discounted_cost: int, cached: str | None, long_cap: float | None) -> Check:
    """Whether ``name`` takes the request (the rules in ``first_fit``)."""
    cost_here = discounted_cost if name == discounted else cost
    load = loads[name]
    if name == cached:
        is_long = long_cap is not None
        limit = long_cap if is_long else cap
        accepted = load == 0 or load + cost_here <= limit or load < limit  # type: ignore[operator]
    else:
        is_long, limit = False, cap
        accepted = load == 0 or load + cost_here <= cap
    return new(Check, (name, load, cost_here, limit, accepted, is_long))


def least_loaded(candidates: Iterable[str], loads: Mapping[str, int], cost: int,
                 discounted: str | None = None, discounted_cost: int = 0) -> str:
    """The candidate least loaded once this request is added (ties: by name)."""
    return min(candidates,
               key=lambda name: (loads[name] + (discounted_cost if name == discounted else cost), name))


def unbounded_decision(policy: str, situation: Situation, replica: str, reason: str,
                       home: str | None = None) -> Decision:
    """A pick made without looking at load: counts as one request, brings its whole prompt."""
    request = situation.request
    prompt, max_tokens = request.prompt_tokens, request.max_tokens
    placement = situation.placement
    cached = 0
    if placement is not None and placement.replica == replica:
        cached = min(placement.prompt_tokens, prompt)
    trace = new(Trace, (policy, prompt, max_tokens, None, home) + _UNBOUNDED_REST)  # unit=None; the rest unset
    return new(Decision, (replica, reason, 1, prompt + max_tokens, cached, trace))


def peer_decision(policy: str, situation: Situation, replica: str, reason: str, matched_blocks: int,
                  candidates: tuple[Candidate, ...] = (), figures: tuple[tuple[str, float], ...] = (),
                  **trace: Any) -> Decision:
    """A peer policy's pick: one request on the ledger, its whole prompt charged in tokens,
    and the prompt share its view says the pick holds as the predicted cache."""
    request = situation.request
    prompt, max_tokens = request.prompt_tokens, request.max_tokens
    blocks = len(request.prefix_blocks)
    cached = covered_tokens(prompt, blocks, matched_blocks)
    made = Trace(policy, prompt, max_tokens, "requests", cached_tokens=cached, prompt_blocks=blocks,
                 candidates=candidates, figures=figures, loads=situation.load_items("requests"), **trace)
    return new(Decision, (replica, reason, 1, prompt + max_tokens, cached, made))
