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
  agreement could give) while placement memory and policy state stay per router;
- ``store``: the routers agree through a shared store (Redis): each keeps its own ledger and
  placement memory, writes every change to the store without waiting (pipelined), and
  before each decision and completion reads the other routers' writes as they were
  ``store_lag_s`` ago, so a decision misses what the others did in the last lag window.
  Lag 0 gives one router's decisions exactly (while placement memory never forgets). With
  ``store_handoff``, a request released by its conversation's next turn (whose body shows
  its answer) counts as released, and where it was served as known, for every router at
  once: the router receiving the next turn releases it in the store itself, and the
  placement was written when the request was routed (modelled as the completion's writes
  reaching every router at once: the same placement, since the answer came from the pick).
  The learnt replica speeds go through the store too: each answer's timings a router learns
  from are written (``Store.answered``) and the others learn them as they read, so every
  router learns from every answer, in the order they came (the router first reads what was
  written before it, as for a completion). So does llm-aware's prefix index: each change a
  router makes to it (a prompt sent, used, failed) is written, and the others make it as
  they read (``Router.view_changes``); the peer policies' views stay per router, as in
  ``separate``. ``store_outage`` = (from, until): the store is down;
  writes are lost, every router routes on its own state; once it is back each router
  writes its requests in flight again (what the others held of it before is dropped) and
  reads on. The changes to the prefix index made while it was down are kept by their router
  and written when it is back, as the service's writer keeps its queue.

Each router holds its conversations as the gateway does, in a ``Conversations`` of the routing
core (extproc/routing/conversations.py): a request routed waits there (``sent``) for its end or
for a next turn whose body shows its answer (``answered``: released at once by request id, on
the router that routed it), and is no longer waiting once released (``settled``).

The store reaches the routers only through what the core offers several routers: after each call
a router's ledger and placement memory journals and its policy's ``view_changes`` are written
(and the ledger's and memory's again before any read: a migration changes them between calls),
and the others' writes come back as its ledger's elsewhere part, placements it ``learn``-s and
``apply_view_changes``. Nothing of the store runs inside a route.

The engine drives the tier: ``route`` returns the ticket of the router that picked, ``sent``
records it with that router's conversations, ``release`` releases it there, ``answered`` releases
what a next turn shows answered; the tier also gets the simulated time (``clock``, for the
store's lag) and lets the store catch up at the end of a run (``settle``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence

from extproc.routing import Router, Ticket
from extproc.routing.conversations import Conversations
from extproc.routing.decision import RouteRequest
from extproc.routing.hashing import stable_hash
from extproc.routing.ledger import LoadLedger
from extproc.routing.prefix_index import IndexChange
from extproc.routing.settings import RoutingSettings
from extproc.routing.speeds import AnswerTimings

ROUTER_STATES = ("separate", "shared", "affinity", "shared-load", "affinity-shared-load", "store")
_CHARGE, _RELEASE, _REMEMBER, _ANSWER, _INDEX = 0, 1, 2, 3, 4
_EVERYONE = -1  # a write every router has already applied
# (at, writer, kind, key: request id, conversation, an answer's timings or a change to the index, replica, n)
Key = str | int | AnswerTimings | IndexChange
Write = tuple[float, int, int, Key, str, int]


def check_router_tier(count: int, state: str, store_lag_ms: float = 0.0) -> None:
    if count < 1:
        raise ValueError(f"routers: need at least 1 (got {count})")
    if state not in ROUTER_STATES:
        raise ValueError(f"router_state: {state!r} is not one of {', '.join(ROUTER_STATES)}")
    if store_lag_ms < 0:
        raise ValueError(f"store_lag_ms: must be >= 0 (got {store_lag_ms:g})")


class RouterTier:
    def __init__(self, settings: RoutingSettings, count: int, state: str, seed: int,
                 store_lag_s: float = 0.0, store_handoff: bool = False,
                 store_outage: tuple[float, float] | None = None, routers: Sequence[Router] = ()) -> None:
        """routers: the tier's routers (none: ``count`` built from ``settings`` for ``state``)."""
        check_router_tier(count, state, store_lag_s * 1000)
        self.routers = list(routers) or _routers(settings, count, state)
        self.store = Store(self.routers, store_lag_s, store_outage) if state == "store" else None
        # each router's conversations (one for a router behind several places), as the gateway holds them
        self.held = {id(router): Conversations(router.settings.memory_capacity, router.memory)
                     for router in self.routers}
        self._firsts = [(index, router) for index, router in enumerate(self.routers)
                        if self.routers.index(router) == index]  # each router once, at its first place
        self.handoff = store_handoff and self.store is not None
        self.clock: Callable[[], float] = lambda: 0.0  # the simulation's time (the engine sets it)
        self.state = state
        self.routed = [0] * count  # requests each router decided
        self._seed = seed
        self._draw = random.Random(f"router-tier:{seed}").randrange  # the Service's spread, fixed per seed

    @classmethod
    def of(cls, router: Router) -> RouterTier:
        """One given router, as a tier of one."""
        return cls(router.settings, 1, "separate", 0, routers=[router])

    def keyed(self, request: RouteRequest) -> RouteRequest:
        """``request`` carrying its conversation's key: the tier's routers share one hash_seed."""
        return self.routers[0].keyed(request)

    def pick(self, request: RouteRequest) -> int:
        """The router this request's connection lands on."""
        if self.state.startswith("affinity"):
            return stable_hash(request.conversation, self._seed) % len(self.routers)
        return self._draw(len(self.routers))

    def route(self, request: RouteRequest, avoid: Collection[str] = ()) -> Ticket | None:
        index = self.pick(request)
        router = self.routers[index]
        if self.store is not None:
            self.store.read(index, self.clock())
        ticket = router.route(request, avoid)
        if self.store is not None:
            self.store.wrote(index)
        self.routed[index] += 1
        return ticket

    def sent(self, ticket: Ticket, history: int) -> None:
        """The request went to its pick: it waits, with the conversations of the router that routed it,
        for its end or a next turn showing its answer (``history``: its body's, continuation.py)."""
        request = ticket.request
        self.held[id(ticket.router)].sent(request.conversation, request.request_id, history)

    def release(self, ticket: Ticket, ok: bool = True) -> bool:
        """The request is over: released on the router that routed it (a no-op for one released already)."""
        router = routed_by(ticket)
        self.held[id(router)].settled(ticket.request.conversation, ticket.request.request_id)
        if self.store is None:
            return ticket.release(ok)
        if not ticket.held:
            return False
        index = self.routers.index(router)
        self.store.read(index, self.clock())  # the writes before these, in order
        ticket.release(ok)
        self.store.wrote(index)
        return True

    def answered(self, conversation: str, shown: frozenset[int]) -> list[str]:
        """A next turn of ``conversation`` arrived, its body showing the histories ``shown`` answered:
        the requests it shows answered are released at once, each on the router that routed it
        (with the handoff, for every router at once). Their ids."""
        released = []
        for index, router in self._firsts:
            for request_id in self.held[id(router)].answered(conversation, shown):
                self._release_answered(index, router, request_id)
                released.append(request_id)
        return released

    def _release_answered(self, index: int, router: Router, request_id: str) -> None:
        store = self.store
        if store is None:
            router.complete(request_id)
            return
        store.read(index, self.clock())  # the writes before these, in order
        first = len(store.writes)
        router.complete(request_id)
        store.wrote(index)
        if self.handoff:
            store.share_at_once(first)

    def report_cached(self, ticket: Ticket, replica: str, predicted: int, cached: int,
                      timings: AnswerTimings | None = None) -> None:
        """An answer's cached tokens and timings go to the router that routed it (reported before its release)."""
        if not ticket.held:
            return
        router, request, store = routed_by(ticket), ticket.request, self.store
        if store is None:
            router.report_cached(request, replica, predicted, cached, timings)
            return
        index = self.routers.index(router)
        store.read(index, self.clock())  # the answers before this one, in order
        router.report_cached(request, replica, predicted, cached, timings)
        if timings is not None and router.speeds.learning and replica in router.replicas:
            store.answered(index, replica, timings)
        store.wrote(index)  # its prefix index's capacity, with prefix_feedback

    def set_replicas(self, replicas: list[str]) -> None:
        for router in self.distinct():  # every router watches the same discovery
            router.set_replicas(replicas)
            self.held[id(router)].set_replicas(replicas)
        if self.store is not None:
            self.store.set_replicas(replicas)

    def distinct(self) -> list[Router]:
        return [router for _, router in self._firsts]

    def in_flight(self) -> int:
        return sum(router.in_flight() for router in self.distinct())

    def settle(self) -> None:
        """Every write reaches every router (the end of a run: the store catches up)."""
        if self.store is not None:
            self.store.settle()


def _routers(settings: RoutingSettings, count: int, state: str) -> list[Router]:
    if state == "shared":
        return [Router(settings)] * count
    ledger = LoadLedger() if state.endswith("shared-load") else None  # None: each router its own
    return [Router(settings, ledger=ledger) for _ in range(count)]


class Store:
    """The store as the routers see it: each router's writes (its ledger's charges and releases,
    its placements, its prefix index's changes, the answers it learnt from), stamped with the
    time and the writer; a router reads the others' writes once they are ``lag_s`` old, in the
    order they were made. A router's journals are turned on here (``journal``, ``share_view``)."""

    def __init__(self, routers: Sequence[Router], lag_s: float, outage: tuple[float, float] | None = None) -> None:
        self.routers = list(routers)
        for router in self.routers:
            router.ledger.journal, router.memory.journal = [], []
            router.share_view()
        count = len(self.routers)
        self.lag_s = lag_s
        self.outage = outage  # (from, until) in simulated seconds: the store is down
        self.now = 0.0
        self.writes: list[Write] = []
        self.seen = [0] * count  # per router: the first write it has not read
        self.released_early: list[set[str]] = [set() for _ in range(count)]  # handed off before the charge was read
        # per router: the others' charges it holds (its ledger's elsewhere part): request id -> (replica, tokens)
        self.remote: list[dict[str, tuple[str, int]]] = [{} for _ in range(count)]
        # per router: conversation key -> when the placement it holds was written (a later one held wins)
        self.placed_at: list[dict[int, float]] = [{} for _ in range(count)]
        self.resynced = [outage is None for _ in range(count)]

    def _publish(self, writer: int, kind: int, key: Key, replica: str, n: int) -> None:
        if not self.down(self.now):
            self.writes.append((self.now, writer, kind, key, replica, n))
        elif kind == _INDEX and self.outage is not None:  # kept, and written once the store is back
            self.writes.append((self.outage[1], writer, kind, key, replica, n))
        # any other write to a store that is down is lost

    def wrote(self, writer: int) -> None:
        """``writer``'s router made a call: what it changed goes to the store, its prefix index's last."""
        self._journals(writer)
        for change in self.routers[writer].view_changes():
            self._publish(writer, _INDEX, change, "", 0)

    def _journals(self, writer: int) -> None:
        """The charges, releases and placements ``writer``'s router made since these were last written."""
        ledger, memory = self.routers[writer].ledger, self.routers[writer].memory
        if ledger.journal:
            charges, ledger.journal = ledger.journal, []
            for request_id, replica, tokens in charges:
                self._publish(writer, _CHARGE if replica else _RELEASE, request_id, replica, tokens)
        if memory.journal:
            placements, memory.journal = memory.journal, []
            for key, replica, tokens in placements:
                self.placed_at[writer][key] = self.now
                self._publish(writer, _REMEMBER, key, replica, tokens)

    def answered(self, writer: int, replica: str, timings: AnswerTimings) -> None:
        """``writer`` learnt ``replica``'s speed from an answer: the others learn it as they read."""
        self._publish(writer, _ANSWER, timings, replica, 0)

    def down(self, at: float) -> bool:
        return self.outage is not None and self.outage[0] <= at < self.outage[1]

    def share_at_once(self, first: int) -> None:
        """The writes from ``first`` on reach every router now (and are not read again)."""
        for position in range(first, len(self.writes)):
            write = self.writes[position]
            for reader in range(len(self.routers)):
                if reader != write[1]:
                    self._apply(reader, write, at_once=True)
            self.writes[position] = (write[0], _EVERYONE, *write[2:])
        for reader in range(len(self.routers)):
            self._held_elsewhere(reader)

    def read(self, reader: int, now: float) -> None:
        """``reader`` is about to decide or complete at ``now`` (what it writes next is
        stamped ``now``): it takes in the other routers' writes made up to ``now - lag_s``."""
        for writer in range(len(self.routers)):  # made between calls (a migration), stamped when made
            self._journals(writer)
        self.now = now
        if self.down(now):
            return  # on its own state until the store is back
        if not self.resynced[reader] and self.outage is not None and now >= self.outage[1]:
            self.resync(reader)
        self.take(reader, now - self.lag_s)

    def resync(self, reader: int) -> None:
        """The store is back: every router has written its requests in flight again, and the
        writes from before the outage are gone but for placements (the store keeps them)."""
        until = (self.outage or (0.0, 0.0))[1]
        self.remote[reader].clear()
        for writer, other in enumerate(self.routers):
            if writer != reader:
                for request_id, (replica, tokens) in other.ledger.charges().items():
                    self._apply(reader, (until, writer, _CHARGE, request_id, replica, tokens))
        writes, position = self.writes, self.seen[reader]
        while position < len(writes) and writes[position][0] < until:  # the placements and the index stay
            if writes[position][2] in (_REMEMBER, _INDEX) and writes[position][1] != reader:
                self._apply(reader, writes[position])
            position += 1
        self.seen[reader] = position
        self.resynced[reader] = True
        self._held_elsewhere(reader)

    def take(self, reader: int, horizon: float) -> None:
        writes, position = self.writes, self.seen[reader]
        while position < len(writes) and writes[position][0] <= horizon:
            write = writes[position]
            position += 1
            if write[1] != reader and write[1] != _EVERYONE:  # its own writes are in its state already
                self._apply(reader, write)
        self.seen[reader] = position
        self._held_elsewhere(reader)
        done = min(self.seen)
        if done > 4096:  # every router has read these: forget them
            del writes[:done]
            self.seen = [seen - done for seen in self.seen]

    def settle(self) -> None:
        """Every write reaches every router (the end of a run)."""
        for index in range(len(self.routers)):
            self._journals(index)
        for index in range(len(self.routers)):
            if not self.resynced[index]:  # the run ended during the outage
                self.resync(index)
            self.take(index, float("inf"))

    def set_replicas(self, replicas: Collection[str]) -> None:
        """The others' charges on a replica gone went with it (as the routers' own did)."""
        for reader, remote in enumerate(self.remote):
            for request_id in [rid for rid, (replica, _) in remote.items() if replica not in replicas]:
                del remote[request_id]
            self._held_elsewhere(reader)

    def _held_elsewhere(self, reader: int) -> None:
        """``reader``'s ledger holds the others' charges it read as its elsewhere part."""
        loads: dict[str, tuple[int, int]] = {}
        for replica, tokens in self.remote[reader].values():
            requests, held = loads.get(replica, (0, 0))
            loads[replica] = (requests + 1, held + tokens)
        ledger = self.routers[reader].ledger
        if loads or ledger.elsewhere():
            ledger.set_elsewhere(loads)

    def _apply(self, reader: int, write: Write, at_once: bool = False) -> None:
        at, _, kind, key, replica, n = write
        router, remote = self.routers[reader], self.remote[reader]
        if isinstance(key, IndexChange):  # kind _INDEX
            router.apply_view_changes((key,))
        elif isinstance(key, AnswerTimings):  # kind _ANSWER
            router.speeds.learn(replica, key)
        elif kind == _CHARGE:
            if str(key) in self.released_early[reader]:
                self.released_early[reader].discard(str(key))
            elif replica in router.ledger.loads("requests") and str(key) not in remote:
                remote[str(key)] = (replica, n)  # (else the replica left, or a resync had it)
        elif kind == _RELEASE:
            if remote.pop(str(key), None) is None and at_once:  # its charge is still to be read
                self.released_early[reader].add(str(key))
        elif at >= self.placed_at[reader].get(int(key), at):
            router.memory.learn(int(key), replica, n)
            self.placed_at[reader][int(key)] = at


def routed_by(ticket: Ticket) -> Router:
    """The router that routed ``ticket`` (the ticket knows it only as ticket.py's ``Holder``)."""
    router = ticket.router
    assert isinstance(router, Router)
    return router
