"""This router's order: VTC's least virtual token counter, lending cache locality a bounded
deficit (queue.py's module docstring proves the bound). Among the flows at most ``deficit``
above the least counter: a request whose cache holder has room, then one cached nowhere, then
the least served flow's; on a tie, the less served flow, then the older request."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.routing.flows import Flow
from extproc.routing.orders.base import Candidate


class LocalVtc:
    locality = True

    def pick(self, candidates: Sequence[Candidate], deficit: float, now: float) -> Candidate:
        least = min(candidate.counter for candidate in candidates)
        within = [candidate for candidate in candidates if candidate.counter <= least + deficit]
        return min(within, key=lambda candidate: (candidate.kind, candidate.counter, candidate.arrived))

    def completed(self, flow: Flow, work: float, now: float) -> None:
        """The queue's counters already hold the corrected work."""
