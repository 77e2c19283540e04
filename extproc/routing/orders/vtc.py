"""VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI'24): the flow with the
least virtual token counter sends its oldest request; no locality. The counters, their lift on
waiting afresh and their charge (weighted input and output tokens, input 1, output 2 as the
paper's default) are the queue's (queue.py, flow_control.py)."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.routing.flows import Flow
from extproc.routing.orders.base import Candidate


class Vtc:
    locality = False

    def pick(self, candidates: Sequence[Candidate], deficit: float, now: float) -> Candidate:
        return min(candidates, key=lambda candidate: (candidate.counter, candidate.arrived))

    def completed(self, flow: Flow, work: float, now: float) -> None:
        """The queue's counters already hold the corrected work."""
