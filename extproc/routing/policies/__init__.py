"""The five routing policies, one file each, and the registry that names them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from extproc.routing.decision import Decision
from extproc.routing.policies.bounded import Bounded
from extproc.routing.policies.consistent import Consistent
from extproc.routing.policies.llm_aware import LlmAware
from extproc.routing.policies.mod_n import ModN
from extproc.routing.policies.round_robin import RoundRobin
from extproc.routing.policies.situation import Situation
from extproc.settings import RoutingSettings


class Policy(Protocol):
    name: str

    def decide(self, situation: Situation) -> Decision | None:
        """Pick a replica (None when none is eligible). Must not change the ledger."""
        ...


POLICIES: dict[str, Callable[[RoutingSettings], Policy]] = {
    cls.name: cls for cls in (RoundRobin, ModN, Consistent, Bounded, LlmAware)
}


def make_policy(settings: RoutingSettings) -> Policy:
    return POLICIES[settings.policy](settings)
