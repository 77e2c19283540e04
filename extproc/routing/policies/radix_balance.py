"""radix-balance: SGLang's cache-aware router (sgl-model-gateway), on the blocks this router sent.

Follows sgl-project/sglang: sgl-model-gateway/src/policies/cache_aware.rs at
b93974f140de1e545d9134d87e77f0bd1fbf3014 (select_worker) with the defaults a launched
router gets, sgl-model-gateway/bindings/python/src/sglang_router/router_args.py at
05e589ad6f75127e5302a250d9e83a881fbb3a3b: cache_threshold 0.3, balance_abs_threshold 64,
balance_rel_threshold 1.5, max_tree_size 2**26 characters.

Load is requests in flight. If max - min > 64 and max > 1.5 x min the fleet is
imbalanced and the least loaded replica wins. Otherwise the approximate radix tree (what
was sent where) gives the longest matched prefix: if it covers more than 30 % of the
prompt, a replica holding all of it wins, else the least loaded one. The pick's tree
gets the request's blocks either way. SGLang's tree is over characters; here over
64-character blocks, so 2**26 characters are 2**20 blocks per replica, the deepest
blocks forgotten first (SGLang evicts least recently used leaves every 60 s; here at
once). Ties: SGLang takes the first worker (least loaded) or an arbitrary tenant of the
matched node; here the first by name, and the holder at key_hash mod holders.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, NamedTuple

from pydantic import Field

from extproc.routing.blocks import BLOCK_CHARS
from extproc.routing.decision import Candidate, Decision, RouteRequest
from extproc.routing.policies.plugin import PolicyPlugin
from extproc.routing.policies.situation import Situation, new, peer_decision
from extproc.routing.prefix_views import BlockIndex

# [routing.radix-balance]: a launched SGLang router's defaults are the files' values
RadixBalanceParams = NamedTuple("RadixBalanceParams", [
    ("cache_threshold", Annotated[float, Field(ge=0, le=1, description="a match above this share of the prompt "
                                                                       "goes to its holder (SGLang: 0.3)")]),
    ("balance_abs_threshold", Annotated[int, Field(ge=0, description="imbalanced when max - min requests exceed "
                                                                     "this (SGLang: 64)...")]),
    ("balance_rel_threshold", Annotated[float, Field(ge=1, description="... and max exceeds this x min "
                                                                       "(SGLang: 1.5)")]),
    ("blocks_per_replica", Annotated[int, Field(gt=0, description="tree blocks per replica, the deepest forgotten "
                                                                  "first (SGLang's 2**26 characters: 1,048,576)")]),
])


class RadixBalance:
    name: ClassVar[str] = "radix-balance"
    prefix_block_chars: ClassVar[int] = BLOCK_CHARS  # llm-d's approximate scorer's block

    def __init__(self, params: RadixBalanceParams) -> None:
        self.params = params
        self.tree = BlockIndex(params.blocks_per_replica)

    def decide(self, situation: Situation) -> Decision | None:
        eligible = situation.eligible
        if not eligible:
            return None
        blocks = situation.request.prefix_blocks
        loads = situation.ledger.loads("requests")
        least = min(eligible, key=loads.__getitem__)
        low, high = loads[least], max(loads[name] for name in eligible)
        figures: tuple[tuple[str, float], ...] = (("min_load", low), ("max_load", high))
        candidates: tuple[Candidate, ...] = ()
        threshold, absolute, relative, _ = self.params
        if high - low > absolute and high > low * relative:
            chosen, reason = least, "imbalanced"
        else:
            depth = self.tree.depth(blocks)
            rate = depth / len(blocks) if blocks else 0.0
            holders = sorted(set(self.tree.holders(blocks[depth - 1])).intersection(eligible)) if depth else []
            figures += (("match_rate", rate), ("cache_threshold", threshold))
            candidates = tuple(new(Candidate, (name, depth, loads[name], rate)) for name in holders)
            if rate > threshold and holders:
                chosen, reason = holders[situation.key_hash % len(holders)], "cache-match"
            else:
                chosen, reason = least, "min-load"
        return peer_decision(self.name, situation, chosen, reason, self.tree.held_prefix(chosen, blocks),
                             candidates, figures)

    def routed(self, request: RouteRequest, decision: Decision) -> None:
        self.tree.add(decision.replica, reversed(request.prefix_blocks))  # deepest forgotten first

    def completed(self, request: RouteRequest, decision: Decision, ok: bool) -> None:
        pass  # the tree keeps what was sent until evicted

    def set_replicas(self, replicas: tuple[str, ...]) -> None:
        self.tree.set_replicas(replicas)  # SGLang: remove_tenant


PLUGIN: PolicyPlugin = PolicyPlugin("radix-balance", RadixBalanceParams,
                                    lambda params, routing, facts: RadixBalance(params), {
    "cache-match": "radix-balance: loads balanced and the longest prefix match is above cache_threshold",
    "min-load": "radix-balance: loads balanced but no match above cache_threshold; fewest in flight",
    "imbalanced": "radix-balance: loads imbalanced (both thresholds exceeded); fewest in flight",
})
