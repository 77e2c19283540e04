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

from typing import ClassVar

from extproc.routing.blocks import BLOCK_CHARS
from extproc.routing.decision import Candidate, Decision, RouteRequest
from extproc.routing.policies.situation import Situation, new, peer_decision
from extproc.routing.prefix_views import BlockIndex
from extproc.settings import PolicyName, RoutingSettings

PREFIX_WEIGHT, QUEUE_WEIGHT, KV_WEIGHT = 3.0, 2.0, 2.0
MAX_PREFIX_BLOCKS = 256
LRU_BLOCKS_PER_REPLICA = 31_250
KV_CAPACITY_TOKENS = 500_000


class PrefixAffinity:
    name: ClassVar[PolicyName] = "prefix-affinity"
    prefix_block_chars: ClassVar[int] = BLOCK_CHARS  # llm-d's approximate scorer's block

    def __init__(self, settings: RoutingSettings, blocks_per_replica: int = LRU_BLOCKS_PER_REPLICA) -> None:
        self.index = BlockIndex(blocks_per_replica)

    def decide(self, situation: Situation) -> Decision | None:
        eligible = situation.eligible
        if not eligible:
            return None
        blocks = situation.request.prefix_blocks[:MAX_PREFIX_BLOCKS]
        _, matched = self.index.matches(blocks)
        queues, tokens = situation.ledger.loads("requests"), situation.ledger.loads("tokens")
        low = min(queues[name] for name in eligible)
        spread = max(queues[name] for name in eligible) - low
        # 3 x held / blocks + 2 x (max - queue) / (max - min) (2 when all equal) + 2 x (1 - tokens / capacity)
        per_block = PREFIX_WEIGHT / len(blocks) if blocks else 0.0
        per_queue, top = (QUEUE_WEIGHT / spread if spread else 0.0), low + spread
        queue_floor = 0.0 if spread else QUEUE_WEIGHT
        per_token = KV_WEIGHT / KV_CAPACITY_TOKENS
        candidates = [
            new(Candidate, (name, matched.get(name, 0), queues[name],
                            per_block * matched.get(name, 0) + queue_floor + per_queue * (top - queues[name])
                            + KV_WEIGHT - per_token * min(tokens[name], KV_CAPACITY_TOKENS)))
            for name in eligible
        ]
        best = max(candidate.score for candidate in candidates)
        tied = [candidate for candidate in candidates if candidate.score == best]
        chosen = tied[situation.key_hash % len(tied)]
        return peer_decision(self.name, situation, chosen.replica, "best-score", chosen.matched_blocks,
                             tuple(candidates), (("prefix_weight", PREFIX_WEIGHT), ("queue_weight", QUEUE_WEIGHT),
                                                 ("kv_weight", KV_WEIGHT)))

    def routed(self, request: RouteRequest, decision: Decision) -> None:
        self.index.add(decision.replica, request.prefix_blocks[:MAX_PREFIX_BLOCKS])  # llm-d: PreRequest

    def completed(self, request: RouteRequest, decision: Decision, ok: bool) -> None:
        pass  # llm-d keeps a request's blocks until its LRU forgets them

    def set_replicas(self, replicas: tuple[str, ...]) -> None:
        self.index.set_replicas(replicas)  # llm-d: RemovePod
