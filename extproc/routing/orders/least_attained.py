"""Least attained service between a band's flows, as llm-d's program-aware fairness plugin's
``las`` strategy (llm-d/llm-d-router,
pkg/epp/framework/plugins/flowcontrol/fairness/program-aware/strategy_las.go, commit
6626b83c7c8d6da30ba6c41e697329ce31242636, and its DefaultConfig): each flow's attained service
is the work of its requests charged **when they complete** (input tokens × 1 + output tokens ×
2), halved every 60 s; among the flows with a request waiting, the one with the best score
0.8 × (1 − its service, range-normalised over them) + 0.2 × (its oldest request's wait,
range-normalised) sends its oldest request.

Two simplifications: the service decays all the time, where llm-d decays only a flow with
nothing waiting or in flight; and the input tokens charged are those the replica computed (as
every order here is charged), where llm-d charges the whole prompt."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.routing.flows import Flow
from extproc.routing.orders.base import Candidate

WEIGHT_SERVICE = 0.8
WEIGHT_HEAD_WAIT = 0.2
HALF_LIFE_S = 60.0


class LeastAttainedService:
    locality = False

    def __init__(self) -> None:
        self._service: dict[Flow, tuple[float, float]] = {}  # flow -> (attained service, as of this time)

    def pick(self, candidates: Sequence[Candidate], deficit: float, now: float) -> Candidate:
        services = [self.service(candidate.flow, now) for candidate in candidates]
        waits = [now - candidate.head_arrived for candidate in candidates]
        scores = [WEIGHT_SERVICE * (1 - _normalised(service, services)) + WEIGHT_HEAD_WAIT * _normalised(wait, waits)
                  for service, wait in zip(services, waits, strict=True)]
        best = max(range(len(candidates)), key=lambda index: (scores[index], -candidates[index].arrived))
        return candidates[best]

    def completed(self, flow: Flow, work: float, now: float) -> None:
        self._service[flow] = (self.service(flow, now) + work, now)

    def service(self, flow: Flow, now: float) -> float:
        """``flow``'s attained service at ``now``, decayed."""
        service, since = self._service.get(flow, (0.0, now))
        return service * 0.5 ** (max(0.0, now - since) / HALF_LIFE_S)


def _normalised(value: float, values: Sequence[float]) -> float:
    low, high = min(values), max(values)
    return 0.0 if high <= low else (value - low) / (high - low)
