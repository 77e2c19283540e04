"""The routing policies, one file each, and the registry that names them.

Ours: round-robin, mod-n, consistent, bounded, llm-aware. The field's routers as
baselines (docs/peer-policies.md): prefix-affinity (llm-d), radix-balance (SGLang),
chwbl (KubeAI), kv-cost (Dynamo).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol, runtime_checkable

from extproc.routing.decision import Decision, RouteRequest
from extproc.routing.policies.bounded import Bounded
from extproc.routing.policies.chwbl import Chwbl
from extproc.routing.policies.consistent import Consistent
from extproc.routing.policies.kv_cost import KvCost
from extproc.routing.policies.llm_aware import LlmAware, make_llm_aware
from extproc.routing.policies.mod_n import ModN
from extproc.routing.policies.prefix_affinity import PrefixAffinity
from extproc.routing.policies.radix_balance import RadixBalance
from extproc.routing.policies.round_robin import RoundRobin
from extproc.routing.policies.situation import Situation
from extproc.settings import PolicyName, RoutingSettings


class Policy(Protocol):
    name: ClassVar[PolicyName]  # the settings' list of names; each class names one member (mypy checks the spelling)
    prefix_block_chars: ClassVar[int]  # > 0: requests must carry prefix_blocks of blocks this long (hashed only then)

    def decide(self, situation: Situation) -> Decision | None:
        """Pick a replica (None when none is eligible). Must not change the ledger."""
        ...


@runtime_checkable
class SentView(Protocol):
    """A policy that keeps its own view of what it sent where; the Router feeds it."""

    def routed(self, request: RouteRequest, decision: Decision) -> None:
        """``decision`` was charged: the request is on its way to ``decision.replica``."""

    def completed(self, request: RouteRequest, decision: Decision, ok: bool) -> None:
        """The request is over: served (``ok``), failed or abandoned."""

    def set_replicas(self, replicas: tuple[str, ...]) -> None:
        """The fleet is now exactly ``replicas``."""


@runtime_checkable
class CacheMoves(Protocol):
    """A policy that keeps its own view of where prompts are cached, told of a migration."""

    def moved(self, blocks: tuple[int, ...], tokens: int, source: str | None, receiver: str) -> None:
        """The cache of a prompt of ``blocks`` (``tokens``) went from ``source`` (None: unknown)
        to ``receiver``."""


@runtime_checkable
class CacheReports(Protocol):
    """A policy that learns from the cached tokens the replicas report (timings.cache_n)."""

    def reported(self, request: RouteRequest, replica: str, predicted: int, cached: int) -> None:
        """``replica`` served ``request`` with ``cached`` prompt tokens from its cache; the
        decision predicted ``predicted``."""


POLICIES: dict[PolicyName, Callable[[RoutingSettings], Policy]] = {
    cls.name: make_llm_aware if cls is LlmAware else cls  # llm-aware's prefix index is a subclass with a view
    for cls in (RoundRobin, ModN, Consistent, Bounded, LlmAware, PrefixAffinity, RadixBalance, Chwbl, KvCost)
}


def make_policy(settings: RoutingSettings) -> Policy:
    return POLICIES[settings.policy](settings)
