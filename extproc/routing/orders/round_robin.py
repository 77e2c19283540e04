"""Round robin between a band's flows, as llm-d's round-robin fairness policy
(llm-d/llm-d-router, pkg/epp/framework/plugins/flowcontrol/fairness/roundrobin/roundrobin.go,
commit 1f92d0b09065e46ee9099745678499357c7bbf0e; no parameters): the flows sorted by id, a
cursor per band on the last flow served, the next flow after it that has a request sends its
oldest one (their ordering policy's default is first come first served). Blind to work: a
flow of long requests gets as many turns as one of short ones."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.routing.flows import Flow
from extproc.routing.orders.base import Candidate


class RoundRobin:
    locality = False

    def __init__(self) -> None:
        self._last: dict[int, str] = {}  # band -> the tenant served last

    def pick(self, candidates: Sequence[Candidate], deficit: float, now: float) -> Candidate:
        band = candidates[0].flow.priority
        last = self._last.get(band)
        ordered = sorted(candidates, key=lambda candidate: candidate.flow.tenant)
        after = [candidate for candidate in ordered if last is not None and candidate.flow.tenant > last]
        chosen = (after or ordered)[0]
        self._last[band] = chosen.flow.tenant
        return chosen

    def completed(self, flow: Flow, work: float, now: float) -> None:
        """Turns, not work, make the rotation."""
