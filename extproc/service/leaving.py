"""The routing service's side of a replica's leaving (extproc/routing/leaving.py).

Admin ``Leaving(replica)`` begins the order: the replica stays in the router's list, but a
request may go there only when it continues a conversation whose cache is there and not yet
moved (and the deadline is not near); a moved one goes to its receiver only. Each request's
phase (before move, after move, unmoved) goes into the decision trace (``leaving_phase``);
when the replica list drops the replica, the order ends and its phases are logged once
(``replica_left``). On Kubernetes the order begins when discovery lists the replica as
leaving (a terminating pod still serving), and its slot sidecar's ``Migrated(drained=...)``
ends it for routing before llama-server stops.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

from extproc.routing.leaving import Leaving


class LeavingReplicas:
    def __init__(self, log: Callable[[dict[str, Any]], None], clock: Callable[[], float] = time.time) -> None:
        self.log, self.clock = log, clock
        self.orders: dict[str, Leaving] = {}

    def begin(self, replica: str, idle: Iterable[int], in_flight: Iterable[int], bound_s: float,
              near_s: float) -> Leaving:
        order = self.orders[replica] = Leaving.begin(replica, self.clock(), bound_s, near_s, idle, in_flight)
        return order

    def avoid(self, key: int, avoid: Collection[str], endpoints: Collection[str]) -> tuple[Collection[str], str]:
        """What a request of the conversation ``key`` must avoid, with the leaving replicas' orders
        applied; its phase ("" if none)."""
        if not self.orders:
            return avoid, ""
        now = self.clock()
        avoided, phase = set(avoid), ""
        for order in self.orders.values():
            route = order.route(key, now)
            if route.only is not None and route.only in endpoints and route.only not in avoid:
                avoided.update(name for name in endpoints if name != route.only)
            else:
                avoided.update(route.avoid)
            if route.phase is not None:
                phase = route.phase.value
        return frozenset(avoided), phase

    def sent(self, key: int, replica: str) -> None:
        if self.orders:
            now = self.clock()
            for order in self.orders.values():
                order.sent(key, replica, now)

    def ended(self, key: int, replica: str) -> None:
        order = self.orders.get(replica)
        if order is not None:
            order.ended(key)

    def moved(self, key: int, receiver: str) -> None:
        for order in self.orders.values():
            order.moved(key, receiver, self.clock())

    def status(self, replica: str) -> str:
        """"" (not leaving), "leaving" or "drained"."""
        order = self.orders.get(replica)
        return "" if order is None else "leaving" if order.down_s is None else "drained"

    def drained(self, replica: str) -> None:
        """Its drain is over (its slot sidecar says so, the replica still listed): it is down for
        routing, no request goes there any more; the order is logged when the list drops it."""
        order = self.orders.get(replica)
        if order is not None and order.down_s is None:
            order.went_down(self.clock())

    def set_replicas(self, names: Collection[str]) -> None:
        """A leaving replica dropped from the list went down: its order ends, its phases logged."""
        for name in [n for n in self.orders if n not in names]:
            order = self.orders.pop(name)
            if order.down_s is None:
                order.went_down(self.clock())
            self.log({"event": "replica_left", **order.phases()})
