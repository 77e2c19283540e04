"""llm-aware's bounds on the walk (bounded_walk.py), in tokens: where the cache is the request
costs only its new tokens, and the cached replica keeps one request of slack under the cap; a
long cached conversation may load it up to long_load_factor × average (long stickiness). With
the prefix index the cached replica keeps the request unless another lands (1 + ε) times lower,
and takes it while within the cap in requests."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

from extproc.routing.policies.bounded_walk import Discount, average_and_cap
from extproc.routing.policies.llm_aware.params import LlmAwareParams
from extproc.routing.policies.situation import Situation, new

# For a conversation's follow-up on the replica of its last turn the cap in requests is at least 2:
# below one request per replica on average ⌈(1 + ε) × average⌉ is 1 whatever ε, and a replica
# running one long prefill would send the follow-up to an idle replica to prefill it whole. New
# conversations on a popular prefix do not get it: they still spread one a replica.
FOLLOW_UP_REQUESTS_FLOOR = 2


class Bounds:
    def __init__(self, params: LlmAwareParams) -> None:
        self.epsilon = params.epsilon
        self.long_stickiness = params.long_stickiness
        self.long_prompt_tokens = params.long_prompt_tokens
        self.long_load_factor = params.long_load_factor

    def discount(self, situation: Situation, preferred: str, cached: str | None, holds_cache: bool,
                 costs: Mapping[str, int], expected: Mapping[str, int], average: float,
                 holders: Callable[[], tuple[str, ...]] | None, indexed: bool,
                 asked: list[tuple[str, float]]) -> Discount:
        """The walk's discount from ``preferred``. ``cached``: it, when it holds the cache and is
        charged for it; ``holds_cache``: it is where the cache is; ``indexed``: the prefix index
        looked; ``asked``: receives the cap in requests' figures, once the walk asks it."""
        long_cap = None
        if self.long_stickiness and holds_cache and situation.request.prompt_tokens >= self.long_prompt_tokens:
            # with the index, against the prefix cached there when that is larger: what a move computes again
            long_cap = self.long_load_factor * (max(average, expected[preferred]) if indexed else average)
        within_requests = partial(self.cap_in_requests, situation, cached, asked) if indexed and cached else None
        return new(Discount, (costs, cached, long_cap, holders,
                              1 + self.epsilon if indexed and cached else None,  # keep_factor: prefix index only
                              within_requests))

    def cap_in_requests(self, situation: Situation, cached: str, figures: list[tuple[str, float]]) -> bool:
        """Whether ``cached`` takes the request within the cap in requests, ⌈(1 + ε) × average⌉
        (at least FOLLOW_UP_REQUESTS_FLOOR for the conversation's follow-up there); the trace's
        figures for it go to ``figures``."""
        running = situation.ledger.loads("requests")[cached]
        cap = average_and_cap(situation.total("requests") + 1, len(situation.eligible), self.epsilon, "requests")[1]
        placement = situation.placement
        if placement is not None and placement.replica == cached:  # the conversation's follow-up
            cap = max(float(FOLLOW_UP_REQUESTS_FLOOR), cap)
        figures += (("requests", running), ("requests_cap", cap))
        return running + 1 <= cap
