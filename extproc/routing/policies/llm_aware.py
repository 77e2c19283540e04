"""llm-aware: bounded loads in tokens, plus three switchable LLM-specific additions.

- cache_aware: on the replica holding the conversation's cache a request costs only
  its new tokens, max(1, prompt - cached) + max_tokens; elsewhere its whole prompt. That
  replica also keeps one request of slack under the cap (see ``first_fit``).
- placement_memory: prefer where the conversation was last served (its cache lives
  there after a redirect) over its ring home, which would pay a second full prefill.
- long_stickiness: a cached conversation of at least long_prompt_tokens may load its
  replica up to long_load_factor × average before being moved: moving it costs most.

With all three off it decides exactly as bounded in tokens mode.
"""

from __future__ import annotations

from itertools import chain

from extproc.routing.decision import Decision, Trace
from extproc.routing.policies.situation import Situation, average_and_cap, first_fit, least_loaded
from extproc.settings import RoutingSettings


class LlmAware:
    name = "llm-aware"

    def __init__(self, settings: RoutingSettings) -> None:
        self.epsilon = settings.epsilon
        self.cache_aware = settings.cache_aware
        self.placement_memory = settings.placement_memory
        self.long_stickiness = settings.long_stickiness
        self.long_prompt_tokens = settings.long_prompt_tokens
        self.long_load_factor = settings.long_load_factor

    def decide(self, situation: Situation) -> Decision | None:
        eligible = situation.eligible
        if not eligible:
            return None
        request = situation.request
        placement = situation.placement
        cached_on = placement.replica if placement is not None else None
        work = request.prompt_tokens + request.max_tokens
        cached_tokens = situation.cached_tokens_on(cached_on) if cached_on is not None else 0
        cached_cost = max(1, request.prompt_tokens - cached_tokens) + request.max_tokens

        def cost_of(replica: str) -> int:
            return cached_cost if self.cache_aware and replica == cached_on else work

        home = situation.home()
        by_memory = self.placement_memory and cached_on is not None
        preferred = cached_on if by_memory else home
        assert preferred is not None  # eligible is not empty
        preferred_cost = cost_of(preferred)
        loads = situation.ledger.loads("tokens")
        total = situation.total("tokens") + preferred_cost
        average, cap = average_and_cap(total, len(eligible), self.epsilon, "tokens")
        long_cap = None
        if self.long_stickiness and cached_on == preferred and request.prompt_tokens >= self.long_prompt_tokens:
            long_cap = self.long_load_factor * average
        order = chain((preferred,), (name for name in situation.walk() if name != preferred))
        cached = cached_on if self.cache_aware and cached_on == preferred else None
        chosen, checks = first_fit(order, loads, cost_of, cap, cached, long_cap)
        if chosen is None:
            chosen, reason = least_loaded(eligible, loads, cost_of), "least-loaded"
        elif chosen == preferred:
            reason = "home" if preferred == home else "sticky"
            load = loads[chosen]
            if load and load + preferred_cost > cap and not (cached and load < cap):
                reason += "-long"  # only the long cap let it in
        else:
            reason = "overflow"
        cost = cost_of(chosen)
        trace = Trace(
            self.name, request.prompt_tokens, request.max_tokens, unit="tokens", home=home,
            preferred=preferred, preferred_by="memory" if by_memory else "ring",
            remembered=cached_on, remembered_tokens=placement.prompt_tokens if placement else None,
            cached_tokens=cached_tokens if preferred == cached_on else 0, preferred_cost=preferred_cost,
            loads=situation.load_items("tokens"), total=total, average=average, cap=cap,
            long_cap=long_cap, long_threshold=self.long_prompt_tokens if long_cap is not None else None,
            checks=checks,
        )
        return Decision(chosen, reason, cost, cost, cached_tokens if chosen == cached_on else 0, trace)
