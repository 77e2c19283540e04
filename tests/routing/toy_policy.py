"""toy: a policy made outside extproc, to show what one is: this file and one ``register`` line.

The conversation's ring home unless it already runs ``max_in_flight`` requests; then the
eligible replica with the fewest (ties: by name).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, NamedTuple

from pydantic import Field

from extproc.routing.decision import Decision, Trace
from extproc.routing.policies.plugin import PolicyPlugin
from extproc.routing.policies.situation import Situation

ToyParams = NamedTuple("ToyParams", [  # [routing.toy]
    ("max_in_flight", Annotated[int, Field(gt=0, description="requests in flight from which the home is passed by")]),
])
REASONS = {"toy-home": "toy: the ring home, under max_in_flight", "toy-spill": "toy: the home was full; the fewest"}


class ToyTrace(NamedTuple):
    """The toy's numbers (Trace.details)."""

    home: str
    home_in_flight: int
    max_in_flight: int


class Toy:
    name: ClassVar[str] = "toy"
    prefix_block_chars: ClassVar[int] = 0

    def __init__(self, params: ToyParams) -> None:
        self.limit = params.max_in_flight

    def decide(self, situation: Situation) -> Decision | None:
        home = situation.home()
        if home is None:
            return None
        loads = situation.ledger.loads("requests")
        replica, reason = home, "toy-home"
        if loads[home] >= self.limit:
            replica, reason = min(situation.eligible, key=lambda name: (loads[name], name)), "toy-spill"
        request = situation.request
        trace = Trace(self.name, request.prompt_tokens, request.max_tokens, ToyTrace(home, loads[home], self.limit))
        return Decision(replica, reason, 1, request.prompt_tokens + request.max_tokens,
                        situation.cached_tokens_on(replica), trace)


PLUGIN = PolicyPlugin("toy", ToyParams, lambda params, routing, facts: Toy(params), REASONS)
