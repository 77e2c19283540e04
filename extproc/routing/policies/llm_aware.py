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

from extproc.routing.decision import Decision, Trace
from extproc.routing.policies.situation import NO_PEER_FIELDS, Situation, average_and_cap, first_fit, least_loaded, new
from extproc.settings import RoutingSettings


class LlmAware:
    name = "llm-aware"
    needs_prefix_blocks = False

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
        prompt, max_tokens = request.prompt_tokens, request.max_tokens
        work = prompt + max_tokens  # what the request costs where nothing is cached
        placement = situation.placement
        if placement is None:
            cached_on, cached_tokens, cached_cost = None, 0, work
        else:
            cached_on = placement.replica
            cached_tokens = min(placement.prompt_tokens, prompt)
            cached_cost = max(1, prompt - cached_tokens) + max_tokens
        discounted = cached_on if self.cache_aware else None  # where the request costs cached_cost

        home = situation.home()
        by_memory = self.placement_memory and cached_on is not None
        preferred = cached_on if by_memory else home
        assert preferred is not None  # eligible is not empty
        preferred_cost = cached_cost if preferred == discounted else work
        loads = situation.ledger.loads("tokens")
        total = situation.total("tokens") + preferred_cost
        average, cap = average_and_cap(total, len(eligible), self.epsilon, "tokens")
        long_cap = None
        if self.long_stickiness and cached_on == preferred and prompt >= self.long_prompt_tokens:
            long_cap = self.long_load_factor * average
        cached = discounted if discounted == preferred else None
        chosen, checks = first_fit(situation, preferred, loads, work, cap,
                                   discounted, cached_cost, cached, long_cap)
        if chosen is None:
            chosen, reason = least_loaded(eligible, loads, work, discounted, cached_cost), "least-loaded"
        elif chosen == preferred:
            reason = "home" if preferred == home else "sticky"
            load = loads[chosen]
            if load and load + preferred_cost > cap and not (cached and load < cap):
                reason += "-long"  # only the long cap let it in
        else:
            reason = "overflow"
        cost = cached_cost if chosen == discounted else work
        trace = new(Trace, (
            self.name, prompt, max_tokens,
            "tokens",  # unit
            home,
            preferred,
            "memory" if by_memory else "ring",  # preferred_by
            cached_on,  # remembered
            placement.prompt_tokens if placement else None,  # remembered_tokens
            cached_tokens if preferred == cached_on else 0,  # cached_tokens
            preferred_cost,
            situation.load_items("tokens"),  # loads
            total, average, cap, long_cap,
            self.long_prompt_tokens if long_cap is not None else None,  # long_threshold
            checks,
            *NO_PEER_FIELDS,  # prompt_blocks, candidates, figures
        ))
        return new(Decision, (chosen, reason, cost, cost, cached_tokens if chosen == cached_on else 0, trace))
