"""Where the prefix index says the cache is (docs/prefix-index.md): on every replica, its
longest held prefix of the prompt; the replica holding the most is the cached one (ties: the
ring home, else the first clockwise). A prompt no replica holds goes where the fleet forgets
its least recent prompt. Requests without blocks fall back to placement memory."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from itertools import repeat

from extproc.routing.blocks import covered_tokens
from extproc.routing.decision import Candidate
from extproc.routing.policies.llm_aware.where import PlacementMemoryCache, WhereCached
from extproc.routing.policies.situation import Situation, new
from extproc.routing.prefix_index import PrefixIndex

CANDIDATES_TRACED = 8  # holders a trace lists, deepest first (its figures count them all)
# The index's blocks: 256 characters, about 64 tokens. Four times the peers' 16-token block:
# hashing a 2,000-token prompt costs 6 µs instead of 19 (docs/prefix-index.md), and a
# prediction misses at most the part of a prompt past its last whole block.
INDEX_BLOCK_CHARS = 256


class IndexedCache:
    """The prefix index's lookup for one request (``placement_memory``: the policy prefers where
    the cache is, so a follow-up on its last replica may skip the lookup)."""

    def __init__(self, index: PrefixIndex, placement_memory: bool) -> None:
        self.index = index
        self.placement_memory = placement_memory
        self.memory = PlacementMemoryCache()  # for requests without blocks, and prompts the index never saw

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
            return self.memory.where_cached(situation, home)
        prompt, count = request.prompt_tokens, len(blocks)
        index = self.index
        expected: dict[str, int] = {}  # replica -> cached tokens there, deepest first
        costs: dict[str, int] = {}  # replica -> the request's new tokens there
        enter = partial(enter_holding, situation, expected, costs)
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
                return self.memory.where_cached(situation, home)
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


def enter_holding(situation: Situation, expected: dict[str, int], costs: dict[str, int], depth: int,
                  names: tuple[str, ...]) -> None:
    """Enter ``names``, each holding ``depth`` of the prompt's blocks, in ``expected`` (the tokens
    cached there, counted as if the blocks covered the whole prompt) and ``costs``. The
    replica that served the conversation's last prompt, whichever step enters it, when it
    holds that prompt's whole blocks and no more (up to one block of rounding): that prompt,
    tail included, and nothing of what this turn adds."""
    request = situation.request
    prompt = request.prompt_tokens
    blocks = len(request.prefix_blocks)
    tokens = covered_tokens(prompt, blocks, depth)
    if depth:
        expected.update(dict.fromkeys(names, tokens))  # one dict update per depth, not per replica
        costs.update(dict.fromkeys(names, max(1, prompt - tokens) + request.max_tokens))
    placement = situation.placement
    if not depth or placement is None or placement.replica not in names:
        return
    remembered_tokens = min(placement.prompt_tokens, prompt)
    whole = remembered_tokens * blocks // prompt  # the last prompt's whole blocks, about
    if remembered_tokens != tokens and whole <= depth <= whole + 1:
        expected[placement.replica] = remembered_tokens
        costs[placement.replica] = max(1, prompt - remembered_tokens) + request.max_tokens
