"""The router: a policy, the ring, the load ledger and placement memory, wired together.

Pure and synchronous: the gRPC service, the simulator and the tests all drive this
same object. One request = ``route``, which charges its load and returns its ``Ticket`` (the
decision and its release), then one release (``Ticket.release``, or ``complete`` by request id),
whatever happened in between; a second does nothing. The router's table of requests in flight,
by request id, holds the tickets and is the only one: the gateway and the simulator keep a
request's ticket next to their own state of it. Its state is given to it: the load ledger and
placement memory (one ledger shared by several routers in the simulator's shared-load model; by
default its own); the policy, with its indexes, comes from the settings. Several routers agreeing
through a store read what each one changed from its ledger's and memory's journals and the
policy's ``view_changes``, and give it the others' (the ledger's elsewhere part, ``learn``-ed
placements, ``apply_view_changes``): nothing of theirs runs inside a route. With several routers, ``route`` may be given
what the others know (peers.py): their load joins the ledger's elsewhere part, and their
placement of the conversation is used when it is later than this router's own.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from mypy_extensions import mypyc_attr

from extproc.routing.decision import Decision, RouteRequest
from extproc.routing.hashing import hash_bytes, stable_hash
from extproc.routing.ledger import LoadLedger
from extproc.routing.peers import PeerView, latest
from extproc.routing.placement import PlacementMemory
from extproc.routing.policies import CacheMoves, CacheReports, Policy, SentView, SharedView, make_policy
from extproc.routing.policies.situation import Situation, new
from extproc.routing.prefix_index import IndexChange
from extproc.routing.replica_facts import ReplicaFacts
from extproc.routing.residency import Residency
from extproc.routing.ring import HashRing
from extproc.routing.settings import RoutingSettings
from extproc.routing.speeds import AnswerTimings, ReplicaSpeeds, Speed
from extproc.routing.ticket import Ticket

_NOTHING: frozenset[str] = frozenset()


# compiled (extproc/compiled.py); tests extend it to watch its calls
@mypyc_attr(allow_interpreted_subclasses=True)
class Router:
    def __init__(self, settings: RoutingSettings, replicas: Iterable[str] = (), ledger: LoadLedger | None = None,
                 memory: PlacementMemory | None = None) -> None:
        self.settings = settings
        self._seed = settings.hash_seed  # read on every route: bound here and by reconfigure
        self.ledger = LoadLedger() if ledger is None else ledger
        self.memory = PlacementMemory(settings.memory_capacity) if memory is None else memory
        self.speeds = _speeds(settings)
        # facts the replicas report, kept across reset() (their models stay loaded)
        self.residency = Residency(settings.prior_model_load_ms / 1000, settings.prior_model_wake_ms / 1000)
        self.policy: Policy = make_policy(settings, settings.replicas)
        self._decide: Callable[[Situation], Decision | None] = self.policy.decide  # bound once, not per route
        self._view = _view_of(self.policy)
        self._learner = _learner_of(self.policy)
        self._mover = _mover_of(self.policy)
        self._sharing = False  # several routers keep the policy's view alike (share_view)
        self._shared = _shared_of(self.policy)
        self._ring = HashRing((), settings.virtual_nodes, settings.hash_seed)
        self._members: frozenset[str] = frozenset()
        self._in_flight: dict[str, Ticket] = {}  # request id -> its ticket, until released
        # conversation key -> the replica its cache was moved to, until the conversation's next route
        self._migrated: dict[int, str] = {}
        # a replica that left -> {key: prompt tokens} of the requests it was serving then: their
        # caches end up there, though placement memory is not told (a migration looks for them)
        self._left_serving: dict[str, dict[int, int]] = {}
        self.set_replicas(replicas)

    @property
    def replicas(self) -> tuple[str, ...]:
        return self._ring.replicas

    @property
    def ring(self) -> HashRing:
        return self._ring

    def facts(self, replica: str) -> ReplicaFacts:
        """What ``replica`` is (its slots, its cache): the fleet's [routing.replicas], which its
        policy is built with, for every replica; where a replica's own facts would be answered."""
        return self.settings.replicas

    def conversation_key(self, conversation: str) -> int:
        """The conversation's ring position, also its key in placement memory (hashed once)."""
        return stable_hash(conversation, self._seed)

    def keyed(self, request: RouteRequest) -> RouteRequest:
        """``request`` carrying its conversation's key: itself when it carries it already."""
        if request.key >= 0:
            return request
        return request._replace(key=self.conversation_key(request.conversation))

    def readdressed(self, request: RouteRequest, conversation: str) -> RouteRequest:
        """``request`` as one of ``conversation``, with that conversation's key."""
        return request._replace(conversation=conversation, key=self.conversation_key(conversation))

    def set_replicas(self, replicas: Iterable[str]) -> None:
        names = tuple(sorted(set(replicas)))
        if names == self._ring.replicas:
            return
        self._ring = HashRing(names, self.settings.virtual_nodes, self.settings.hash_seed)
        self._members = frozenset(names)
        self.ledger.set_replicas(names)
        self.speeds.set_replicas(names)
        self.residency.set_replicas(names)
        if self._view is not None:
            self._view.set_replicas(names)
        gone = [ticket for ticket in self._in_flight.values() if ticket.decision.replica not in names]
        for ticket in gone:  # their load went with the replica; releasing them is a no-op
            del self._in_flight[ticket.request.request_id]
            self._left_serving.setdefault(ticket.decision.replica, {})[ticket.key] = ticket.request.prompt_tokens
        for name in names:  # back in the fleet: a fresh server
            self._left_serving.pop(name, None)

    def route(
        self, request: RouteRequest, avoid: Collection[str] = (), peers: PeerView | None = None
    ) -> Ticket | None:
        """Pick a replica for ``request`` and charge it: its ticket; None when no replica is eligible.
        peers: the other routers' picture for this request (None: this router's state as it is)."""
        request_id = request.request_id
        in_flight = self._in_flight
        if request_id in in_flight:
            raise ValueError(f"request {request_id!r} is already in flight")
        ring = self._ring
        if avoid:
            avoided = frozenset(avoid)
            eligible = tuple(name for name in ring.replicas if name not in avoided)
        else:
            avoided, eligible = _NOTHING, ring.replicas
        key = request.key
        if key < 0:  # built without it: computed here, and the ticket carries it
            key = hash_bytes(request.conversation.encode(), self._seed)
        placement = self.memory.get(key)
        if peers is not None:
            self.ledger.set_elsewhere(peers.elsewhere)
            shared = latest(placement, peers.placement)
            if shared is not placement and shared is not None:  # this router learns it too
                self.memory.learn(key, shared.replica, shared.prompt_tokens)
                placement = shared
        if placement is not None and (placement.replica not in self._members or placement.replica in avoided):
            placement = None  # that cache is gone or unreachable
        decision = self._decide(new(Situation, (request, key, ring, self.ledger, placement, avoided, eligible,
                                                self.speeds, self.residency)))
        if decision is None:
            return None
        if self._migrated:
            moved_to = self._migrated.pop(key, None)
            if moved_to is not None and moved_to == decision.replica:  # the trace says why it is cached there
                decision = decision._replace(reason=f"{decision.reason}+migrated")
        self.ledger.charge(request_id, decision.replica, decision.charged_tokens)
        if self.residency.tracked:
            self.residency.sent(decision.replica, request.model)
        ticket = in_flight[request_id] = new(Ticket, (request, decision, key, self))
        if self._view is not None:
            self._view.routed(request, decision)
        return ticket

    def complete(self, request_id: str, ok: bool = True, served: str | None = None) -> Decision | None:
        """``Ticket.release`` by request id, for a caller that holds only the id: the request's
        decision, None when none is in flight under it (released already, or never routed)."""
        ticket = self._in_flight.pop(request_id, None)
        if ticket is None:
            return None
        self._settle(ticket, ok, served)
        return ticket.decision

    def _release(self, ticket: Ticket, ok: bool, served: str | None) -> bool:
        if not self._holds(ticket):
            return False
        del self._in_flight[ticket.request.request_id]
        self._settle(ticket, ok, served)
        return True

    def _holds(self, ticket: Ticket) -> bool:
        return self._in_flight.get(ticket.request.request_id) is ticket

    def _overtaken(self, ticket: Ticket) -> bool:
        return ticket.key in self._migrated

    def _settle(self, ticket: Ticket, ok: bool, served: str | None) -> None:
        """A ticket just taken out of the table: its load released, its cache placed."""
        request, decision = ticket.request, ticket.decision
        self.ledger.release(request.request_id)
        if self._view is not None:  # answered by another replica: the pick refused it and cached nothing
            self._view.completed(request, decision, ok and served in (None, decision.replica))
        # a migration reported before this release (its answer's stream may end after the slot
        # was moved) holds the later cache: the next turn goes to the receiver, not back here
        if ok and ticket.key not in self._migrated:  # not _overtaken(): a call less per release
            self.memory.remember(ticket.key, served or decision.replica, request.prompt_tokens)

    def report_cached(self, request: RouteRequest, replica: str, predicted: int, cached: int,
                      timings: AnswerTimings | None = None) -> None:
        """``replica`` served ``request`` with ``cached`` prompt tokens from its cache (timings.cache_n)
        where ``predicted`` were expected: a policy that learns from it does; the answer's
        ``timings``, when known, teach the replica's speed. Works after ``complete`` (an answer's
        timings may arrive after a next turn released it)."""
        if replica not in self._members:
            return
        if self._learner is not None:
            self._learner.reported(request, replica, predicted, cached)
        if timings is not None:
            self.speeds.learn(replica, timings)

    def placed_on(self, replica: str) -> list[tuple[int, int]]:
        """(key, prompt tokens) of the conversations whose cache is on ``replica``: last served
        there, or being served there when it left the fleet."""
        found = dict(self.memory.placed_on(replica))
        found.update(self._left_serving.get(replica, {}))
        return list(found.items())

    def migrated(self, conversation_key: int, replica: str, prompt_tokens: int,
                 blocks: tuple[int, ...] = ()) -> bool:
        """The conversation's cache was moved to ``replica`` (extproc/migration): its next turn goes
        there as if it had been served there, and its decision says so (a request routed before
        and released after the move does not place it back: ``Ticket.overtaken``); a policy with
        a view of the caches (the prefix index) learns that ``replica`` holds its last prompt's
        ``blocks`` and its last replica no longer does. False for an unknown replica."""
        if replica not in self._members:
            return False
        if self._mover is not None and blocks:
            source = self.memory.get(conversation_key)
            self._mover.moved(blocks, prompt_tokens, None if source is None else source.replica, replica)
        self.memory.remember(conversation_key, replica, prompt_tokens)
        if len(self._migrated) >= self.settings.memory_capacity:  # bounded like placement memory
            del self._migrated[next(iter(self._migrated))]
        self._migrated[conversation_key] = replica
        return True

    def share_view(self) -> None:
        """Several routers keep the policy's view of the caches alike (a store): from now on, this
        policy's and the next's, its changes are kept for ``view_changes``."""
        self._sharing = True
        if self._shared is not None:
            self._shared.share_changes(True)

    def view_changes(self) -> list[IndexChange]:
        """This router's changes to its policy's view since the last call, oldest first: for the
        other routers (empty unless ``share_view``)."""
        return self._shared.changes() if self._shared is not None else []

    def apply_view_changes(self, changes: Iterable[IndexChange]) -> None:
        """Another router's changes to the view, in its order; those naming a replica this router
        does not route to are left out (its fleet is what its own discovery says)."""
        if self._shared is not None:
            members = self._members
            self._shared.apply_changes([change for change in changes if change.replica in members])

    def reconfigure(self, settings: RoutingSettings) -> None:
        """Switch policy or knobs at run time; in-flight load is kept."""
        old, self.settings, self._seed = self.settings, settings, settings.hash_seed
        self._set_policy(make_policy(settings, settings.replicas))
        if (old.virtual_nodes, old.hash_seed) != (settings.virtual_nodes, settings.hash_seed):
            self._ring = HashRing(self._ring.replicas, settings.virtual_nodes, settings.hash_seed)
        # memory is keyed by the ring hash: a new seed re-places every conversation anyway
        if (old.memory_capacity, old.hash_seed) != (settings.memory_capacity, settings.hash_seed):
            self.memory.reset(settings.memory_capacity)
        if _prior(old) != _prior(settings):  # the learnt speeds are kept unless the prior changed
            self.speeds = _speeds(settings)
            self.speeds.set_replicas(self._ring.replicas)
        else:
            self.speeds.learning, self.speeds.ewma_weight = settings.speed_learning, settings.speed_ewma_weight

    def reset(self) -> None:
        """Forget in-flight load (its tickets release nothing), placement memory and policy state
        (between experiment runs)."""
        self.ledger.clear()
        self.memory.clear()
        self._in_flight.clear()
        self.speeds = _speeds(self.settings)
        self.speeds.set_replicas(self._ring.replicas)
        self._migrated.clear()
        self._left_serving.clear()
        self._set_policy(make_policy(self.settings, self.settings.replicas))

    def in_flight(self) -> int:
        return len(self._in_flight)

    def _set_policy(self, policy: Policy) -> None:
        """A new policy starts with an empty view of the current fleet (in-flight requests
        it did not route are unknown to it; completing them tells it nothing)."""
        self.policy, self._decide = policy, policy.decide
        self._view, self._learner = _view_of(policy), _learner_of(policy)
        self._mover = _mover_of(policy)
        self._shared = _shared_of(policy)
        if self._shared is not None and self._sharing:
            self._shared.share_changes(True)
        if self._view is not None:
            self._view.set_replicas(self._ring.replicas)


def _prior(settings: RoutingSettings) -> Speed:
    """What every replica's speed starts from."""
    return Speed(1 / settings.prior_prefill_tokens_per_s, 1 / settings.prior_decode_tokens_per_s,
                 settings.prior_request_overhead_ms / 1000)


def _speeds(settings: RoutingSettings) -> ReplicaSpeeds:
    return ReplicaSpeeds(_prior(settings), settings.speed_ewma_weight, settings.speed_learning)


def _hooks(policy: Policy) -> object:
    """Where the policy's view of the caches is fed: the part it composes as ``view``, else itself."""
    view = getattr(policy, "view", None)
    return policy if view is None else view


def _view_of(policy: Policy) -> SentView | None:
    hooks = _hooks(policy)
    return hooks if isinstance(hooks, SentView) else None


def _learner_of(policy: Policy) -> CacheReports | None:
    hooks = _hooks(policy)
    return hooks if isinstance(hooks, CacheReports) else None


def _mover_of(policy: Policy) -> CacheMoves | None:
    hooks = _hooks(policy)
    return hooks if isinstance(hooks, CacheMoves) else None


def _shared_of(policy: Policy) -> SharedView | None:
    hooks = _hooks(policy)
    return hooks if isinstance(hooks, SharedView) else None
