"""First come, first served across every flow of a band: the request that arrived first goes
first, whoever sent it (a replica's own queue, moved into the router)."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.routing.flows import Flow
from extproc.routing.orders.base import Candidate, oldest


class Fifo:
    locality = False

    def pick(self, candidates: Sequence[Candidate], deficit: float, now: float) -> Candidate:
        return oldest(candidates)

    def completed(self, flow: Flow, work: float, now: float) -> None:
        """Arrival order needs no account of work."""
