"""The bounded-load walk that bounded and llm-aware share: the cap, the first fit, the fallback.

A request goes to the preferred replica if its load stays within cap = (1 + ε) ×
average, else to the next eligible replica clockwise that fits, else to the least
loaded. llm-aware's discount (what the request costs where its prefix is cached, and
the one request of slack its cached replica keeps) comes as one ``Discount`` value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from itertools import chain, filterfalse
from typing import NamedTuple

from extproc.routing.decision import Check
from extproc.routing.ledger import LoadUnit
from extproc.routing.policies.situation import Situation, new


class Discount(NamedTuple):
    """Where the request is cheaper than its whole work, and which replica keeps slack for it."""

    costs: Mapping[str, int]  # replica -> the request's cost there (its new tokens); elsewhere the full cost
    cached: str | None = None  # the preferred replica, when it holds the cache: one request of slack
    long_cap: float | None = None  # that replica's limit instead of the cap (long stickiness)
    # the replicas tried after the preferred one, before the ring, most expected reuse first:
    # called only then (it may enter their costs)
    holders: Callable[[], tuple[str, ...]] | None = None
    # the prefix index: over the cap, ``cached`` keeps the request unless another replica fits
    # under the cap or would land this many times (1 + ε) lower; being idle is not enough
    keep_factor: float | None = None
    # the prefix index: whether ``cached`` is within the cap in requests, ⌈(1 + ε) × average⌉, and
    # takes the request over its limit in tokens (it brings only its new tokens there): asked only then
    within_requests: Callable[[], bool] | None = None


NO_DISCOUNT = Discount({})
# the walk's outcomes, reason codes of every policy that walks it
WALK_REASONS = {
    "overflow": "the preferred replica was over its cap; the next one clockwise with room",
    "least-loaded": "no replica fitted under the cap; the one least loaded after this request",
}


def average_and_cap(total: int, replicas: int, epsilon: float, unit: LoadUnit) -> tuple[float, float]:
    """Mean load including this request, and the bound (1 + ε) × mean.

    In requests the cap rounds up to a whole request (the paper's ⌈(1+ε)·m/n⌉), which
    guarantees some replica always fits; tokens are fine-grained and are not rounded.
    """
    average = total / replicas
    cap = (1 + epsilon) * average
    if unit == "requests":
        cap = float(math.ceil(cap - 1e-9))  # tolerate float noise: 1.1 * 10 is 11.000000000000002
    return average, cap


def first_fit(situation: Situation, first: str, loads: Mapping[str, int], cost: int, cap: float,
              discount: Discount = NO_DISCOUNT) -> tuple[str | None, tuple[Check, ...]]:
    """Try ``first``, then the other eligible replicas clockwise, and take the first whose
    load + cost stays within its limit (the cost there: ``discount.costs``, else ``cost``).
    With ``discount.holders`` (llm-aware's prefix index) those are tried before the ring.

    An idle replica always accepts: in tokens a single request can exceed its share of
    the cap on its own, and sending it past an idle home would only lose the cache.
    This never overrides the cap while some replica fits under it (an idle replica
    fits whenever any other does, since loads are never negative). With
    ``discount.keep_factor`` (the prefix index) an idle replica further on does not take a
    request whose cached replica is preferred: its whole prefill there can cost more than
    the cached replica's backlog, and ``least_loaded`` weighs the two.

    ``discount.cached`` names the replica holding this request's cache when it is also
    the preferred one (llm-aware only). Its limit is ``discount.long_cap`` when given, and
    it has one request of slack: it accepts while its load *before* the request is under
    its limit. That is the token analogue of the paper's ⌈(1+ε)·m/n⌉, which in requests
    also lets a replica under the cap take one more; without it one large prefill
    elsewhere on the replica pushes every small cached follow-up away at light load,
    each redirect paying a full reprocess. With ``discount.within_requests`` (the prefix
    index) it also accepts while its requests in flight stay within the cap in requests.
    """
    check = _check(first, loads, cost, cap, discount)
    if check.accepted:  # the usual case: the ring is not walked at all
        return first, (check,)
    checks = [check]
    walk: Iterable[str] = situation.walk()
    if discount.holders is not None:  # in order, each once; the ring walked only as far as needed
        listed = discount.holders()
        holders = set(listed)
        walk = chain(listed, filterfalse(holders.__contains__, walk))
    for name in walk:
        if name != first:
            check = _check(name, loads, cost, cap, discount)
            checks.append(check)
            if check.accepted:
                return name, tuple(checks)
    return None, tuple(checks)


def _check(name: str, loads: Mapping[str, int], cost: int, cap: float, discount: Discount) -> Check:
    """Whether ``name`` takes the request (the rules in ``first_fit``)."""
    cost_here = discount.costs.get(name, cost)
    load = loads[name]
    if name == discount.cached:
        long_cap = discount.long_cap
        is_long = long_cap is not None
        limit = long_cap if long_cap is not None else cap
        accepted = (load == 0 or load + cost_here <= limit or load < limit
                    or (discount.within_requests is not None and discount.within_requests()))
    else:
        is_long, limit = False, cap
        accepted = load + cost_here <= cap or (load == 0 and (discount.keep_factor is None or discount.cached is None))
    return new(Check, (name, load, cost_here, limit, accepted, is_long))


def least_loaded(candidates: Iterable[str], loads: Mapping[str, int], cost: int,
                 discount: Discount = NO_DISCOUNT) -> str:
    """The candidate least loaded once this request is added (ties: by name); with
    ``discount.keep_factor``, the cached replica's load counted that many times lower."""
    costs, cached, factor = discount.costs, discount.cached, discount.keep_factor or 1.0
    return min(candidates, key=lambda name: ((loads[name] + costs.get(name, cost)) / (factor if name == cached else 1),
                                             name))
