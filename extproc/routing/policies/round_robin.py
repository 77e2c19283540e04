"""round-robin: each request to the next replica in turn. Blind to conversations."""

from __future__ import annotations

from typing import ClassVar

from extproc.routing.decision import Decision
from extproc.routing.policies.plugin import NoParams, PolicyPlugin
from extproc.routing.policies.situation import Situation, unbounded_decision


class RoundRobin:
    name: ClassVar[str] = "round-robin"
    prefix_block_chars: ClassVar[int] = 0

    def __init__(self) -> None:
        self._turn = 0

    def decide(self, situation: Situation) -> Decision | None:
        eligible = situation.eligible
        if not eligible:
            return None
        replica = eligible[self._turn % len(eligible)]
        self._turn += 1
        return unbounded_decision(self.name, situation, replica, "rotate")


PLUGIN: PolicyPlugin = PolicyPlugin("round-robin", NoParams, lambda params, routing, facts: RoundRobin(),
                      {"rotate": "round-robin: the next replica in turn"})
