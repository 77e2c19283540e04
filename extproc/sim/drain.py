"""A leaving replica's drain window in the simulator, in the order of extproc/routing/leaving.py.

From the moment the replica starts leaving it takes no new conversation but stays in the
router's list: every request is routed through ``DrainWindow.route``, which asks the order
where it may go (a conversation not yet moved: the leaving replica is still a choice, its
policy counting the recompute elsewhere; moved: its receiver only; near the deadline or
unmovable: anywhere else). What the order says to move is planned by the live planner
(extproc/migration/planner.py) with the cost model's KV bytes a token and prefill time against
``transfer_bytes_per_second``; a move lands after its transfer time (the moves of one replica
one after another): a slot file restored into the receiver's least recently used idle slot
(its old content saved to the host cache, as llama.cpp does when a slot is reused), or blocks
added to the receiver's pool as cached, evictable blocks; then every router is told
(``Router.migrated``), so the conversation's next decision says ``+migrated``. The replica goes
down once nothing of it runs and nothing is left to move; at the deadline what is unmoved is
counted and nothing moves any more, and what runs there finishes (as without migration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from extproc.migration.planner import Candidate, Costs, plan
from extproc.routing.decision import RouteRequest
from extproc.routing.hashing import stable_hash
from extproc.routing.leaving import Leaving, State
from extproc.routing.ring import HashRing
from extproc.routing.ticket import Ticket
from extproc.sim.costmodel import CostModel
from extproc.sim.engine import HOOK, _Simulation
from extproc.sim.paged import PagedReplica
from extproc.sim.replica import Replica
from extproc.sim.request import Request


@dataclass(frozen=True)
class DrainSettings:
    transfer_bytes_per_second: float
    min_tokens: int
    drain_s: float  # the bound on one replica's drain and moves (the stack's migration.drain_seconds)
    near_s: float  # this long before that bound, unmoved follow-ups no longer go to the leaving replica


@dataclass
class MoveCounts:
    moved: int = 0
    moved_bytes: int = 0
    candidates: int = 0


class DrainWindow:
    def __init__(self, sim: _Simulation, name: str, staying: list[str], now: float, settings: DrainSettings,
                 cost: CostModel, counts: MoveCounts) -> None:
        self.sim, self.name, self.staying, self.settings, self.cost, self.counts = \
            sim, name, staying, settings, cost, counts
        self.replica = sim.replicas[name]
        self.routers = sim.router.distinct()
        self.seed = self.routers[0].settings.hash_seed
        running = self._running()
        last = {r.conversation: r.replica for r in sim.outcome.requests if r.status == 200}
        held = {self._key(conversation) for conversation, replica in last.items() if replica == name}
        self.order = Leaving.begin(name, now, settings.drain_s, settings.near_s, held - running, running)
        self.plain_route = sim.route
        sim.route = self.route
        self.move(now)

    def _key(self, conversation: str) -> int:
        return stable_hash(conversation, self.seed)

    def _running(self) -> set[int]:
        replica = self.replica
        return {self._key(r.conversation) for r in (*replica.prefilling, *replica.decoding, *replica.queue)}

    def route(self, request: RouteRequest) -> Ticket | None:
        """The engine's routing during the window: where the order lets the request go."""
        now, key = self.sim.now, request.key
        where = self.order.route(key, now)
        ticket = None
        if where.only is not None and where.only in self.sim.replicas:  # the warm copy, no third replica
            ticket = self.sim.router.route(request, [n for n in self.sim.replicas if n != where.only])
        if ticket is None:
            ticket = self.sim.router.route(request, where.avoid)
        if ticket is not None:
            self.order.sent(key, ticket.decision.replica, now)
        return ticket

    def poll(self, now: float) -> bool:
        """Ended requests noted, what they leave moved; whether the replica is now down."""
        running = self._running()
        for key, state in list(self.order.states.items()):
            if state is State.IN_FLIGHT and key not in running:
                self.order.ended(key)
        if now >= self.order.deadline_s:
            self.order.expire(now)
        else:
            self.move(now)
        if running or self.order.busy():  # past the deadline nothing moves: what runs finishes, as without
            return False
        self.order.went_down(now)
        self.sim.route = self.plain_route
        return True

    def move(self, now: float) -> None:
        keys = self.order.to_move()
        if not keys:
            return
        held = {self._key(r.conversation): (r, tokens) for r, tokens in _held(self.replica, self.sim.outcome.requests)}
        candidates = [Candidate(k, 0, held[k][1], held[k][0].order) for k in keys if k in held]
        self.counts.candidates += len(candidates)
        staying = [n for n in self.staying if n in self.sim.replicas and not self.sim.replicas[n].draining]
        free = {n: _free_slots(self.sim.replicas[n]) for n in staying}
        costs = Costs(self.cost.kv_bytes_per_token, self.cost.prefill_s(1000, 0) / 1000,
                      self.settings.transfer_bytes_per_second)
        routing = self.routers[0].settings
        ring = HashRing(staying, routing.virtual_nodes, routing.hash_seed)
        moves = plan(candidates, ring, free, costs, self.settings.min_tokens, 2**62)
        planned = {m.conversation_key for m in moves}
        for key in keys:
            if key not in planned:
                self.order.failed(key, now)  # not held in a slot any more, too short, or not worth it
        at = now
        for move in moves:
            at += move.bytes / self.settings.transfer_bytes_per_second
            request, _ = held[move.conversation_key]
            self.sim.push(at, HOOK, _Restore(request, move.receiver, move.conversation_key, move.tokens, move.bytes,
                                             self))


@dataclass
class _Restore:
    request: Request
    receiver: str
    key: int
    tokens: int
    bytes: int
    window: DrainWindow

    def __call__(self, sim: _Simulation, now: float) -> None:
        receiver = sim.replicas.get(self.receiver)
        if receiver is None or receiver.draining or not _restore(receiver, self.request, self.tokens, now):
            self.window.order.failed(self.key, now)  # a miss: the next turn is computed again
            return
        for router in self.window.routers:
            router.migrated(self.key, self.receiver, self.request.prompt_tokens, self.request.route.prefix_blocks)
        self.window.order.moved(self.key, self.receiver, now)
        self.window.counts.moved += 1
        self.window.counts.moved_bytes += self.bytes


def _held(replica: Replica | PagedReplica, finished: list[Request]) -> list[tuple[Request, int]]:
    """The conversations the leaving replica can hand over: (its last request there, tokens held)."""
    latest: dict[Any, Request] = {}
    for request in finished:
        if request.replica == replica.name and request.status == 200:
            latest[request.key] = request
    if isinstance(replica, PagedReplica):
        held = ((request, replica.pooled_prefix_tokens(request)) for request in latest.values())
        return [(request, tokens) for request, tokens in held if tokens]
    idle = {slot.key: slot.tokens for slot in replica.slots if not slot.busy and slot.tokens}
    return [(r, idle[r.key]) for r in latest.values() if r.key in idle]


def _free_slots(replica: Replica | PagedReplica) -> int:
    if isinstance(replica, PagedReplica):
        return 2**31  # the pool decides when the blocks arrive
    return sum(not slot.busy for slot in replica.slots)


def _restore(replica: Replica | PagedReplica, request: Request, tokens: int, now: float) -> bool:
    if isinstance(replica, PagedReplica):
        blocks, _ = replica._blocks(request)
        return replica.pool.add_cached(blocks)
    idle = [slot for slot in replica.slots if not slot.busy]
    if not idle:
        return False
    slot = min(idle, key=lambda s: s.last_used)
    if slot.tokens and replica.cache.capacity_tokens > 0:
        replica.cache.save(slot.key, slot.blocks, slot.tokens)
    slot.key, slot.blocks, slot.tokens, slot.last_used = request.key, request.blocks, tokens, now
    return True
