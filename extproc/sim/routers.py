"""Several gateway routers in front of one fleet, as a Kubernetes Service spreads them.

The judging client opens a new connection for every request, so every request (and
every parallel side of a turn) meets a router of its own:
- ``separate``: N independent routers, each with its own ledger, placement memory and
  policy state; a router sees only the requests it routed and completes them itself;
- ``shared``: one router behind all N (what perfect agreement would give);
- ``affinity``: a front tier hashing on the conversation id picks the router, so every
  turn of a conversation meets the same router while the load still splits;
- ``shared-load`` and ``affinity-shared-load``: as ``separate`` and ``affinity``, but all
  routers charge one load ledger (an exact, instant load picture: the best any load
  agreement could give) while placement memory and policy state stay per router.

The engine drives a tier exactly as it drives one ``Router``.
"""

from __future__ import annotations

import random

from extproc.routing import Router
from extproc.routing.decision import Decision, RouteRequest
from extproc.routing.hashing import stable_hash
from extproc.settings import RoutingSettings

ROUTER_STATES = ("separate", "shared", "affinity", "shared-load", "affinity-shared-load")


def check_router_tier(count: int, state: str) -> None:
    if count < 1:
        raise ValueError(f"routers: need at least 1 (got {count})")
    if state not in ROUTER_STATES:
        raise ValueError(f"router_state: {state!r} is not one of {', '.join(ROUTER_STATES)}")


class RouterTier:
    def __init__(self, settings: RoutingSettings, count: int, state: str, seed: int) -> None:
        check_router_tier(count, state)
        shared = Router(settings) if state == "shared" else None
        self.routers = [shared or Router(settings) for _ in range(count)]
        if state.endswith("shared-load"):
            for router in self.routers[1:]:
                router.ledger = self.routers[0].ledger
        self.state = state
        self.routed = [0] * count  # requests each router decided
        self._seed = seed
        self._draw = random.Random(f"router-tier:{seed}").randrange  # the Service's spread, fixed per seed
        self._owner: dict[str, Router] = {}  # in flight: request id -> the router that routed it

    def pick(self, request: RouteRequest) -> int:
        """The router this request's connection lands on."""
        if self.state.startswith("affinity"):
            return stable_hash(request.conversation, self._seed) % len(self.routers)
        return self._draw(len(self.routers))

    def route(self, request: RouteRequest) -> Decision | None:
        index = self.pick(request)
        router = self.routers[index]
        decision = router.route(request)
        self.routed[index] += 1
        if decision is not None:
            self._owner[request.request_id] = router
        return decision

    def complete(self, request_id: str, ok: bool = True) -> Decision | None:
        """Completed by the router that routed it (a no-op for one already completed)."""
        router = self._owner.pop(request_id, None)
        return router.complete(request_id, ok) if router is not None else None

    def report_cached(self, request: RouteRequest, replica: str, predicted: int, cached: int) -> None:
        """An answer's cached tokens go to the router that routed it (reported before its release)."""
        router = self._owner.get(request.request_id)
        if router is not None:
            router.report_cached(request, replica, predicted, cached)

    def set_replicas(self, replicas: list[str]) -> None:
        for router in self.distinct():  # every router watches the same discovery
            router.set_replicas(replicas)

    def distinct(self) -> list[Router]:
        return list({id(router): router for router in self.routers}.values())

    def in_flight(self) -> int:
        return sum(router.in_flight() for router in self.distinct())
