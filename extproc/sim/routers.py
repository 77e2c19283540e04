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

The engine drives a tier as it drives one ``Router``: ``route`` returns the ticket of the router
that picked, and the tier releases it (``release``) there; it also gives the tier the simulated
time (``clock``, for the store's lag), says which releases come with the next turn, and lets the
store catch up at the end of a run (``settle``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable

from extproc.routing import Router, Ticket
from extproc.routing.decision import RouteRequest
from extproc.routing.hashing import stable_hash
from extproc.routing.ledger import LoadLedger
from extproc.routing.placement import PlacementMemory
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
                 store_outage: tuple[float, float] | None = None) -> None:
        check_router_tier(count, state, store_lag_s * 1000)
        self.store = Store(count, settings.memory_capacity, store_lag_s, store_outage) if state == "store" else None
        if self.store is not None:  # each router's own ledger and memory, writing to the store
            self.routers = [Router(settings, ledger=ledger, memory=memory)
                            for ledger, memory in zip(self.store.ledgers, self.store.memories, strict=True)]
            for router in self.routers:
                router.share_view()
            self.store.routers = self.routers
        elif state == "shared":
            self.routers = [Router(settings)] * count
        else:
            ledger = LoadLedger() if state.endswith("shared-load") else None  # None: each router its own
            self.routers = [Router(settings, ledger=ledger) for _ in range(count)]
        self.handoff = store_handoff and self.store is not None
        self.clock: Callable[[], float] = lambda: 0.0  # the simulation's time (the engine sets it)
        self.state = state
        self.routed = [0] * count  # requests each router decided
        self._seed = seed
        self._draw = random.Random(f"router-tier:{seed}").randrange  # the Service's spread, fixed per seed

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
            self.store.changed_view(index)
        self.routed[index] += 1
        return ticket

    def release(self, ticket: Ticket, ok: bool = True, by_next_turn: bool = False) -> bool:
        """Released on the router that routed it (a no-op for one released already);
        ``by_next_turn``: its conversation's next turn, carrying its answer, has arrived."""
        if self.store is None:
            return ticket.release(ok)
        if not ticket.held:
            return False
        index = self.routers.index(routed_by(ticket))
        self.store.read(index, self.clock())  # the writes before these, in order
        first = len(self.store.writes)
        ticket.release(ok)
        self.store.changed_view(index)
        if by_next_turn and self.handoff:
            self.store.share_at_once(first)
        return True

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
        store.changed_view(index)  # its prefix index's capacity, with prefix_feedback

    def set_replicas(self, replicas: list[str]) -> None:
        for router in self.distinct():  # every router watches the same discovery
            router.set_replicas(replicas)

    def distinct(self) -> list[Router]:
        return list({id(router): router for router in self.routers}.values())

    def in_flight(self) -> int:
        return sum(router.in_flight() for router in self.distinct())

    def settle(self) -> None:
        """Every write reaches every router (the end of a run: the store catches up)."""
        if self.store is not None:
            for index in range(len(self.routers)):
                if not self.store.resynced[index]:  # the run ended during the outage
                    self.store.resync(index)
                self.store.take(index, float("inf"))


class Store:
    """The store as the routers see it: each router's ledger and memory (``ledgers``,
    ``memories``: one pair per router, given to it) write every change to it, stamped with the
    time and the writer; a router reads the others' writes once they are ``lag_s`` old, in the
    order they were made."""

    def __init__(self, routers: int, memory_capacity: int, lag_s: float,
                 outage: tuple[float, float] | None = None) -> None:
        self.lag_s = lag_s
        self.outage = outage  # (from, until) in simulated seconds: the store is down
        self.now = 0.0
        self.writes: list[Write] = []
        self.seen = [0] * routers  # per router: the first write it has not read
        self.released_early: list[set[str]] = [set() for _ in range(routers)]  # handed off before the charge was read
        self.remote: list[set[str]] = [set() for _ in range(routers)]  # per router: the others' charges it holds
        self.resynced = [outage is None for _ in range(routers)]
        self.publishers = [self._publisher(index) for index in range(routers)]
        self.ledgers = [StoredLedger(publish) for publish in self.publishers]
        self.memories = [StoredMemory(memory_capacity, publish, self) for publish in self.publishers]
        self.routers: list[Router] = []  # given by the tier once built: their speeds learn the answers read

    def _publisher(self, writer: int) -> Callable[[int, Key, str, int], None]:
        def publish(kind: int, key: Key, replica: str, n: int) -> None:
            if not self.down(self.now):
                self.writes.append((self.now, writer, kind, key, replica, n))
            elif kind == _INDEX and self.outage is not None:  # kept, and written once the store is back
                self.writes.append((self.outage[1], writer, kind, key, replica, n))
            # any other write to a store that is down is lost
        return publish

    def changed_view(self, writer: int) -> None:
        """What ``writer``'s router just changed in its prefix index goes to the store."""
        publish = self.publishers[writer]
        for change in self.routers[writer].view_changes():
            publish(_INDEX, change, "", 0)

    def answered(self, writer: int, replica: str, timings: AnswerTimings) -> None:
        """``writer`` learnt ``replica``'s speed from an answer: the others learn it as they read."""
        self.publishers[writer](_ANSWER, timings, replica, 0)

    def down(self, at: float) -> bool:
        return self.outage is not None and self.outage[0] <= at < self.outage[1]

    def share_at_once(self, first: int) -> None:
        """The writes from ``first`` on reach every router now (and are not read again)."""
        for position in range(first, len(self.writes)):
            write = self.writes[position]
            for reader in range(len(self.ledgers)):
                if reader != write[1]:
                    self._apply(reader, write, at_once=True)
            self.writes[position] = (write[0], _EVERYONE, *write[2:])

    def read(self, reader: int, now: float) -> None:
        """``reader`` is about to decide or complete at ``now`` (what it writes next is
        stamped ``now``): it takes in the other routers' writes made up to ``now - lag_s``."""
        self.now = now
        if self.down(now):
            return  # on its own state until the store is back
        if not self.resynced[reader] and self.outage is not None and now >= self.outage[1]:
            self.resync(reader)
        self.take(reader, now - self.lag_s)

    def resync(self, reader: int) -> None:
        """The store is back: every router has written its requests in flight again, and the
        writes from before the outage are gone but for placements (the store keeps them)."""
        ledger, until = self.ledgers[reader], (self.outage or (0.0, 0.0))[1]
        for request_id in self.remote[reader]:
            ledger.release_read(request_id)
        self.remote[reader].clear()
        for writer, other in enumerate(self.ledgers):
            if writer != reader:
                for request_id, (replica, tokens) in other.own.items():
                    self._apply(reader, (until, writer, _CHARGE, request_id, replica, tokens))
        writes, position = self.writes, self.seen[reader]
        while position < len(writes) and writes[position][0] < until:  # the placements and the index stay
            if writes[position][2] in (_REMEMBER, _INDEX) and writes[position][1] != reader:
                self._apply(reader, writes[position])
            position += 1
        self.seen[reader] = position
        self.resynced[reader] = True

    def take(self, reader: int, horizon: float) -> None:
        writes, position = self.writes, self.seen[reader]
        while position < len(writes) and writes[position][0] <= horizon:
            write = writes[position]
            position += 1
            if write[1] != reader and write[1] != _EVERYONE:  # its own writes are in its state already
                self._apply(reader, write)
        self.seen[reader] = position
        done = min(self.seen)
        if done > 4096:  # every router has read these: forget them
            del writes[:done]
            self.seen = [seen - done for seen in self.seen]

    def _apply(self, reader: int, write: Write, at_once: bool = False) -> None:
        at, _, kind, key, replica, n = write
        ledger = self.ledgers[reader]
        if isinstance(key, IndexChange):  # kind _INDEX
            self.routers[reader].apply_view_changes((key,))
        elif isinstance(key, AnswerTimings):  # kind _ANSWER
            self.routers[reader].speeds.learn(replica, key)
        elif kind == _CHARGE:
            if str(key) in self.released_early[reader]:
                self.released_early[reader].discard(str(key))
            elif replica in ledger.loads("requests") and str(key) not in self.remote[reader]:
                ledger.charge_read(str(key), replica, n)  # (else the replica left, or a resync had it)
                self.remote[reader].add(str(key))
        elif kind == _RELEASE:
            self.remote[reader].discard(str(key))
            if ledger.release_read(str(key)) is None and at_once:  # its charge is still to be read
                self.released_early[reader].add(str(key))
        else:
            self.memories[reader].take(at, int(key), replica, n)


class StoredLedger(LoadLedger):
    """A router's own ledger that also writes each charge and release to the store."""

    __slots__ = ("_publish", "own")

    def __init__(self, publish: Callable[[int, Key, str, int], None]) -> None:
        self.own: dict[str, tuple[str, int]] = {}  # this router's requests in flight: id -> (replica, tokens)
        super().__init__()  # (which calls set_replicas)
        self._publish = publish

    def set_replicas(self, replicas: Iterable[str]) -> None:
        super().set_replicas(replicas)
        for request_id in [rid for rid, (replica, _) in self.own.items() if replica not in self.loads("requests")]:
            del self.own[request_id]

    def charge(self, request_id: str, replica: str, tokens: int) -> None:
        super().charge(request_id, replica, tokens)
        self.own[request_id] = (replica, tokens)
        self._publish(_CHARGE, request_id, replica, tokens)

    def release(self, request_id: str) -> tuple[str, int] | None:
        charge = super().release(request_id)
        if self.own.pop(request_id, None) is not None:
            self._publish(_RELEASE, request_id, "", 0)
        return charge

    def charge_read(self, request_id: str, replica: str, tokens: int) -> None:
        """Another router's charge, read from the store: held here, not written back."""
        super().charge(request_id, replica, tokens)

    def release_read(self, request_id: str) -> tuple[str, int] | None:
        """Another router's release (or a charge a resync dropped), read from the store."""
        return super().release(request_id)


class StoredMemory(PlacementMemory):
    """A router's own placement memory that also writes each placement to the store. The
    store keeps a conversation's latest placement: one read after a newer one is ignored."""

    __slots__ = ("_publish", "_shared", "_written")

    def __init__(self, capacity: int, publish: Callable[[int, Key, str, int], None], store: Store) -> None:
        super().__init__(capacity)
        self._publish = publish
        self._shared = store
        self._written: dict[int, float] = {}  # conversation -> when the placement held was written

    def remember(self, key: int, replica: str, prompt_tokens: int) -> None:
        super().remember(key, replica, prompt_tokens)
        self._written[key] = self._shared.now
        self._publish(_REMEMBER, key, replica, prompt_tokens)

    def take(self, at: float, key: int, replica: str, prompt_tokens: int) -> None:
        if at >= self._written.get(key, at):
            super().remember(key, replica, prompt_tokens)
            self._written[key] = at


def routed_by(ticket: Ticket) -> Router:
    """The router that routed ``ticket`` (the ticket knows it only as ticket.py's ``Holder``)."""
    router = ticket.router
    assert isinstance(router, Router)
    return router
