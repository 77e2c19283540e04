"""llm-aware's decisions on predicted time to first token (docs/policies.md): the replica whose
first token is predicted soonest, within the guard rail (guard.py); a request leaves its
preferred replica only for one predicted ttft_margin sooner."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import extproc
from extproc.routing.adapters import seen_running
from extproc.routing.policies.llm_aware.bounds import FOLLOW_UP_REQUESTS_FLOOR
from extproc.routing.policies.llm_aware.guard import GuardRail
from extproc.routing.policies.llm_aware.params import LlmAwareParams
from extproc.routing.policies.llm_aware.warm import model_wait, warm_floor, warm_slots
from extproc.routing.policies.situation import Situation, new
from extproc.routing.speeds import Speed

# Up to this many replicas llm-aware predicts the first token on each; beyond, on a few candidates.
PREDICT_ALL_REPLICAS = 16
Predicted = tuple[tuple[str, float], ...]  # (replica, predicted seconds to the first token) weighed


class TtftPrediction:
    def __init__(self, params: LlmAwareParams, slots: int) -> None:
        self.margin = params.ttft_margin
        self.recompute_cost = params.ttft_recompute_cost
        self.guard_factor = params.ttft_guard_factor
        self.slots = slots  # a replica's (ReplicaFacts): below, a new request shares the replica; at it, it waits

    def decide(self, situation: Situation, preferred: str, preferred_cost: int, costs: dict[str, int], work: int,
               average: float, cached: bool, holds_cache: bool) -> tuple[str, Predicted] | None:
        """(the pick, the predictions weighed); None when ``preferred`` is past the guard rail (the
        bounded walk decides). ``cached``: the preferred replica holds the cache and is charged
        for it; ``holds_cache``: it holds some of the prompt."""
        ledger = situation.ledger
        guard = new(GuardRail, (ledger.loads("tokens"), ledger.loads("requests"), self.guard_factor * average))
        slots_floor = warm_slots(situation, self.slots)
        # one long prefill on the cached replica of a light fleet is no imbalance
        floor = max(FOLLOW_UP_REQUESTS_FLOOR if cached else 1, warm_floor(situation, preferred, slots_floor))
        if guard.past(preferred, preferred_cost, floor):
            return None
        return self.soonest(situation, preferred, costs, work, guard, holds_cache, slots_floor)

    def soonest(self, situation: Situation, preferred: str, costs: dict[str, int], work: int, guard: GuardRail,
                cached: bool, slots_floor: int) -> tuple[str, Predicted]:
        """The replica whose first token is predicted soonest, and the predictions weighed
        (the preferred replica's, then the best other's). The other must be predicted
        ttft_margin sooner (a move is also charged the cached tokens it computes again when the
        preferred replica holds the cache: ``cached``); replicas past the guard rail are
        not candidates. Of the prefix index's holders only those the lookup entered count as
        cached (entering every holder of a shared system prompt changed no figure on the
        Mooncake trace and cost a p99 of 1.2 ms at 64 replicas). ``slots_floor``: ``warm_slots``."""
        loads, running = guard.tokens, seen_running(guard.requests, self.slots, situation.request.unbatched)
        wait = model_wait(situation, preferred)
        here = predicted_ttft(self.slots, situation.speeds.speed(preferred), loads[preferred], running[preferred],
                              costs.get(preferred, work)) + wait
        # a new conversation too stays on its ring home unless elsewhere is ttft_margin sooner: the
        # learnt speeds of equal replicas differ by noise, which would steer it off at random (a
        # model's load is no noise: the margin is not taken of it)
        needed = (here - wait) / (1 + self.margin) + wait
        kept = costs.get(preferred, work) if cached and self.recompute_cost else None
        best, soonest = self.soonest_other(situation, preferred, costs, work, guard, running, kept, slots_floor)
        if best is None:
            return preferred, ((preferred, here),)
        return (best if soonest < needed else preferred), ((preferred, here), (best, soonest))

    def soonest_other(self, situation: Situation, preferred: str, costs: dict[str, int], work: int,
                      guard: GuardRail, running: Mapping[str, int], kept: int | None,
                      slots_floor: int) -> tuple[str | None, float]:
        """(the eligible replica but ``preferred`` predicted soonest within the guard rail, its
        prediction); (None, inf) when there is none. ``kept``: the request's cost on the cached
        preferred replica; a move is charged the tokens it computes again once more, the delay
        they bring the requests behind it (None: not charged). ``running``: the requests in flight
        as the predictions see them (adapters.seen_running)."""
        loads, speed, slots = guard.tokens, situation.speeds.speed, self.slots
        best, soonest = None, math.inf
        for name in candidates(situation, costs):
            load, cost = loads[name], costs.get(name, work)
            if name == preferred or guard.past(name, cost, warm_floor(situation, name, slots_floor)):
                continue
            here = speed(name)
            seconds = predicted_ttft(slots, here, load, running[name], cost) + model_wait(situation, name)
            if kept is not None and cost > kept:
                seconds += (cost - kept) * here.prefill_s_per_token
            if seconds < soonest:
                best, soonest = name, seconds
        return best, soonest


def candidates(situation: Situation, costs: dict[str, int]) -> Iterable[str]:
    """The replicas whose first token is predicted: every eligible one in a fleet of up to
    PREDICT_ALL_REPLICAS; in a larger one those holding part of the prompt (``costs``), the
    least loaded in tokens and in requests, and the one learnt fastest (64 predictions cost
    ~25 µs in Python; a replica with none of these is rarely the soonest)."""
    eligible = situation.eligible
    if len(eligible) <= PREDICT_ALL_REPLICAS or situation.avoid:
        return eligible
    picked = dict.fromkeys(costs)
    ledger = situation.ledger
    least_tokens, least_requests = LEAST_LOADED(ledger.loads("tokens"), ledger.loads("requests"))
    picked[least_tokens] = picked[least_requests] = None
    fastest = situation.speeds.fastest
    if fastest is not None:
        picked[fastest] = None
    return picked


def predicted_ttft(slots: int, speed: Speed, load: int, running: int, cost: int) -> float:
    """Seconds until the first token of a request bringing ``cost`` tokens to a replica holding
    ``load`` tokens of ``running`` requests. With a free slot (``running < slots``) it shares the
    replica with them: each delays it by at most its own work (processor sharing), at most
    ``cost``; without one it waits behind all of it."""
    ahead = min(load, running * cost) if running < slots else load
    return speed.overhead_s + (ahead + cost) * speed.prefill_s_per_token


def least_loaded_both(tokens: Mapping[str, int], requests: Mapping[str, int]) -> tuple[str, str]:
    """(the replica least loaded in tokens, the one least loaded in requests), each the first
    of its ties in the ledger's order, in one pass."""
    items = iter(tokens.items())
    least_tokens, fewest_tokens = next(items, ("", 0))
    least_requests, fewest_requests = least_tokens, requests.get(least_tokens, 0)
    for name, load in items:
        if load < fewest_tokens:
            least_tokens, fewest_tokens = name, load
        running = requests[name]
        if running < fewest_requests:
            least_requests, fewest_requests = name, running
    return least_tokens, least_requests


def least_loaded_by_min(tokens: Mapping[str, int], requests: Mapping[str, int]) -> tuple[str, str]:
    """``least_loaded_both`` by two min() calls (the ledger keeps both maps in one order: the ties
    fall alike)."""
    return min(tokens, key=tokens.__getitem__), min(requests, key=requests.__getitem__)


# Compiled, the loop costs half of the two min() calls at 64 replicas (0.9 against 1.9 µs, timeit);
# as Python the min() calls run in C and a decision is ~0.3 µs faster with them.
LEAST_LOADED = least_loaded_both if extproc.CORE == "compiled" else least_loaded_by_min
