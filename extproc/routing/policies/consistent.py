"""consistent: the conversation's ring home. Scaling moves only ~1/N of conversations,
but a hot replica keeps receiving its conversations however busy it is."""

from __future__ import annotations

from typing import ClassVar

from extproc.routing.decision import Decision
from extproc.routing.policies.plugin import NoParams, PolicyPlugin
from extproc.routing.policies.situation import HOME_REASON, Situation, unbounded_decision


class Consistent:
    name: ClassVar[str] = "consistent"
    prefix_block_chars: ClassVar[int] = 0

    def decide(self, situation: Situation) -> Decision | None:
        replica = situation.home()
        if replica is None:
            return None
        return unbounded_decision(self.name, situation, replica, "home")


PLUGIN: PolicyPlugin = PolicyPlugin("consistent", NoParams, lambda params, routing, facts: Consistent(),
                      HOME_REASON)
