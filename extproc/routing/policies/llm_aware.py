"""llm-aware: bounded loads in tokens, plus switchable LLM-specific additions.

- cache_aware: where the request's prefix is expected cached it costs only its new
  tokens, max(1, prompt - cached) + max_tokens; elsewhere its whole prompt. The cached
  replica, when preferred, also keeps one request of slack under the cap (``first_fit``).
- placement_memory: prefer where the cache is (the conversation's last replica, or with
  the prefix index the longest held prefix) over the ring home, which would pay a
  second full prefill.
- long_stickiness: a cached conversation of at least long_prompt_tokens may load its
  replica up to long_load_factor × average before being moved: moving it costs most.
- prefix_index (docs/prefix-index.md): where the cache is comes from a bounded index of
  the prompt blocks sent to each replica (at most prefix_capacity_tokens each, least
  recently sent forgotten first), not from placement memory: the expected cached tokens
  on every replica = its longest held prefix of this prompt; the one holding the most
  is the cached replica (ties: the ring home, else the first clockwise). Over the
  cap it keeps the request unless another replica fits under the cap or would land
  (1 + ε) times lower: a redirect pays the whole prefill again. The cached replica also
  takes it while within the cap in requests, ⌈(1 + ε) × average⌉ (at least 2 for a follow-up on
  the replica of its last turn): there it brings only its new tokens, and a popular prefix still
  spreads by count. The long cap is long_load_factor × the larger of the average and the
  prefix cached there (what a move computes again). A prompt no replica holds goes, of the
  replicas where it fits under the cap, to the one whose least recent prompt is oldest (one
  with room first, clockwise): the fleet's caches forget as one least-recently-used cache.
  A failed request's new blocks are forgotten (it cached nothing; so did a pick whose request
  a fallback answered). Requests
  without blocks fall back to placement memory. prefix_feedback: a replica that reports
  whole blocks fewer (more) than predicted has its capacity lowered (raised) by as many tokens.

With all of them off it decides exactly as bounded in tokens mode; with the prefix
index off exactly as the seed's llm-aware.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from itertools import repeat
from typing import Annotated, ClassVar, NamedTuple

from pydantic import Field

import extproc
from extproc.routing.adapters import seen_running
from extproc.routing.blocks import covered_tokens
from extproc.routing.decision import Candidate, Check, Decision, RouteRequest, Trace
from extproc.routing.policies.bounded_walk import WALK_REASONS, Discount, average_and_cap, first_fit, least_loaded
from extproc.routing.policies.plugin import PolicyPlugin
from extproc.routing.policies.situation import HOME_REASON, Situation, new
from extproc.routing.prefix_index import IndexChange, PrefixIndex
from extproc.routing.speeds import Speed

# [routing.llm-aware] (plugin.py: the functional form keeps the constraints under mypyc)
LlmAwareParams = NamedTuple("LlmAwareParams", [
    ("epsilon", Annotated[float, Field(gt=0, le=10, description="bounded loads: cap = (1 + epsilon) x average")]),
    # the three switchable additions and their knobs
    ("cache_aware", Annotated[bool, Field(description="a cached replica is charged only the new tokens")]),
    ("placement_memory", Annotated[bool, Field(description="prefer where the conversation was last served")]),
    ("long_stickiness", Annotated[bool, Field(description="long cached conversations tolerate long_load_factor")]),
    ("long_prompt_tokens", Annotated[int, Field(gt=0, description="a conversation is long from this many prompt "
                                                                  "tokens")]),
    ("long_load_factor", Annotated[float, Field(gt=1, le=100, description="long cap = factor x average")]),
    # the prefix index (docs/prefix-index.md): two more switchable additions and its capacity
    ("prefix_index", Annotated[bool, Field(description="expected cache on each replica = its longest held prefix "
                                                       "of the prompt; over the cap a redirect must land "
                                                       "(1 + epsilon) times lower")]),
    ("prefix_feedback", Annotated[bool, Field(description="prefix index: a replica reporting whole blocks fewer "
                                                          "(more) than predicted has its capacity lowered (raised) "
                                                          "by as many tokens")]),
    ("prefix_capacity_tokens", Annotated[int, Field(gt=0, description="prefix index: tokens each replica holds "
                                                                      "(LRU beyond)")]),
    # on predicted time to first token (docs/policies.md)
    ("ttft_decisions", Annotated[bool, Field(description="pick by predicted time to first token; the bounded walk "
                                                         "decides only past ttft_guard_factor x average")]),
    ("ttft_margin", Annotated[float, Field(ge=0, le=10, description="a request leaves its cached replica only "
                                                                    "where its first token is predicted this share "
                                                                    "sooner")]),
    ("ttft_recompute_cost", Annotated[bool, Field(description="a move away from the cache is also charged the "
                                                              "prefill of the tokens it computes again, the delay "
                                                              "they bring the requests queued behind it")]),
    ("ttft_guard_factor", Annotated[float, Field(gt=1, le=100, description="past this factor x average load in "
                                                                           "tokens the preferred replica goes to "
                                                                           "the bounded walk")]),
])
REASONS = {
    **HOME_REASON,
    "sticky": "llm-aware: where placement memory says the conversation's cache is, not its ring home",
    "home-long": "llm-aware: ring home above the normal cap but within the long-conversation cap",
    "sticky-long": "llm-aware: remembered replica above the normal cap but within the long cap",
    "prefix": "llm-aware, prefix index: the replica holding the longest prefix of the prompt, not its ring home",
    "prefix-long": "llm-aware, prefix index: that replica above the normal cap but within the long cap",
    "home-requests": "llm-aware, prefix index: the cached home over its limit in tokens, within the cap in requests",
    "prefix-requests": "llm-aware, prefix index: that replica over its limit in tokens, within the cap in requests",
    "least-recent": "llm-aware, prefix index: a prompt no replica holds; under the cap, the replica whose least "
                    "recent prompt is oldest",
    "faster": "llm-aware: another replica's first token predicted ttft_margin sooner than the preferred one's",
    "warm": "llm-aware: no replica holds the cache and the model is cold on the preferred one: the first replica "
            "clockwise where the model is loaded (router mode, sleep)",
    **WALK_REASONS,
    "kept": "llm-aware, prefix index: none fitted under the cap; the cached replica, none landing (1 + ε) x lower",
}



class LlmAwareTrace(NamedTuple):
    """llm-aware's numbers: where it preferred and why, the request's cost there, the loads and
    caps of the bounded walk, the prefix index's view and the predicted first tokens."""

    unit: str  # "tokens": llm-aware bounds loads in tokens
    home: str  # the conversation's ring home
    preferred: str
    preferred_by: str  # "ring" | "memory" | "prefix" | "lru"
    remembered: str | None  # placement memory: the conversation's last replica ...
    remembered_tokens: int | None  # ... and the prompt size served there
    cached_tokens: int  # predicted cached prefix on the preferred replica
    preferred_cost: int  # the request's cost there: new tokens only where cached
    loads: Mapping[str, int]  # the eligible replicas' loads at the decision (a copy)
    total: int  # with this request's cost on the preferred replica
    average: float
    cap: float  # (1 + epsilon) x average
    long_cap: float | None  # long stickiness: the cached replica's limit instead of the cap
    long_threshold: int | None  # prompt tokens from which a conversation counts as long
    checks: tuple[Check, ...]  # the bounded walk (empty when the prediction decided)
    prompt_blocks: int | None  # the prefix index: the prompt's blocks ...
    candidates: tuple[Candidate, ...]  # ... the holders it entered, deepest first ...
    figures: tuple[tuple[str, float], ...]  # ... and its figures (capacity, holders, the cap in requests)
    predicted_ttft_s: tuple[tuple[str, float], ...]  # (replica, predicted seconds to the first token) weighed


# (where the cache is, replica -> cached tokens there, replica -> cost there, trace fields,
# the holders to try after the preferred replica, most expected reuse first: asked for only then)
WhereCached = tuple[str | None, dict[str, int], dict[str, int], tuple, Callable[[], tuple[str, ...]] | None]
CANDIDATES_TRACED = 8  # holders a trace lists, deepest first (its figures count them all)
# The index's blocks: 256 characters, about 64 tokens. Four times the peers' 16-token block:
# hashing a 2,000-token prompt costs 6 µs instead of 19 (docs/prefix-index.md), and a
# prediction misses at most the part of a prompt past its last whole block.
INDEX_BLOCK_CHARS = 256
# For a conversation's follow-up on the replica of its last turn the cap in requests is at least 2:
# below one request per replica on average ⌈(1 + ε) × average⌉ is 1 whatever ε, and a replica
# running one long prefill would send the follow-up to an idle replica to prefill it whole. New
# conversations on a popular prefix do not get it: they still spread one a replica.
FOLLOW_UP_REQUESTS_FLOOR = 2
# Up to this many replicas llm-aware predicts the first token on each; beyond, on a few candidates.
PREDICT_ALL_REPLICAS = 16


class LlmAware:
    name: ClassVar[str] = "llm-aware"
    prefix_block_chars: ClassVar[int] = 0

    def __init__(self, params: LlmAwareParams, slots: int) -> None:
        self.epsilon = params.epsilon
        self.cache_aware = params.cache_aware
        self.placement_memory = params.placement_memory
        self.long_stickiness = params.long_stickiness
        self.long_prompt_tokens = params.long_prompt_tokens
        self.long_load_factor = params.long_load_factor
        self.ttft = params.ttft_decisions
        self.ttft_margin = params.ttft_margin
        self.guard_factor = params.ttft_guard_factor
        self.slots = slots  # routing.replica_slots: below, a new request shares the replica; at it, it waits
        self.recompute_cost = params.ttft_recompute_cost

    def decide(self, situation: Situation) -> Decision | None:
        eligible = situation.eligible
        if not eligible:
            return None
        request = situation.request
        prompt, max_tokens = request.prompt_tokens, request.max_tokens
        work = prompt + max_tokens  # what the request costs where nothing is cached
        home = situation.home()
        assert home is not None  # eligible is not empty
        # expected: replica -> cached tokens there; costs: replica -> the request's new tokens there
        cached_on, expected, costs, seen, holders = self.where_cached(situation, home)
        if situation.residency.tracked:
            cached_on, expected, costs = warm_only(situation, cached_on, expected, costs)
        if not self.cache_aware:
            costs = {}
        by_memory = self.placement_memory and cached_on is not None
        preferred = cached_on if by_memory and cached_on is not None else home
        preferred_cost = costs.get(preferred, work)
        loads = situation.ledger.loads("tokens")
        total = situation.total("tokens") + preferred_cost
        average, cap = average_and_cap(total, len(eligible), self.epsilon, "tokens")
        least_recent = self.least_recent_fit(situation, loads, work, cap) if seen and cached_on is None else None
        if least_recent is not None:  # a prompt no replica holds: where the fleet forgets its least recent
            preferred = least_recent[0]
            seen = (*seen[:2], (*seen[2], ("least_recent_use", least_recent[1])))
        residency = situation.residency
        warmed = residency.tracked and cached_on is None and residency.cold(preferred, request.model)
        if warmed:  # no cache to keep: where the model is loaded
            preferred, holders = warm_first(situation, preferred, holders)
        long_cap = None
        if self.long_stickiness and cached_on == preferred and prompt >= self.long_prompt_tokens:
            # with the index, against the prefix cached there when that is larger: what a move computes again
            long_cap = self.long_load_factor * (max(average, expected[preferred]) if seen else average)
        cached = preferred if self.cache_aware and cached_on == preferred else None
        asked: list[tuple[str, float]] = []  # the cap in requests' figures, once first_fit asks it
        within_requests = partial(self.cap_in_requests, situation, cached, asked) if seen and cached else None
        discount = new(Discount, (costs, cached, long_cap, holders,
                                  1 + self.epsilon if seen and cached else None,  # keep_factor: prefix index only
                                  within_requests))
        timed = None
        if self.ttft:  # the bounded walk only past the guard rail
            guard = self.guard(situation, loads, average)
            # one long prefill on the cached replica of a light fleet is no imbalance
            floor = max(FOLLOW_UP_REQUESTS_FLOOR if cached else 1,
                        warm_floor(situation, preferred, self.warm_slots(situation)))
            if not guard.past(preferred, preferred_cost, floor):
                timed = self.soonest(situation, preferred, costs, work, guard,
                                     cached_on == preferred and expected.get(preferred, 0) > 0)
        chosen: str | None
        checks: tuple[Check, ...]
        if timed is not None:
            chosen, checks, predicted = timed[0], (), timed[1]
        else:
            chosen, checks = first_fit(situation, preferred, loads, work, cap, discount)
            predicted = ()
        if asked:
            seen = (*seen[:2], (*seen[2], *asked))
        if chosen is None:
            chosen = least_loaded(eligible, loads, work, discount)
            reason = "kept" if chosen == cached and discount.keep_factor else "least-loaded"
        elif timed is not None and chosen != preferred:
            reason = "faster"
        elif chosen == preferred:
            reason = ("home" if preferred == home else "warm" if warmed else "least-recent" if least_recent
                      else "prefix" if seen else "sticky")
            load = loads[chosen]
            if checks and load and load + preferred_cost > cap and not (discount.cached and load < cap):
                first = checks[0]  # only the long cap let it in, or only the cap in requests
                reason += "-long" if first.load + first.cost <= first.limit or first.load < first.limit else "-requests"
        else:
            reason = "overflow"
        cost = costs.get(chosen, work)
        placement = situation.placement
        details = new(LlmAwareTrace, (
            "tokens", home, preferred,
            ("prefix" if seen else "memory") if by_memory else ("lru" if least_recent else "ring"),  # preferred_by
            placement.replica if placement else None,  # remembered
            placement.prompt_tokens if placement else None,  # remembered_tokens
            expected.get(preferred, 0),  # cached_tokens
            preferred_cost, situation.load_copy("tokens"), total, average, cap, long_cap,
            self.long_prompt_tokens if long_cap is not None else None,  # long_threshold
            checks,
            *(seen or (None, (), ())),  # prompt_blocks, candidates, figures
            predicted,
        ))
        trace = new(Trace, (self.name, prompt, max_tokens, details))
        return new(Decision, (chosen, reason, cost, cost, expected.get(chosen, 0), trace))

    def guard(self, situation: Situation, loads: Mapping[str, int], average: float) -> GuardRail:
        """ttft_guard_factor × the average load in tokens (``average``: this request included);
        ``loads``: the ledger's in tokens. The rail carries both loads to the predictions."""
        return new(GuardRail, (loads, situation.ledger.loads("requests"), self.guard_factor * average))

    def soonest(self, situation: Situation, preferred: str, costs: dict[str, int], work: int, guard: GuardRail,
                cached: bool) -> tuple[str, tuple[tuple[str, float], ...]]:
        """The replica whose first token is predicted soonest, and the predictions weighed
        (the preferred replica's, then the best other's). The other must be predicted
        ttft_margin sooner (a move is also charged the cached tokens it computes again when the
        preferred replica holds the cache: ``cached``); replicas past the guard rail are
        not candidates. Of the prefix index's holders only those the lookup entered count as
        cached (entering every holder of a shared system prompt changed no figure on the
        Mooncake trace and cost a p99 of 1.2 ms at 64 replicas)."""
        loads, running = guard.tokens, seen_running(guard.requests, self.slots, situation.request.unbatched)
        speed, slots = situation.speeds.speed, self.slots
        wait = model_wait(situation, preferred)
        here = predicted_ttft(slots, speed(preferred), loads[preferred], running[preferred],
                              costs.get(preferred, work)) + wait
        # a new conversation too stays on its ring home unless elsewhere is ttft_margin sooner: the
        # learnt speeds of equal replicas differ by noise, which would steer it off at random (a
        # model's load is no noise: the margin is not taken of it)
        needed = (here - wait) / (1 + self.ttft_margin) + wait
        kept = costs.get(preferred, work) if cached and self.recompute_cost else None
        best, soonest = self.soonest_other(situation, preferred, costs, work, guard, kept)
        if best is None:
            return preferred, ((preferred, here),)
        return (best if soonest < needed else preferred), ((preferred, here), (best, soonest))

    def soonest_other(self, situation: Situation, preferred: str, costs: dict[str, int], work: int,
                      guard: GuardRail, kept: int | None) -> tuple[str | None, float]:
        """(the eligible replica but ``preferred`` predicted soonest within the guard rail, its
        prediction); (None, inf) when there is none. ``kept``: the request's cost on the cached
        preferred replica; a move is charged the tokens it computes again once more, the delay
        they bring the requests behind it (None: not charged)."""
        loads, running = guard.tokens, seen_running(guard.requests, self.slots, situation.request.unbatched)
        speed, slots = situation.speeds.speed, self.slots
        best, soonest = None, math.inf
        warm_slots = self.warm_slots(situation)
        for name in self.candidates(situation, costs):
            load, cost = loads[name], costs.get(name, work)
            if name == preferred or guard.past(name, cost, warm_floor(situation, name, warm_slots)):
                continue
            here = speed(name)
            seconds = predicted_ttft(slots, here, load, running[name], cost) + model_wait(situation, name)
            if kept is not None and cost > kept:
                seconds += (cost - kept) * here.prefill_s_per_token
            if seconds < soonest:
                best, soonest = name, seconds
        return best, soonest

    def warm_slots(self, situation: Situation) -> int:
        """The guard rail's floor in requests on a replica where the request's model is loaded: all
        its slots while the model is cold on another eligible replica (a free slot there beats a
        load or a wake elsewhere), else 1."""
        residency, model = situation.residency, situation.request.model
        if not residency.tracked:
            return 1
        return self.slots if any(residency.cold(name, model) for name in situation.eligible) else 1

    def candidates(self, situation: Situation, costs: dict[str, int]) -> Iterable[str]:
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

    def least_recent_fit(self, situation: Situation, loads: Mapping[str, int], work: int,
                         cap: float) -> tuple[str, int] | None:
        """Placement memory knows nothing of what the replicas forget (the prefix index does)."""
        return None

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

    def where_cached(self, situation: Situation, home: str) -> WhereCached:
        """(the replica holding the cache, replica -> cached tokens expected there, replica ->
        the request's cost there (new tokens only), the prefix index's trace fields or (), the
        replicas to try after the preferred one, before the ring): here placement memory's one
        entry."""
        placement = situation.placement
        if placement is None:
            return None, {}, {}, (), None
        request = situation.request
        replica, cached = placement.replica, min(placement.prompt_tokens, request.prompt_tokens)
        cost = max(1, request.prompt_tokens - cached) + request.max_tokens
        return replica, {replica: cached}, {replica: cost}, (), None


class LlmAwarePrefix(LlmAware):
    """llm-aware with the prefix index on (a policy that keeps a view of what it sent)."""

    prefix_block_chars: ClassVar[int] = INDEX_BLOCK_CHARS

    def __init__(self, params: LlmAwareParams, slots: int) -> None:
        super().__init__(params, slots)
        self.index = PrefixIndex(params.prefix_capacity_tokens)
        self.feedback = params.prefix_feedback
        # request in flight -> (its replica, the blocks that replica held before it)
        self.held_before: dict[str, tuple[str, int]] = {}

    def where_cached(self, situation: Situation, home: str) -> WhereCached:
        """The index's lookup. Entered at once: the holders a trace lists (deepest first), the
        cached replica and, without placement memory, the home; the other holders only when
        the walk past the preferred replica asks for them (``holders``), which most decisions
        never do (64 replicas can hold one system prompt). A follow-up whose last replica holds
        more of the prompt than any other replica skips the lookup: that replica is the one
        deepest holder, and the others are looked up only when the walk asks."""
        request = situation.request
        blocks = request.prefix_blocks
        if not blocks:
            return super().where_cached(situation, home)
        prompt, count = request.prompt_tokens, len(blocks)
        index = self.index
        expected: dict[str, int] = {}  # replica -> cached tokens there, deepest first
        costs: dict[str, int] = {}  # replica -> the request's new tokens there
        enter = partial(self.enter_holding, situation, expected, costs)
        loads = situation.ledger.loads("tokens")
        own = self.deepest_on_its_replica(situation, blocks)
        if own:  # one replica, one candidate
            replica, depth = own
            enter(depth, (replica,))
            candidate = new(Candidate, (replica, depth, loads[replica], expected[replica]))
            holding = index.holder_bits(blocks[0]).bit_count()
            later = partial(self.enter_holders, blocks, None, expected, enter) if holding > 1 else None
            return replica, expected, costs, (count, (candidate,), self.figures(holding)), later
        groups = index.lookup(blocks, situation.avoid)
        candidates: list[Candidate] = []  # Candidate(replica, matched blocks, load, expected)
        for depth, bits in groups:
            shown = index.names(bits)[: CANDIDATES_TRACED - len(candidates)]
            enter(depth, shown)
            candidates += map(new, repeat(Candidate), zip(shown, repeat(depth), map(loads.__getitem__, shown),
                                                          map(expected.__getitem__, shown)))
            if len(candidates) == CANDIDATES_TRACED:
                break
        holding = sum(bits.bit_count() for _, bits in groups)
        seen = (count, tuple(candidates), self.figures(holding))
        if not groups:
            placement = situation.placement
            # placement memory knows where it was served and the index never saw it (another router sent it and
            # its changes have not come, or it was shorter than a block): placement memory decides. A prompt the
            # index forgot is one no replica holds any more.
            if placement is not None and (not index.forgot(blocks[0]) or placement.prompt_tokens * count < prompt):
                return super().where_cached(situation, home)
            return None, {}, {}, seen, None
        depth, tied = groups[0]  # the replicas holding the longest prefix
        if not tied & (tied - 1):  # one replica
            cached_on = candidates[0].replica
        else:  # ties: the ring home, else the first of them clockwise
            bit_of = index.bit
            cached_on = home if bit_of(home) & tied else next(name for name in situation.walk() if bit_of(name) & tied)
            enter(depth, (cached_on,))
        if not self.placement_memory and home not in expected:  # then home is preferred
            enter(next((depth for depth, bits in groups if bits & index.bit(home)), 0), (home,))
        later = partial(self.enter_holders, blocks, groups, expected, enter) if holding > 1 else None
        return cached_on, expected, costs, seen, later

    def enter_holding(self, situation: Situation, expected: dict[str, int], costs: dict[str, int], depth: int,
                      names: tuple[str, ...]) -> None:
        """Enter ``names``, each holding ``depth`` of the prompt's blocks, in ``expected`` (the tokens
        cached there, counted as if the blocks covered the whole prompt) and ``costs``. The
        replica that served the conversation's last prompt, whichever step enters it, when it
        holds that prompt's whole blocks and no more (up to one block of rounding): that prompt,
        tail included, and nothing of what this turn adds."""
        request = situation.request
        prompt = request.prompt_tokens
        blocks = len(request.prefix_blocks)
        tokens = _enter(expected, costs, prompt, blocks, request.max_tokens, depth, names)
        placement = situation.placement
        if not depth or placement is None or placement.replica not in names:
            return
        remembered = min(placement.prompt_tokens, prompt)
        whole = remembered * blocks // prompt  # the last prompt's whole blocks, about
        if remembered != tokens and whole <= depth <= whole + 1:
            expected[placement.replica] = remembered
            costs[placement.replica] = max(1, prompt - remembered) + request.max_tokens

    def figures(self, holding: int) -> tuple[tuple[str, float], ...]:
        """The trace's figures of the index: its capacity, the replicas holding part of the prompt."""
        return ("capacity_tokens", self.index.capacity), ("holders", holding)

    def enter_holders(self, blocks: tuple[int, ...], groups: list[tuple[int, int]] | None,
                      expected: Mapping[str, int], enter: Callable[[int, tuple[str, ...]], None]) -> tuple[str, ...]:
        """Every replica holding part of ``blocks``, deepest first, each entered unless already in
        ``expected``: entering it again would give the same figures. ``groups``: the lookup's
        (None: looked up now)."""
        index = self.index
        named = [(depth, index.names(bits)) for depth, bits in (index.lookup(blocks) if groups is None else groups)]
        for depth, names in named:
            enter(depth, tuple(name for name in names if name not in expected))
        return tuple(name for _, names in named for name in names)

    def least_recent_fit(self, situation: Situation, loads: Mapping[str, int], work: int,
                         cap: float) -> tuple[str, int] | None:
        """(replica, when its least recent prompt was used) for a prompt no replica holds: of the
        replicas where it fits under the cap, the one whose least recent prompt is oldest, so the
        fleet's caches forget as one least-recently-used cache; one with room for it forgets
        nothing and comes first (ties: clockwise from the ring home). None if none fits."""
        tokens, last_use = situation.request.prompt_tokens, self.index.least_recent_use
        uses = {name: last_use(name, tokens) for name in situation.eligible
                if loads[name] + work <= cap or not loads[name]}
        if not uses:
            return None
        oldest = min(uses, key=uses.__getitem__)
        if uses[oldest] < 0:  # room on some: the first of them clockwise
            oldest = next(name for name in situation.walk() if uses.get(name, 0) < 0)
        return oldest, uses[oldest]

    def deepest_on_its_replica(self, situation: Situation, blocks: tuple[int, ...]) -> tuple[str, int] | None:
        """(replica, blocks held) of the conversation's last replica, when no other replica
        holds as many of ``blocks`` (one probe past its held prefix: the index is closed under
        prefixes); with placement memory and every replica eligible only."""
        placement = situation.placement
        if placement is None or situation.avoid or not self.placement_memory:
            return None
        index, replica = self.index, placement.replica
        depth = index.held_prefix(replica, blocks)
        return (replica, depth) if depth and not index.holder_bits(blocks[depth - 1]) & ~index.bit(replica) else None

    def routed(self, request: RouteRequest, decision: Decision) -> None:
        blocks = request.prefix_blocks
        if blocks:
            details = decision.trace.details
            # the holders entered, deepest first: the pick's held blocks when it heads them
            listed = details.candidates if isinstance(details, LlmAwareTrace) else ()
            held = listed[0].matched_blocks if listed and listed[0].replica == decision.replica else None
            if held is None:
                held = self.index.held_prefix(decision.replica, blocks)
            self.held_before[request.request_id] = (decision.replica, held)
            self.index.add_prompt(decision.replica, blocks, max(1, request.prompt_tokens // len(blocks)), held)

    def completed(self, request: RouteRequest, decision: Decision, ok: bool) -> None:
        """A server cannot evict a running request's blocks and frees them, as its most recent,
        when it ends (vLLM's free-block queue): the prompt is refreshed, if the index still holds
        it (if not, requests sent after it have taken its place, as in a llama.cpp slot). A failed
        request cached nothing (a prompt longer than the context is refused whole): its new blocks
        are forgotten, as placement memory remembers only a success."""
        before = self.held_before.pop(request.request_id, None)
        if ok:
            self.index.touch(decision.replica, request.prefix_blocks)
        elif before is not None:
            self.index.forget(decision.replica, request.prefix_blocks, before[1])

    def share_changes(self, on: bool) -> None:
        """Several routers keep their indexes alike (a store): from now on (``on``) the index's
        changes are kept until ``changes`` takes them."""
        self.index.journal = [] if on else None

    def changes(self) -> list[IndexChange]:
        journal = self.index.journal
        if not journal:
            return []
        self.index.journal = []
        return journal

    def apply_changes(self, changes: Iterable[IndexChange]) -> None:
        self.index.apply(changes)

    def moved(self, blocks: tuple[int, ...], tokens: int, source: str | None, receiver: str) -> None:
        """A migration restored the prompt's cache on ``receiver``: it holds those blocks now,
        and ``source`` (which leaves) no longer counts as holding them, or the next turn would
        look cached on both and go to whichever the ring prefers."""
        if not blocks:
            return
        self.index.add_prompt(receiver, blocks, max(1, tokens // len(blocks)))
        if source is not None and source != receiver:
            self.index.forget(source, blocks, 0)

    def set_replicas(self, replicas: tuple[str, ...]) -> None:
        """The requests in flight on a replica that left are never completed (the router drops them)."""
        self.index.set_replicas(replicas)
        kept = set(replicas)
        self.held_before = {request: before for request, before in self.held_before.items() if before[0] in kept}

    def reported(self, request: RouteRequest, replica: str, predicted: int, cached: int) -> None:
        """``replica`` served ``request`` from ``cached`` cached tokens; ``predicted`` were expected.

        Whole blocks missing mean the replica forgot them while the index still held them: it
        holds fewer tokens than the index believes, so its capacity is lowered by as many (the
        request's own blocks stay: serving it cached them again). Whole blocks more than
        predicted raise it again (a pool that was full of running requests has room again)."""
        blocks, prompt = request.prefix_blocks, request.prompt_tokens
        if not (self.feedback and blocks and prompt and cached >= 0):
            return
        count = len(blocks)
        # whole blocks, rounded up: the blocks may cover less than the prompt (a paged server
        # caches whole blocks only), so rounding down would count one it holds as missing
        expected, found = -(-predicted * count // prompt), -(-cached * count // prompt)
        self.index.resize(replica, (found - expected) * max(1, prompt // count), floor=prompt)


def _enter(expected: dict[str, int], costs: dict[str, int], prompt: int, blocks: int, max_tokens: int,
           depth: int, names: tuple[str, ...]) -> int:
    """Enter ``names``, each holding ``depth`` of the prompt's ``blocks`` (0: none): the tokens
    expected cached there (returned) and the request's new tokens there."""
    tokens = covered_tokens(prompt, blocks, depth)
    if depth:
        expected.update(dict.fromkeys(names, tokens))  # one dict update per depth, not per replica
        costs.update(dict.fromkeys(names, max(1, prompt - tokens) + max_tokens))
    return tokens


class GuardRail(NamedTuple):
    """Where the time decision gives way to the bounded walk: ttft_guard_factor × the average
    load in tokens, this request included."""

    tokens: Mapping[str, int]
    requests: Mapping[str, int]
    tokens_limit: float

    def past(self, replica: str, cost: int, running_floor: int = 1) -> bool:
        """Whether ``replica`` would be past the guard with this request (``cost`` tokens there);
        never while it runs fewer than ``running_floor`` requests."""
        load = self.tokens[replica]
        return load > 0 and load + cost > self.tokens_limit and self.requests[replica] >= running_floor


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


def predicted_ttft(slots: int, speed: Speed, load: int, running: int, cost: int) -> float:
    """Seconds until the first token of a request bringing ``cost`` tokens to a replica holding
    ``load`` tokens of ``running`` requests. With a free slot (``running < slots``) it shares the
    replica with them: each delays it by at most its own work (processor sharing), at most
    ``cost``; without one it waits behind all of it."""
    ahead = min(load, running * cost) if running < slots else load
    return speed.overhead_s + (ahead + cost) * speed.prefill_s_per_token


def warm_floor(situation: Situation, replica: str, warm_slots: int) -> int:
    """The requests below which ``replica`` is never past the guard rail (``warm_slots``: LlmAware.warm_slots)."""
    if warm_slots == 1 or situation.residency.cold(replica, situation.request.model):
        return 1
    return warm_slots


def model_wait(situation: Situation, replica: str) -> float:
    """The seconds a request waits on ``replica`` for its model's load or wake (residency.py)."""
    residency = situation.residency
    return residency.penalty(replica, situation.request.model) if residency.tracked else 0.0


def warm_first(situation: Situation, preferred: str,
               holders: Callable[[], tuple[str, ...]] | None) -> tuple[str, Callable[[], tuple[str, ...]] | None]:
    """(the first replica clockwise where the request's model is loaded, the walk's replicas to try
    first: ``holders``', then the other warm replicas clockwise): the ring of the model's warm
    replicas. Unchanged when it is cold everywhere."""
    model, cold = situation.request.model, situation.residency.cold
    warm = tuple(name for name in situation.walk() if not cold(name, model))
    if not warm:
        return preferred, holders

    def warm_later() -> tuple[str, ...]:
        earlier = holders() if holders is not None else ()
        return (*earlier, *(name for name in warm if name not in earlier))

    return warm[0], warm_later


def warm_only(situation: Situation, cached_on: str | None, expected: dict[str, int],
              costs: dict[str, int]) -> tuple[str | None, dict[str, int], dict[str, int]]:
    """Where the request's model sleeps or is not loaded its cache is gone: (cached_on, expected,
    costs) without those replicas."""
    model, cold = situation.request.model, situation.residency.cold
    gone = [name for name in expected if cold(name, model)]
    if not gone:
        return cached_on, expected, costs
    kept = {name: tokens for name, tokens in expected.items() if name not in gone}
    return (None if cached_on in gone else cached_on), kept, {name: costs[name] for name in costs if name in kept}


def make_llm_aware(params: LlmAwareParams, slots: int) -> LlmAware:
    """llm-aware's prefix index is a subclass with a view of what it sent."""
    return LlmAwarePrefix(params, slots) if params.prefix_index else LlmAware(params, slots)


PLUGIN: PolicyPlugin = PolicyPlugin("llm-aware", LlmAwareParams,
                                    lambda params, routing: make_llm_aware(params, routing.replica_slots), REASONS)
