"""prefix-affinity: llm-d's default scheduling profile, on the blocks this router sent.

Follows llm-d/llm-d-inference-scheduler at 520af47896e5f06e43d09aca281a1149187b0ffd:
pkg/epp/config/loader/defaults.go (loadDefaultConfig, the profile used when no config is
given) and, under pkg/epp/framework/plugins/, scheduling/scorer/prefix/plugin.go,
scheduling/scorer/queuedepth/queue.go, scheduling/scorer/kvcacheutilization/
kvcache_utilization.go, scheduling/picker/maxscore and
requestcontrol/dataproducer/approximateprefix/{plugin,indexer,types}.go.

Every eligible replica gets 3 x prefix + 2 x queue + 2 x kv and the highest wins:
- prefix = matched / total blocks, from the approximate index of blocks sent to each
  replica (greedy walk that stops at the first block no replica holds; at most 256
  blocks matched; 31,250 blocks remembered per replica, least recently sent forgotten);
- queue = (max - q) / (max - min) over the candidates (1 when all equal), q = requests
  in flight on the replica (llm-d reads vLLM's waiting queue, which the router cannot see);
- kv = 1 - KV usage, usage = tokens in flight / 500,000 (llm-d reads vLLM's KV usage;
  500,000 tokens is the Llama-3-8B-on-H100 figure in types.go behind its LRU size).
llm-d breaks ties at random; here the tied replica at key_hash mod ties (deterministic).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, NamedTuple

from pydantic import Field

from extproc.routing.blocks import BLOCK_CHARS
from extproc.routing.decision import Candidate, Decision, RouteRequest
from extproc.routing.policies.plugin import PolicyPlugin
from extproc.routing.policies.situation import Situation, best_candidate, new, peer_decision
from extproc.routing.prefix_views import BlockIndex

# [routing.prefix-affinity]: llm-d's defaults are the files' values (docs/peer-policies.md)
PrefixAffinityParams = NamedTuple("PrefixAffinityParams", [
    ("prefix_weight", Annotated[float, Field(ge=0, description="weight of the prefix scorer (llm-d: 3)")]),
    ("queue_weight", Annotated[float, Field(ge=0, description="weight of the queue-depth scorer (llm-d: 2)")]),
    ("kv_weight", Annotated[float, Field(ge=0, description="weight of the KV-utilization scorer (llm-d: 2)")]),
    ("max_prefix_blocks", Annotated[int, Field(gt=0, description="blocks of a prompt matched at most (llm-d: 256)")]),
    ("blocks_per_replica", Annotated[int, Field(gt=0, description="blocks remembered per replica, least recently "
                                                                  "sent forgotten (llm-d: 31,250)")]),
    ("kv_capacity_tokens", Annotated[int, Field(gt=0, description="tokens in flight that make a replica's KV "
                                                                  "usage 1 (llm-d's LRU size: 500,000)")]),
])


class PrefixAffinity:
    name: ClassVar[str] = "prefix-affinity"
    prefix_block_chars: ClassVar[int] = BLOCK_CHARS  # llm-d's approximate scorer's block

    def __init__(self, params: PrefixAffinityParams) -> None:
        self.params = params
        self.index = BlockIndex(params.blocks_per_replica)

    def decide(self, situation: Situation) -> Decision | None:
        eligible = situation.eligible
        if not eligible:
            return None
        prefix_weight, queue_weight, kv_weight, max_blocks, _, kv_capacity = self.params
        blocks = situation.request.prefix_blocks[:max_blocks]
        _, matched = self.index.matches(blocks)
        queues, tokens = situation.ledger.loads("requests"), situation.ledger.loads("tokens")
        low = min(queues[name] for name in eligible)
        spread = max(queues[name] for name in eligible) - low
        # 3 x held / blocks + 2 x (max - queue) / (max - min) (2 when all equal) + 2 x (1 - tokens / capacity)
        per_block = prefix_weight / len(blocks) if blocks else 0.0
        per_queue, top = (queue_weight / spread if spread else 0.0), low + spread
        queue_floor = 0.0 if spread else queue_weight
        per_token = kv_weight / kv_capacity
        candidates = [
            new(Candidate, (name, matched.get(name, 0), queues[name],
                            per_block * matched.get(name, 0) + queue_floor + per_queue * (top - queues[name])
                            + kv_weight - per_token * min(tokens[name], kv_capacity)))
            for name in eligible
        ]
        chosen = best_candidate(candidates, situation.key_hash, highest=True)
        return peer_decision(self.name, situation, chosen.replica, "best-score", chosen.matched_blocks,
                             tuple(candidates), (("prefix_weight", prefix_weight), ("queue_weight", queue_weight),
                                                 ("kv_weight", kv_weight)))

    def routed(self, request: RouteRequest, decision: Decision) -> None:
        self.index.add(decision.replica, request.prefix_blocks[:self.params.max_prefix_blocks])  # llm-d: PreRequest

    def completed(self, request: RouteRequest, decision: Decision, ok: bool) -> None:
        pass  # llm-d keeps a request's blocks until its LRU forgets them

    def set_replicas(self, replicas: tuple[str, ...]) -> None:
        self.index.set_replicas(replicas)  # llm-d: RemovePod


PLUGIN: PolicyPlugin = PolicyPlugin("prefix-affinity", PrefixAffinityParams,
                                    lambda params, routing, facts: PrefixAffinity(params),
                      {"best-score": "prefix-affinity: highest llm-d score (prefix_weight x prefix match + "
                                     "queue_weight x queue + kv_weight x KV free)"})
