"""The replicas as the gateway sees them: their addresses, the unhealthy ones, where a pick may
go (a gateway's subset, the model's replicas, the healthy ones) and where Envoy falls back."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from extproc.routing.ledger import LoadLedger
from extproc.service.metrics import ReplicaState


class Fleet:
    def __init__(self, fallbacks: int) -> None:
        """fallbacks: service.fallbacks, the endpoints Envoy may retry after the pick."""
        self.endpoints: dict[str, str] = {}  # name -> "host:port"
        self.unhealthy: set[str] = set()  # avoided until their /health answers (replica_health.py)
        self.fallbacks = fallbacks

    def set(self, replicas: Mapping[str, str]) -> None:
        self.endpoints = dict(replicas)
        self.unhealthy &= set(self.endpoints)

    def mark_unhealthy(self, name: str) -> bool:
        """Whether ``name`` was a healthy replica."""
        if name in self.endpoints and name not in self.unhealthy:
            self.unhealthy.add(name)
            return True
        return False

    def mark_healthy(self, name: str) -> bool:
        """Whether ``name`` was unhealthy."""
        if name in self.unhealthy:
            self.unhealthy.discard(name)
            return True
        return False

    def states(self, ledger: LoadLedger, names: Collection[str]) -> list[ReplicaState]:
        """Each replica now: address, health, load in flight (for /metrics and the Admin API)."""
        return [
            ReplicaState(name, self.endpoints.get(name, ""), name not in self.unhealthy,
                         ledger.requests(name), ledger.tokens(name))
            for name in names
        ]  # fmt: skip

    def avoid(self, subset: frozenset[str] | None, serving: Collection[str]) -> Collection[str]:
        """The replicas a pick must not land on: outside the gateway's subset, not serving the
        request's model (``serving``), and the unhealthy ones (unless no other is left)."""
        if subset is None and len(serving) == len(self.endpoints):  # the common case: no list to build
            return self.unhealthy if len(self.unhealthy) < len(self.endpoints) else ()
        allowed = self._eligible(subset, serving)
        return [name for name in self.endpoints if name not in allowed]

    def _eligible(self, subset: frozenset[str] | None, serving: Collection[str]) -> list[str]:
        """The replicas a pick may land on: the healthy ones (all when none is) of the subset
        that serve the model."""
        names = [name for name in sorted(self.endpoints) if name in serving]
        if subset is not None:
            names = [name for name in names if self.endpoints[name] in subset]
        healthy = [name for name in names if name not in self.unhealthy]
        return healthy or names

    def destination(self, replica: str, subset: frozenset[str] | None = None) -> str:
        """The pick's endpoint, then up to ``fallbacks`` healthy others (in name order after it, of
        the subset when one is named): where Envoy retries when the pick refuses."""
        names = sorted(self.endpoints)
        start = names.index(replica)
        fallbacks = [n for n in names[start + 1 :] + names[:start]
                     if n not in self.unhealthy and (subset is None or self.endpoints[n] in subset)]
        return ",".join([self.endpoints[replica]] + [self.endpoints[n] for n in fallbacks[: self.fallbacks]])
