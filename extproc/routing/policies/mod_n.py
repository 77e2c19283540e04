"""mod-n: hash(conversation) mod N over the sorted replicas. Sticky until N changes,
then most conversations move (3 → 4 replicas moves about 3/4 of them)."""

from __future__ import annotations

from typing import ClassVar

from extproc.routing.decision import Decision
from extproc.routing.policies.plugin import NoParams, PolicyPlugin
from extproc.routing.policies.situation import Situation, unbounded_decision


class ModN:
    name: ClassVar[str] = "mod-n"
    prefix_block_chars: ClassVar[int] = 0

    def decide(self, situation: Situation) -> Decision | None:
        eligible = situation.eligible
        if not eligible:
            return None
        replica = eligible[situation.key_hash % len(eligible)]
        return unbounded_decision(self.name, situation, replica, "hash")


PLUGIN: PolicyPlugin = PolicyPlugin("mod-n", NoParams, lambda params, routing, facts: ModN(),
                      {"hash": "mod-n: hash(conversation) mod the number of replicas"})
