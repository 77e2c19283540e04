"""kv-cost: NVIDIA Dynamo's KV router cost, on the blocks this router sent.

Follows ai-dynamo/dynamo at 07a6c9ce3bb096cfaf353fe69ee578e105c6a512:
lib/kv-router/src/scheduling/selector/default.rs (worker_logit, minimum_cost_index),
lib/kv-router/src/scheduling/selector/mod.rs (WorkerSelectionInput::row) and the
defaults in lib/kv-router/src/scheduling/config.rs: overlap_score_credit 1.0,
prefill_load_scale 1.0, decode_active_request_weight 0.0, router_temperature 0.0
(lowest cost wins; ties broken at random there, here the tied replica at key_hash mod
ties). The overlap view is Dynamo's approximate indexer (the router's own decisions
standing in for KV events): lib/llm/src/kv_router/approx.rs at
17cf2360cb38f298581048cc4e509269f814f0ad.

For each eligible replica, in blocks of this prompt (its tokens / its block count):
  cost = max(0, (prefill tokens in flight there + prompt tokens) / block - overlap)
         + distinct blocks of its requests in flight + this prompt's blocks not among them
where overlap is how many leading blocks the replica was sent before. Simplified: Dynamo
drops a request's prefill tokens at its first token and expires approximate blocks
after router_ttl_secs = 120; the core sees neither time nor first tokens, so prefill
tokens stay until the request completes and the index keeps 31,250 blocks per replica
(llm-d's figure; deepest blocks forgotten first, as Dynamo's pruning orders them).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, NamedTuple

from pydantic import Field

from extproc.routing.blocks import BLOCK_CHARS
from extproc.routing.decision import Candidate, Decision, RouteRequest
from extproc.routing.hashing import stable_hash
from extproc.routing.policies.plugin import PolicyPlugin
from extproc.routing.policies.situation import Situation, best_candidate, new, peer_decision
from extproc.routing.prefix_views import ActiveBlocks, BlockIndex

# [routing.kv-cost]: Dynamo's defaults are the files' values
KvCostParams = NamedTuple("KvCostParams", [
    ("overlap_score_credit", Annotated[float, Field(ge=0, description="blocks of prefill a cached block saves "
                                                                      "(Dynamo: 1.0)")]),
    ("prefill_load_scale", Annotated[float, Field(ge=0, description="weight of the prefill blocks (Dynamo: 1.0)")]),
    ("blocks_per_replica", Annotated[int, Field(gt=0, description="approximate index blocks per replica, the "
                                                                  "deepest forgotten first (31,250)")]),
])


def request_blocks(request: RouteRequest) -> tuple[int, ...]:
    """The prompt's blocks; unknown blocks count as one block of the request's own."""
    return request.prefix_blocks or (stable_hash(request.request_id),)


class KvCost:
    name: ClassVar[str] = "kv-cost"
    prefix_block_chars: ClassVar[int] = BLOCK_CHARS  # llm-d's approximate scorer's block

    def __init__(self, params: KvCostParams) -> None:
        self.params = params
        self.index = BlockIndex(params.blocks_per_replica)
        self.active = ActiveBlocks()

    def decide(self, situation: Situation) -> Decision | None:
        eligible = situation.eligible
        if not eligible:
            return None
        request = situation.request
        blocks = request_blocks(request)
        block_tokens = request.prompt_tokens / len(blocks)
        overlap = self.index.leading_matches(blocks)
        shared = self.active.shared(blocks)
        prefilling, active = self.active.prefill_tokens(), self.active.blocks()
        credit, scale, _ = self.params
        candidates = []
        for name in eligible:
            cached, held = overlap.get(name, 0), active.get(name, 0)
            prefill = (prefilling.get(name, 0) + request.prompt_tokens) / block_tokens
            decode = held + len(blocks) - shared.get(name, 0)
            cost = scale * max(0.0, prefill - credit * cached) + decode
            candidates.append(new(Candidate, (name, cached, held, cost)))
        chosen = best_candidate(candidates, situation.key_hash, highest=False)
        return peer_decision(self.name, situation, chosen.replica, "min-cost", chosen.matched_blocks,
                             tuple(candidates), (("overlap_score_credit", credit), ("prefill_load_scale", scale)))

    def routed(self, request: RouteRequest, decision: Decision) -> None:
        uncached = request.prompt_tokens - decision.predicted_cached_tokens
        self.active.add(request.request_id, decision.replica, request_blocks(request), uncached)
        self.index.add(decision.replica, reversed(request.prefix_blocks))

    def completed(self, request: RouteRequest, decision: Decision, ok: bool) -> None:
        self.active.remove(request.request_id)

    def set_replicas(self, replicas: tuple[str, ...]) -> None:
        self.index.set_replicas(replicas)
        self.active.set_replicas(replicas)


PLUGIN: PolicyPlugin = PolicyPlugin("kv-cost", KvCostParams, lambda params, routing, facts: KvCost(params), {
    "min-cost": "kv-cost: lowest Dynamo cost (prefill blocks after overlap + active decode blocks)"})
