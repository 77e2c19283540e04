"""Flow control: a request goes to a replica while one has room, else it waits in the router
(queue.py) and is dispatched, by priority and fair share, when room frees.

**Room is a free slot.** A llama.cpp replica runs as many requests at once as it has slots
(``--parallel``, ``Router.facts``) and queues the rest itself, first come first served, blind to
tenants: a request sent to a full replica waits there in an order the router no longer controls. So a
replica has room while fewer than its slots are in flight (the ledger's requests, this
router's and, with a store, the others'), and nothing more is sent to it: the router's queue
replaces the replica's. A budget of predicted seconds would keep a queue inside the replica
again (the order lost), rest on predictions that are worst exactly under a flood (a pasted
document's prefill), and gain nothing a free slot misses: a slot frees when an answer ends,
and the next request is sent then (llm-d's concurrency saturation detector counts requests
in flight against a per-endpoint capacity in the same way).

**Headroom.** ``reserved_slots`` of each replica's slots go only to a flow with fewer
requests in flight or waiting than the busiest flow: a flood alone never fills them (it is the
busiest; counted in flight only, the flood held out of the reserved slots would look no busier
than a quiet tenant with as many in flight), so a quiet tenant's request finds a slot at once
and waits only for the batch step it joins (llama.cpp does not preempt). 0 keeps the fleet
strictly work-conserving; each reserved slot costs a flood running alone that slot
(measured: docs/results/2026-12-05-flow-control.md).

**Late binding.** The request to dispatch is chosen, and its replica picked by the policy
among those with room, at the moment room frees, on the ledger and placement memory as they
are then. When nothing waits and a replica has room, ``admit`` routes at once: the path of a
router without flow control, except that full replicas are not candidates.

**Patience.** A waiting request whose conversation's cache holder is full goes elsewhere only
once it has waited as long as that replica would take to compute its cached prefix again (the
holder's learnt prefill speed, at most half the TTL): until then its holder is likely to free
in time, and sending it away would spend that much work again. This is the one exception to
work conservation: a replica with room may idle while such a request waits for its holder
(``wake`` says when the first of them stops waiting).

**Work** charged to a flow's counter at dispatch: ``input_weight`` per prompt token the
replica computes (the prompt less what the decision predicts cached there: a cached prefix
costs the replica almost nothing) plus ``output_weight`` per output token asked for
(max_tokens); corrected by ``settle`` with the tokens the replica reports (prompt_n,
predicted_n). docs/flow-control.md says why the default weights are 1 and 2.

**Baselines.** The queue's ``order`` (extproc/routing/orders/) and ``patience`` are switchable,
so the field's disciplines run through this very object (the simulator measures them):
``vtc-local`` with patience is this router's; FIFO, round robin, least attained service and VTC
run without patience (and, in the simulator, without reserved slots).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

from extproc.routing.decision import Decision, RouteRequest
from extproc.routing.flows import Flow, FlowSettings
from extproc.routing.orders import DEFAULT_ORDER, make_order
from extproc.routing.peers import PeerView
from extproc.routing.placement import Placement
from extproc.routing.queue import FAIR, KINDS, LOCAL, NEW, Choice, FairQueue, Waiting
from extproc.routing.router import Router
from extproc.routing.ticket import Ticket

QUEUE_FULL = "queue_full"
NO_REPLICA = "no_replica"


class Routed(NamedTuple):
    ticket: Ticket
    wait: Wait  # kind "at_once"


class Queued(NamedTuple):
    waiting: Waiting


class Refused(NamedTuple):
    reason: str  # QUEUE_FULL or NO_REPLICA


class Wait(NamedTuple):
    """How a request went through flow control: its decision trace keeps it."""

    flow: Flow
    waited: float  # seconds in the queue
    kind: str  # "at_once" (nothing waited, room), or why it left the queue then: "local", "new", "fair"
    counter: float  # its flow's counter when it left (before its own work)
    least: float  # the least counter among its band's flows that could go then

    def as_dict(self) -> dict[str, object]:
        return {"tenant": self.flow.tenant, "priority": self.flow.priority, "waited_ms": round(self.waited * 1000, 3),
                "kind": self.kind, "counter": round(self.counter, 1), "least": round(self.least, 1)}


class Dispatched(NamedTuple):
    """A waiting request leaving the queue for a replica (``ticket``), or for a 503 (None: no
    replica it may go to is left in the fleet)."""

    waiting: Waiting
    ticket: Ticket | None
    wait: Wait


class _Charge(NamedTuple):
    flow: Flow
    input_tokens: int  # computed tokens charged
    output_tokens: int


class FlowControl:
    def __init__(self, router: Router, settings: FlowSettings, order: str = DEFAULT_ORDER,
                 patience: bool = True, patience_scale: float = 1.0, turn_waits: bool = False) -> None:
        self.router = router
        self.settings = settings
        self.queue = FairQueue(settings.band_size, settings.locality_deficit, make_order(order), turn_waits)
        self.waits_for_holder = patience  # False: a request whose holder is full goes wherever there is room
        self.patience_scale = patience_scale  # times the recompute a request waits for its holder (ablations)
        self._charges: dict[str, _Charge] = {}  # request id -> what its flow was charged, until settled
        self._running: dict[str, Flow] = {}  # request id -> its flow, until its load is released
        self._room_cache: dict[tuple[Flow, frozenset[str]], tuple[str, ...]] = {}  # during one choice
        self._now = 0.0  # the clock of the dispatch under way
        self.wake: float | None = None  # after a dispatch: when a request waiting for its holder stops waiting

    def admit(self, request: RouteRequest, flow: Flow, avoid: Collection[str], now: float,
              peers: PeerView | None = None) -> Routed | Queued | Refused:
        """Route ``request`` now when nothing waits and a replica has room (its cache holder's, or
        its patience is nil); else queue it (the caller then calls ``dispatch``: it may leave at
        once). Refused when its band is full, or when no replica of the fleet is one it may go to."""
        avoided = frozenset(avoid)
        request = self.router.keyed(request)  # its key serves its wait and its route
        replicas = self.router.replicas
        if not replicas or avoided and all(name in avoided for name in replicas):
            return Refused(NO_REPLICA)
        if not self.queue:
            rooms = self._rooms(flow, avoided)
            self._now = now
            # every replica it may go to has room (the usual case): its cache holder's too, whatever its
            # kind; else its kind tells (None: its full holder is worth waiting for)
            everywhere = len(rooms) == _allowed(replicas, avoided)
            if rooms and (everywhere or self._kind(self._waiting(request, flow, avoided, now), rooms) is not None):
                routed = self._at_once(request, flow, rooms, peers)
                if routed is not None:
                    return routed
        waiting = self._waiting(request, flow, avoided, now)
        return Queued(waiting) if self.queue.push(waiting) else Refused(QUEUE_FULL)

    def _waiting(self, request: RouteRequest, flow: Flow, avoided: frozenset[str], now: float) -> Waiting:
        return Waiting(request, flow, avoided, now, now + self.settings.ttl_seconds)

    def _at_once(self, request: RouteRequest, flow: Flow, rooms: tuple[str, ...],
                 peers: PeerView | None) -> Routed | None:
        """Route a request that need not wait to one of ``rooms``, its flow charged; None when the
        policy finds no replica."""
        ticket = self.router.route(request, self._without(rooms), peers)
        if ticket is None:
            return None
        counter = self.queue.charge_at_once(flow, self._charged(request, flow, ticket.decision))
        self._running[request.request_id] = flow
        return Routed(ticket, Wait(flow, 0.0, "at_once", counter, counter))

    def dispatch(self, now: float) -> list[Dispatched]:
        """Send waiting requests to replicas with room, best first, until none can go."""
        sent = []
        self._now, self.wake = now, None
        while self.queue:
            self._room_cache.clear()  # the loads changed with the last one sent
            choice = self.queue.choose(self._cached_rooms, self._kind, now)
            if choice is None:
                break
            sent.append(self._send(choice, now))
        return sent

    def _cached_rooms(self, waiting: Waiting) -> tuple[str, ...]:
        key = (waiting.flow, waiting.avoid)
        found = self._room_cache.get(key)
        if found is None:
            found = self._room_cache[key] = self._rooms(waiting.flow, waiting.avoid)
        return found

    def _send(self, choice: Choice, now: float) -> Dispatched:
        waiting = choice.waiting
        request = waiting.request
        ticket = self.router.route(request, self._without(choice.rooms))
        if ticket is None:
            self.queue.remove(request.request_id)
        else:
            self.queue.take(waiting, self._charged(request, waiting.flow, ticket.decision))
            self._running[request.request_id] = waiting.flow
        wait = Wait(waiting.flow, now - waiting.arrived, KINDS[choice.kind], choice.counter, choice.least)
        return Dispatched(waiting, ticket, wait)

    def cancel(self, request_id: str) -> bool:
        """A waiting request's client went away: out of the queue, nothing charged. False when it
        was not waiting (dispatched or expired already)."""
        return self.queue.remove(request_id) is not None

    def expire(self, now: float) -> list[Waiting]:
        """Take out the requests that waited ``ttl_seconds``: nothing charged (the caller answers them)."""
        return self.queue.expired(now)

    def released(self, request_id: str) -> None:
        """A routed request's load was released (its slot is free: the caller calls ``dispatch``)."""
        flow = self._running.pop(request_id, None)
        if flow is not None:
            self.queue.finished(flow)

    def settle(self, request_id: str, computed: tuple[int, int] | None, now: float | None = None) -> None:
        """The request is over: its flow's charge corrected by the (prompt tokens computed, tokens
        generated) its replica reported; None: its charge stands. The order learns its cost at
        ``now`` (None: the clock of the last dispatch)."""
        charge = self._charges.pop(request_id, None)
        if charge is None:
            return
        settings = self.settings
        input_tokens, output_tokens = (charge.input_tokens, charge.output_tokens) if computed is None else computed
        if computed is not None:
            self.queue.correct(charge.flow, settings.input_weight * (input_tokens - charge.input_tokens)
                               + settings.output_weight * (output_tokens - charge.output_tokens))
        self.queue.order.completed(charge.flow, settings.input_weight * input_tokens
                                   + settings.output_weight * output_tokens, self._now if now is None else now)

    def work(self, request: RouteRequest, predicted_cached: int) -> float:
        """The work a request brings, in tokens (module docstring)."""
        computed = max(0, request.prompt_tokens - predicted_cached)
        return self.settings.input_weight * computed + self.settings.output_weight * request.max_tokens

    def _charged(self, request: RouteRequest, flow: Flow, decision: Decision) -> float:
        """The work a routed request brings (its flow is charged it); kept until ``settle``."""
        computed = max(0, request.prompt_tokens - decision.predicted_cached_tokens)
        self._charges[request.request_id] = _Charge(flow, computed, request.max_tokens)
        return self.work(request, decision.predicted_cached_tokens)

    def _rooms(self, flow: Flow, avoid: frozenset[str]) -> tuple[str, ...]:
        """The replicas with room for a request of ``flow`` (module docstring: headroom)."""
        reserved = self.settings.reserved_slots
        loads = self.router.ledger.loads("requests")
        # the busiest flow (or one alone) keeps out of the reserved slots
        kept_out = reserved if reserved and self.queue.demand(flow) >= self.queue.busiest_demand() else 0
        router = self.router  # its facts: a change of routing reaches them at once
        # at least one slot stays open should Admin.SetRouting lower the slots to reserved_slots or below
        return tuple(name for name in router.replicas
                     if name not in avoid and loads.get(name, 0) < max(1, router.facts(name).slots - kept_out))

    def _without(self, rooms: tuple[str, ...]) -> tuple[str, ...]:
        """The replicas a pick must avoid so that it lands in ``rooms`` (none when all have room,
        the usual case when nothing waits)."""
        replicas = self.router.replicas
        if len(rooms) == len(replicas):
            return ()
        return tuple(name for name in replicas if name not in rooms)

    def _kind(self, waiting: Waiting, rooms: tuple[str, ...]) -> int | None:
        """LOCAL, NEW or FAIR (queue.py); None while it waits for its full holder (module docstring)."""
        placement = self._placement(waiting)
        if placement is None:
            return NEW
        if placement.replica in rooms:
            return LOCAL
        if not self.waits_for_holder:
            return FAIR
        ready = waiting.arrived + self.patience(placement)
        if self._now >= ready:
            return FAIR
        self.wake = ready if self.wake is None else min(self.wake, ready)
        return None

    def patience(self, placement: Placement) -> float:
        """How long a request waits for the replica holding its conversation's ``placement``."""
        speed = self.router.speeds.speed(placement.replica)
        recompute = speed.overhead_s + placement.prompt_tokens * speed.prefill_s_per_token
        return min(self.patience_scale * recompute, self.settings.ttl_seconds / 2)

    def _placement(self, waiting: Waiting) -> Placement | None:
        """Where the waiting request's conversation was last served (None: nowhere it may go)."""
        placement = self.router.memory.get(waiting.request.key)
        if placement is None or placement.replica in waiting.avoid or placement.replica not in self.router.replicas:
            return None
        return placement


def _allowed(replicas: Collection[str], avoided: frozenset[str]) -> int:
    """How many of ``replicas`` a request avoiding ``avoided`` may go to."""
    return len(replicas) if not avoided else sum(1 for name in replicas if name not in avoided)
