"""The requests waiting in the router, and the order they leave in.

- **Strict priority between bands**: a band is served only while no higher band has a request
  that could go to a replica with room.
- **A fair share between the flows of a band, in tokens of work**: each flow has a virtual
  token counter (VTC, Sheng et al., "Fairness in Serving Large Language Models", OSDI'24),
  charged with the work of each request it sends (flow_control.py says how much); the flow
  with the least counter is served first. A flow that starts waiting again is lifted to the
  least counter of the flows waiting (or, none waiting, to the counter of the last flow
  served, the band's ``floor``), so time spent idle is no credit to spend later (VTC's rule).
- **Locality, within a bounded deficit**: among the flows whose counter is at most
  ``locality_deficit`` above the least, a request whose conversation's cache holder has room
  goes first (``LOCAL``), then one with no cache anywhere (``NEW``), then the least served
  flow's request (``FAIR``), which the policy places wherever there is room. Past the
  deficit, fairness wins. The caller says which kind a request is, and may hold one back
  for now (flow_control.py: a request whose holder is full waits for it a while).
- **The bound**, proved and tested (tests/routing/test_flow_properties.py): a request is
  taken only when its flow's counter is at most ``least + locality_deficit``, ``least`` the
  least counter of the band's flows that could go, a flow holding a request back for its
  cache holder included: once every other flow that could go is past the deficit, the held
  request goes at once, elsewhere (``FAIR``). So two flows waiting all along differ by at
  most ``locality_deficit + U``, U the largest work of one request.
  DLPM (Cao et al., arXiv 2501.14312) bounds its locality in the same spirit with deficit
  counters and a quantum.
- Within a flow, oldest first; a flow's first LOOKAHEAD requests are looked at for locality.

That order is one of several (extproc/routing/orders/): the queue keeps the bands, the flows'
queues and counters, and asks its order which of a band's flows that could go sends next; the
field's disciplines (FIFO, round robin, least attained service, VTC without locality) are
baselines to measure this one against.

Pure and synchronous: the caller says which replicas have room for a request (``rooms_of``)
and what kind of candidate it is (``kind_of``); the clock is an argument.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from typing import NamedTuple

from extproc.routing.decision import RouteRequest
from extproc.routing.flows import Flow
from extproc.routing.orders import Candidate, Order
from extproc.routing.orders.vtc_local import LocalVtc

LOOKAHEAD = 8  # requests of a flow examined for one that keeps a cache
LOCAL, NEW, FAIR = 0, 1, 2  # why a request was taken: its cache holder has room, it has no cache, its turn
KINDS = ("local", "new", "fair")


class Waiting(NamedTuple):
    request: RouteRequest  # keyed (Router.keyed): its conversation's key says where its cache is
    flow: Flow
    avoid: frozenset[str]  # replicas it must not go to (as decided when it arrived)
    arrived: float
    deadline: float  # it expires at this time


class Choice(NamedTuple):
    """The request to dispatch next, with what led there (its decision trace keeps it)."""

    waiting: Waiting
    rooms: tuple[str, ...]  # the replicas with room for it
    kind: int  # LOCAL, NEW or FAIR
    counter: float  # its flow's counter when chosen
    least: float  # the least counter of the band's flows that could go then


RoomsOf = Callable[[Waiting], tuple[str, ...]]
KindOf = Callable[[Waiting, tuple[str, ...]], "int | None"]  # LOCAL, NEW, FAIR, or None: not now


class _Band:
    __slots__ = ("flows", "size", "floor")

    def __init__(self) -> None:
        self.flows: dict[str, deque[Waiting]] = {}  # tenant -> its waiting requests, oldest first
        self.size = 0
        self.floor = 0.0  # the counter of the last flow served: where a flow waiting afresh starts


class FairQueue:
    def __init__(self, band_size: int, locality_deficit: float, order: Order | None = None,
                 turn_waits: bool = False) -> None:
        self.band_size = band_size
        self.locality_deficit = locality_deficit
        # the least served flow's turn while its request waits for its holder: False, it goes elsewhere
        # now; True, nothing of its band (or a lower one) leaves until its holder frees or its patience
        # ends (not work-conserving)
        self.turn_waits = turn_waits
        self.order: Order = LocalVtc() if order is None else order
        self._bands: dict[int, _Band] = {}
        self._order: list[int] = []  # the bands' priorities, highest first
        # flows waiting or in flight -> virtual token counter; an idle flow is forgotten
        self.counters: dict[Flow, float] = {}
        self.in_flight: dict[Flow, int] = {}
        self._by_id: dict[str, Waiting] = {}
        self._arrivals: deque[Waiting] = deque()  # arrival order, which is deadline order (one TTL)

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def push(self, waiting: Waiting) -> bool:
        """Queue ``waiting``; False when its band is full (nothing changes)."""
        band = self._band(waiting.flow.priority)
        if band.size >= self.band_size:
            return False
        queued = band.flows.get(waiting.flow.tenant)
        if queued is None:  # waiting afresh
            self.counters[waiting.flow] = self._lifted(waiting.flow, band)
            queued = band.flows[waiting.flow.tenant] = deque()
        queued.append(waiting)
        band.size += 1
        self._by_id[waiting.request.request_id] = waiting
        self._arrivals.append(waiting)
        return True

    def remove(self, request_id: str) -> Waiting | None:
        """Take a waiting request out unserved (its client left, it expired, no replica): nothing charged."""
        waiting = self._by_id.pop(request_id, None)
        if waiting is not None:
            self._unqueue(waiting)
        return waiting

    def expired(self, now: float) -> list[Waiting]:
        """Take out and return the requests whose deadline has come."""
        gone = []
        while self._arrivals and self._arrivals[0].deadline <= now:
            waiting = self._arrivals.popleft()
            if self._by_id.pop(waiting.request.request_id, None) is waiting:
                self._unqueue(waiting, arrivals=False)
                gone.append(waiting)
        return gone

    def next_deadline(self) -> float | None:
        """When the oldest waiting request expires (None: nothing waits)."""
        while self._arrivals and self._arrivals[0].request.request_id not in self._by_id:
            self._arrivals.popleft()  # removed already
        return self._arrivals[0].deadline if self._arrivals else None

    def choose(self, rooms_of: RoomsOf, kind_of: KindOf, now: float = 0.0) -> Choice | None:
        """The request to dispatch next (left queued: ``take`` it once routed), or None when no
        waiting request has a replica with room."""
        for priority in self._order:
            band = self._bands[priority]
            if band.size:
                choice, turn_waits = self._choose_in(priority, band, rooms_of, kind_of, now)
                if choice is not None or turn_waits:  # a band whose turn waits holds the lower ones too
                    return choice
        return None

    def _choose_in(self, priority: int, band: _Band, rooms_of: RoomsOf, kind_of: KindOf,
                   now: float) -> tuple[Choice | None, bool]:
        """The band's request to dispatch next (None: none can go), and whether the band waits for
        its least served flow's holder (``turn_waits``)."""
        candidates: list[Candidate] = []
        offered: list[tuple[int, Waiting, tuple[str, ...]]] = []
        held: tuple[float, Waiting, tuple[str, ...]] | None = None  # the least served flow held back
        for tenant, queued in band.flows.items():
            best, first_held = _best_of(queued, rooms_of, kind_of, self.order.locality)
            counter = self.counters[Flow(priority, tenant)]
            if best is not None:
                candidates.append(Candidate(best[0], counter, best[1].arrived, queued[0].arrived,
                                            Flow(priority, tenant), len(offered)))
                offered.append(best)
            elif first_held is not None and (held is None or counter < held[0]):
                held = (counter, *first_held)
        least = min((candidate.counter for candidate in candidates), default=math.inf)
        if held is not None and held[0] < least:
            least = held[0]
            within = [candidate for candidate in candidates if candidate.counter <= least + self.locality_deficit]
            if candidates and not within:  # the others are past the deficit: the held-back flow's turn
                return (None, True) if self.turn_waits else (Choice(held[1], held[2], FAIR, least, least), False)
            candidates = within
        if not candidates:
            return None, False
        chosen = self.order.pick(candidates, self.locality_deficit, now)
        kind, waiting, rooms = offered[chosen.position]
        return Choice(waiting, rooms, kind, chosen.counter, least), False

    def take(self, waiting: Waiting, work: float) -> None:
        """``waiting`` was routed: out of the queue, its flow charged ``work`` and one more in flight."""
        if self._by_id.pop(waiting.request.request_id, None) is not None:
            self._unqueue(waiting, forget=False)
        self._charged(waiting.flow, self.counters[waiting.flow], work)

    def charge_at_once(self, flow: Flow, work: float) -> float:
        """A request of ``flow`` went to a replica without waiting: lifted as if it had waited, then
        charged; its counter before the charge."""
        counter = self._lifted(flow, self._band(flow.priority))
        self._charged(flow, counter, work)
        return counter

    def _charged(self, flow: Flow, counter: float, work: float) -> None:
        band = self._bands[flow.priority]
        band.floor = max(band.floor, counter)
        self.counters[flow] = counter + work
        self.in_flight[flow] = self.in_flight.get(flow, 0) + 1

    def _lifted(self, flow: Flow, band: _Band) -> float:
        """A flow's counter as it starts waiting: at least the least of the band's waiting flows (or,
        none waiting, the floor), so time spent idle is no credit (VTC's lift)."""
        least = min((self.counters[Flow(flow.priority, tenant)] for tenant in band.flows), default=band.floor)
        return max(self.counters.get(flow, least), least)

    def _band(self, priority: int) -> _Band:
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = _Band()
            self._order = sorted(self._bands, reverse=True)
        return band

    def finished(self, flow: Flow) -> None:
        """A request of ``flow`` left its replica."""
        held = self.in_flight.get(flow, 0) - 1
        if held > 0:
            self.in_flight[flow] = held
            return
        self.in_flight.pop(flow, None)
        self._forget_if_idle(flow)

    def correct(self, flow: Flow, work: float) -> None:
        """Add ``work`` (negative: refund) to a known flow's counter: its charge was an estimate."""
        if flow in self.counters:
            self.counters[flow] = max(0.0, self.counters[flow] + work)

    def demand(self, flow: Flow) -> int:
        """Requests ``flow`` has in flight or waiting."""
        queued = self._bands.get(flow.priority)
        waiting = queued.flows.get(flow.tenant) if queued is not None else None
        return self.in_flight.get(flow, 0) + (len(waiting) if waiting is not None else 0)

    def busiest_demand(self) -> int:
        """The most requests one flow has in flight or waiting."""
        return max(map(self.demand, self.counters), default=0)

    def depths(self) -> Iterator[tuple[Flow, int]]:
        """(flow, requests waiting) of every flow with a request waiting."""
        for priority, band in self._bands.items():
            for tenant, queued in band.flows.items():
                yield Flow(priority, tenant), len(queued)

    def waiting(self) -> Iterator[Waiting]:
        return iter(list(self._by_id.values()))

    def _unqueue(self, waiting: Waiting, arrivals: bool = True, forget: bool = True) -> None:
        priority, tenant = waiting.flow
        band = self._bands[priority]
        queued = band.flows[tenant]
        queued.remove(waiting)
        band.size -= 1
        if not queued:
            del band.flows[tenant]
            if forget:
                self._forget_if_idle(waiting.flow)
        if arrivals and self._arrivals and self._arrivals[0] is waiting:
            self._arrivals.popleft()  # others are skipped when reached (next_deadline, expired)

    def _forget_if_idle(self, flow: Flow) -> None:
        """A flow neither waiting nor in flight keeps no state (a hostile tenant id costs nothing after)."""
        band = self._bands.get(flow.priority)
        if flow not in self.in_flight and (band is None or flow.tenant not in band.flows):
            self.counters.pop(flow, None)


def _best_of(queued: deque[Waiting], rooms_of: RoomsOf, kind_of: KindOf, locality: bool
             ) -> tuple[tuple[int, Waiting, tuple[str, ...]] | None, tuple[Waiting, tuple[str, ...]] | None]:
    """The flow's request that best keeps caches among its first LOOKAHEAD (oldest first on a tie);
    without ``locality``, its oldest that could go. Second: its oldest request held back for
    now (kind None) although a replica has room, which counts for the deficit bound."""
    best: tuple[int, Waiting, tuple[str, ...]] | None = None
    first_held: tuple[Waiting, tuple[str, ...]] | None = None
    for waiting in islice(queued, LOOKAHEAD):
        rooms = rooms_of(waiting)
        if not rooms:
            continue
        kind = kind_of(waiting, rooms)
        if kind is None:
            first_held = first_held or (waiting, rooms)
            continue
        if best is None or kind < best[0]:
            best = (kind, waiting, rooms)
            if kind == LOCAL or not locality:
                break
    return best, first_held
