"""consistent: the conversation's ring home. Scaling moves only ~1/N of conversations,
but a hot replica keeps receiving its conversations however busy it is."""

from __future__ import annotations

from typing import ClassVar

from extproc.routing.decision import Decision
from extproc.routing.policies.situation import Situation, unbounded_decision
from extproc.settings import PolicyName, RoutingSettings


class Consistent:
    name: ClassVar[PolicyName] = "consistent"
    prefix_block_chars: ClassVar[int] = 0

    def __init__(self, settings: RoutingSettings) -> None:
        pass

    def decide(self, situation: Situation) -> Decision | None:
        replica = situation.home()
        if replica is None:
            return None
        return unbounded_decision(self.name, situation, replica, "home", home=replica)
