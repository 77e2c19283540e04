"""chwbl: KubeAI's PrefixHash load balancing (consistent hashing with bounded loads).

Follows substratusai/kubeai at 2f32ef498da629f96fd417ddfaaf22c28d40787e:
internal/loadbalancer/balance_chwbl.go (chwblGetAddr, chwblLoadOK), group.go, and the
defaults in api/k8s/v1/model_types.go: meanLoadFactor 125 %, replication 256 points per
endpoint, prefixCharLength 100.

The key is hashed onto a ring of 256 points per replica; walking clockwise, the first
replica whose requests in flight are at most 1.25 x (all in flight + 1) / replicas wins
(KubeAI compares the load before this request; with nothing in flight the home wins).
KubeAI's key is the first 100 characters of the first user message (chat) or of the
prompt; here it is the first 64-character prefix block of the rendered prompt (the
conversation key when blocks are unknown). KubeAI's fallback to the first endpoint when
none is under the bound cannot happen without adapters (the least loaded is always
under it), so it is not here.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, NamedTuple

from pydantic import Field

from extproc.routing.blocks import BLOCK_CHARS
from extproc.routing.decision import Check, Decision
from extproc.routing.policies.bounded_walk import WALK_REASONS
from extproc.routing.policies.plugin import PolicyPlugin
from extproc.routing.policies.situation import HOME_REASON, Situation, new, peer_decision
from extproc.routing.ring import HashRing

# [routing.chwbl]: KubeAI's defaults are the files' values
ChwblParams = NamedTuple("ChwblParams", [
    ("load_factor", Annotated[float, Field(gt=1, description="a replica takes a request while its requests in "
                                                             "flight are at most this x the mean (KubeAI: 1.25)")]),
    ("replication", Annotated[int, Field(gt=0, le=10_000, description="ring points per replica (KubeAI: 256)")]),
])


class Chwbl:
    name: ClassVar[str] = "chwbl"
    prefix_block_chars: ClassVar[int] = BLOCK_CHARS  # llm-d's approximate scorer's block

    def __init__(self, params: ChwblParams, seed: int) -> None:
        self.load_factor, self.replication = params
        self._seed = seed
        self._ring = HashRing((), self.replication, self._seed)

    def decide(self, situation: Situation) -> Decision | None:
        eligible = situation.eligible
        if not eligible:
            return None
        if self._ring.replicas != situation.ring.replicas:  # membership changed: KubeAI re-adds endpoints
            self._ring = HashRing(situation.ring.replicas, self.replication, self._seed)
        blocks = situation.request.prefix_blocks
        key = blocks[0] if blocks else situation.key_hash
        loads, total = situation.ledger.loads("requests"), situation.total("requests")
        cap = (total + 1) / len(eligible) * self.load_factor
        checks = []
        for name in self._ring.walk(key):
            if name in situation.avoid:
                continue
            accepted = total == 0 or loads[name] <= cap
            checks.append(new(Check, (name, loads[name], 0, cap, accepted, False)))
            if accepted:
                break
        chosen, home = checks[-1].replica, checks[0].replica
        return peer_decision(self.name, situation, chosen, "home" if chosen == home else "overflow", 0,
                             figures=(("load_factor", self.load_factor),), walk=(home, total + 1, cap, tuple(checks)))


PLUGIN: PolicyPlugin = PolicyPlugin("chwbl", ChwblParams,
                                    lambda params, routing, facts: Chwbl(params, routing.hash_seed), {
    **HOME_REASON, "overflow": WALK_REASONS["overflow"]})
