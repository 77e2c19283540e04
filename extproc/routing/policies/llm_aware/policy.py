"""llm-aware's decision, from its parts: where the cache is (``where``), the bounds on the walk
(bounds.py), the prediction of the first token (prediction.py) and the trace (trace.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from extproc.routing.decision import Check, Decision, Trace
from extproc.routing.policies.bounded_walk import Discount, average_and_cap, first_fit, least_loaded
from extproc.routing.policies.llm_aware.bounds import Bounds
from extproc.routing.policies.llm_aware.index import INDEX_BLOCK_CHARS
from extproc.routing.policies.llm_aware.params import LlmAwareParams
from extproc.routing.policies.llm_aware.prediction import Predicted, TtftPrediction
from extproc.routing.policies.llm_aware.trace import LlmAwareTrace
from extproc.routing.policies.llm_aware.view import IndexView
from extproc.routing.policies.llm_aware.warm import warm_first, warm_only
from extproc.routing.policies.llm_aware.where import WhereCache
from extproc.routing.policies.situation import Situation, new


class LlmAware:
    name: ClassVar[str] = "llm-aware"

    def __init__(self, params: LlmAwareParams, slots: int, where: WhereCache, view: IndexView | None) -> None:
        self.cache_aware = params.cache_aware
        self.placement_memory = params.placement_memory
        self.where = where
        self.view = view  # the prefix index's upkeep, which the Router feeds (None: placement memory)
        self.index = view.index if view is not None else None
        self.prefix_block_chars = INDEX_BLOCK_CHARS if view is not None else 0
        self.bounds = Bounds(params)
        self.ttft = TtftPrediction(params, slots) if params.ttft_decisions else None

    def decide(self, situation: Situation) -> Decision | None:
        eligible = situation.eligible
        if not eligible:
            return None
        request, residency = situation.request, situation.residency
        work = request.prompt_tokens + request.max_tokens  # what the request costs where nothing is cached
        home = situation.home()
        assert home is not None  # eligible is not empty
        # expected: replica -> cached tokens there; costs: replica -> the request's new tokens there
        cached_on, expected, costs, seen, holders = self.where.where_cached(situation, home)
        if residency.tracked:  # where the request's model is cold its cache is gone
            cached_on, expected, costs = warm_only(situation, cached_on, expected, costs)
        if not self.cache_aware:
            costs = {}
        by_memory = self.placement_memory and cached_on is not None
        preferred = cached_on if by_memory and cached_on is not None else home
        preferred_cost = costs.get(preferred, work)
        loads = situation.ledger.loads("tokens")
        total = situation.total("tokens") + preferred_cost
        average, cap = average_and_cap(total, len(eligible), self.bounds.epsilon, "tokens")
        least_recent = self.where.least_recent_fit(situation, loads, work, cap) if seen and cached_on is None else None
        if least_recent is not None:  # a prompt no replica holds: where the fleet forgets its least recent
            preferred = least_recent[0]
            seen = (*seen[:2], (*seen[2], ("least_recent_use", least_recent[1])))
        warmed = residency.tracked and cached_on is None and residency.cold(preferred, request.model)
        if warmed:  # no cache to keep: where the model is loaded
            preferred, holders = warm_first(situation, preferred, holders)
        cached = preferred if self.cache_aware and cached_on == preferred else None
        asked: list[tuple[str, float]] = []  # the cap in requests' figures, once the walk asks it
        discount = self.bounds.discount(situation, preferred, cached, cached_on == preferred, costs, expected,
                                        average, holders, bool(seen), asked)
        timed = None if self.ttft is None else self.ttft.decide(
            situation, preferred, preferred_cost, costs, work, average, cached is not None,
            cached_on == preferred and expected.get(preferred, 0) > 0)
        checks: tuple[Check, ...] = ()
        walked, predicted = timed if timed is not None else (None, ())
        if timed is None:
            walked, checks = first_fit(situation, preferred, loads, work, cap, discount)
        if asked:
            seen = (*seen[:2], (*seen[2], *asked))
        if walked is None:
            chosen = least_loaded(eligible, loads, work, discount)
            reason = "kept" if chosen == cached and discount.keep_factor else "least-loaded"
        elif timed is not None and walked != preferred:
            chosen, reason = walked, "faster"
        elif walked == preferred:
            chosen = preferred
            reason = ("home" if preferred == home else "warm" if warmed else "least-recent" if least_recent
                      else "prefix" if seen else "sticky")
            if checks:
                reason += _over_cap(checks, loads[chosen], preferred_cost, cap, discount)
        else:
            chosen, reason = walked, "overflow"
        return self.decision(situation, chosen, reason, (home, preferred, by_memory, least_recent is not None),
                             expected, costs, preferred_cost, (total, average, cap, discount.long_cap), checks, seen,
                             predicted)

    def decision(self, situation: Situation, chosen: str, reason: str, preference: tuple[str, str, bool, bool],
                 expected: Mapping[str, int], costs: Mapping[str, int], preferred_cost: int,
                 bounds: tuple[int, float, float, float | None], checks: tuple[Check, ...], seen: tuple[Any, ...],
                 predicted: Predicted) -> Decision:
        """The decision and its trace. ``preference``: (the ring home, the preferred replica, whether
        where the cache is preferred it, whether the least recent rule did); ``bounds``: (the total
        load with this request, the average, the cap, the long cap)."""
        request, placement = situation.request, situation.placement
        home, preferred, by_memory, least_recent = preference
        by = ("prefix" if seen else "memory") if by_memory else ("lru" if least_recent else "ring")
        total, average, cap, long_cap = bounds
        details = new(LlmAwareTrace, (
            "tokens", home, preferred, by,
            placement.replica if placement else None,  # remembered
            placement.prompt_tokens if placement else None,  # remembered_tokens
            expected.get(preferred, 0),  # cached_tokens
            preferred_cost, situation.load_copy("tokens"), total, average, cap, long_cap,
            self.bounds.long_prompt_tokens if long_cap is not None else None,  # long_threshold
            checks,
            *(seen or (None, (), ())),  # prompt_blocks, candidates, figures
            predicted,
        ))
        trace = new(Trace, (self.name, request.prompt_tokens, request.max_tokens, details))
        cost = costs.get(chosen, request.prompt_tokens + request.max_tokens)
        return new(Decision, (chosen, reason, cost, cost, expected.get(chosen, 0), trace))


def _over_cap(checks: tuple[Check, ...], load: int, cost: int, cap: float, discount: Discount) -> str:
    """"-long" or "-requests" when only the long cap, or only the cap in requests, let the
    preferred replica take the request (``load``: its load, ``cost``: the request's there)."""
    if not (load and load + cost > cap and not (discount.cached and load < cap)):
        return ""
    first = checks[0]
    return "-long" if first.load + first.cost <= first.limit or first.load < first.limit else "-requests"
