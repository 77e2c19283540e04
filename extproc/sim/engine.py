"""The discrete-event loop: requests arrive, the real Router picks, replicas serve.

The routers are the service's own ``extproc.routing.Router``, driven through routers.py's
``RouterTier`` (a single router: a tier of one): ``route()`` when a request arrives (its ticket
is kept on the request), its release when its answer is done, ``set_replicas()`` at scale events.
The loop keeps a heap of (time, sequence, kind, payload); ties are broken by the
sequence number, so a run is fully deterministic.

Workloads come in two shapes:
- closed loop (profiles, like the Locust users): ``users`` users start
  ``1/spawn_rate`` s apart; each takes the next conversation, sends a turn (with its
  parallel sides, if any) after its think time, waits for every answer, and so on; no
  new turn starts after ``max_duration_s``;
- open loop (traces): every request arrives at its own ``arrival_s``.

Each answer's simulated timings (cache_n, prompt_n, prompt_ms, predicted_n, predicted_ms) go
back to the router (``report_cached``) as the gateway feeds it the replica's: the router learns
each replica's speed from these alone.

Several closed loops may run side by side (tenants of a noisy-neighbour mix): each has its own
users and conversations. With flow control (extproc/sim/flow.py) a request goes through the
core's FlowControl as in the service: it may wait in the router before its route.

Releases follow the gateway (extproc/service/gateway.py, lifecycle.py), whose conversation
bookkeeping (extproc/routing/conversations.py) each router runs here too (routers.py): a finished
request is released ``release_lag_s`` later (Envoy's access log entry), or earlier when the next
turn of its conversation arrives, whose body shows its answer (each simulated request's history
digest is its own, ``Request.history``; a turn shows its previous turn's) and so releases it
before its own decision.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from heapq import heappush

from extproc.routing import Router, Ticket
from extproc.routing.decision import RouteRequest
from extproc.routing.speeds import AnswerTimings, ReplicaSpeeds, Speed
from extproc.sim.costmodel import CostModel
from extproc.sim.flow import FlowSpec, SimFlow
from extproc.sim.paged import PagedReplica
from extproc.sim.relief import Relief
from extproc.sim.replica import Replica
from extproc.sim.request import Request
from extproc.sim.router_mode import RouterMode, SimRouterMode
from extproc.sim.routers import RouterTier

_WAKE, _SEND, _SCALE, _USER, _RELEASE, _SLOW, _HOOK = 0, 1, 2, 3, 4, 5, 6
# something done to the fleet at a time (extproc/sim/roll.py): called with the simulation and
# the time; it may push further hooks (Simulation.push(at, HOOK, hook))
Hook = Callable[["_Simulation", float], None]
HOOK = _HOOK


@dataclass(frozen=True)
class Fleet:
    replicas: int  # at the start
    slots: int  # llama.cpp --parallel
    cache_tokens: int  # host-RAM prompt cache per replica, in tokens (0 = --cache-ram 0)
    # slots and cache_tokens describe llama.cpp replicas; a paged cost model brings its own pool
    scale: tuple[tuple[float, int], ...] = ()  # (at seconds, replica count) events
    host_cores: float = 0.0  # replicas share this many cores (0 = each replica has its own CPU)
    replica_threads: int = 1  # threads a busy replica wants (llama.cpp --threads)
    release_lag_s: float = 0.0  # from an answer's end to the router's release (the gateway's access log)
    # a mixed fleet: replica llm-i's (cost model, host-RAM cache tokens) is models[i % len(models)]
    # (empty: every replica has the run's one cost model and cache_tokens)
    models: tuple[tuple[CostModel, int], ...] = ()
    slow: tuple[tuple[str, float, float], ...] = ()  # (replica, at seconds, factor): from then that much slower
    relief: Relief | None = None  # hot-spot relief: a turn sent away from its cache takes it along
    router_mode: RouterMode | None = None  # each replica serves several models, some loaded (router_mode.py)

    def names(self, count: int) -> list[str]:
        return [f"llm-{i}" for i in range(count)]


@dataclass
class ClosedLoop:
    conversations: Sequence[Request]  # first turns, in the order users take them (linked by .next)
    users: int
    spawn_rate: float
    max_duration_s: float


# several closed loops side by side (tenants), each its own users
Mixed = tuple[ClosedLoop, ...]


@dataclass
class OpenLoop:
    requests: Sequence[Request]  # each with arrival_s


@dataclass
class Outcome:
    requests: list[Request] = field(default_factory=list)  # in completion order
    end_s: float = 0.0
    events: int = 0
    scale_times: list[tuple[float, int]] = field(default_factory=list)
    # per answer, the router's learnt speed of its replica and the replica's true one:
    # (at s, replica, cost model, learnt Speed, true Speed)
    speeds: list[tuple[float, str, str, Speed, Speed]] = field(default_factory=list)
    loads: dict[str, int] = field(default_factory=dict)  # router mode: model loads per replica


def simulate(
    workload: ClosedLoop | OpenLoop | Mixed, router: Router | RouterTier, cost: CostModel, fleet: Fleet,
    hooks: Sequence[tuple[float, Hook]] = (), flow: FlowSpec | None = None,
) -> Outcome:
    """``flow``: requests go through flow control (None: straight to the router, as without it)."""
    sim = _Simulation(router, cost, fleet)
    if flow is not None:
        sim.flow = SimFlow(sim, flow)
    for at, hook in hooks:
        sim.push(at, _HOOK, hook)
    return sim.run(workload)


class _Simulation:
    def __init__(self, router: Router | RouterTier, cost: CostModel, fleet: Fleet) -> None:
        self.router = tier = router if isinstance(router, RouterTier) else RouterTier.of(router)
        self.cost = cost
        self.fleet = fleet
        self.replicas: dict[str, Replica | PagedReplica] = {}
        self.every_replica: list[Replica | PagedReplica] = []
        self.heap: list[tuple] = []
        self.seq = 0
        self.outcome = Outcome()
        self.record = self.outcome.requests.append
        self.route: Callable[[RouteRequest], Ticket | None] = tier.route  # a drain window wraps it (drain.py)
        self.shared_host = fleet.host_cores > 0
        self.now = 0.0
        tier.clock = lambda: self.now  # a store's lag is measured in simulated time
        self.release: Callable[[Ticket, bool], object] = tier.release
        # (conversation, histories shown answered) -> the requests a next turn released
        self.release_answered: Callable[[str, frozenset[int]], list[str]] = tier.answered
        self.report: Callable[[Ticket, str, int, int, AnswerTimings], None] = tier.report_cached
        self.deadline = float("inf")
        self.flow: SimFlow | None = None
        self.busy = 0  # replicas with at least one running request
        self.host_factor = 1.0
        self.models = SimRouterMode(self, fleet.router_mode) if fleet.router_mode is not None else None
        self._set_fleet(fleet.replicas, 0.0)

    def push(self, at: float, kind: int, payload: object) -> None:
        self.seq += 1
        heappush(self.heap, (at, self.seq, kind, payload))

    def push_hook(self, at: float, hook: Hook) -> None:
        self.push(at, _HOOK, hook)

    def run(self, workload: ClosedLoop | OpenLoop | Mixed) -> Outcome:
        if not isinstance(workload, OpenLoop):
            loops = (workload,) if isinstance(workload, ClosedLoop) else workload
            self.deadline = max(loop.max_duration_s for loop in loops)
            for loop in loops:
                users = iter(loop.conversations)
                for user in range(loop.users):
                    self.push(user / loop.spawn_rate, _USER, users)
        else:
            for request in workload.requests:
                if request.arrival_s is None:
                    raise ValueError(f"open-loop request {request.request_id} has no arrival time")
                self.push(request.arrival_s, _SEND, request)
        for at, count in self.fleet.scale:
            self.push(at, _SCALE, count)
        for name, at, factor in self.fleet.slow:
            self.push(at, _SLOW, (name, factor))
        heap, pop, events = self.heap, heapq.heappop, 0
        now = 0.0
        while heap:
            now, seq, kind, payload = pop(heap)
            self.now = now
            events += 1
            if kind == _WAKE:
                if seq == payload.version:  # else a later reschedule replaced this wake-up
                    self._wake(payload, now)
            elif kind == _SEND:
                self._send(payload, now)
            elif kind == _USER:
                self._next_conversation(payload, now)
            elif kind == _RELEASE:
                self.release(payload.ticket, True)  # a no-op when its next turn released it
            elif kind == _SLOW:
                self._slow_down(payload[0], payload[1], now)
            elif kind == _HOOK:
                payload(self, now)
            else:
                self._set_fleet(payload, now)
        self.router.settle()
        self.outcome.end_s = now
        self.outcome.events = events
        if self.models is not None:
            self.outcome.loads = self.models.loads()
        return self.outcome

    def _next_conversation(self, users: Iterator[Request], now: float) -> None:
        first = next(users, None)
        if first is not None and now + first.think_s <= self.deadline:
            first.users = users
            self.push(now + first.think_s, _SEND, first)

    def _send(self, request: Request, now: float) -> None:
        request.arrived_at = now
        # keyed once, as it arrives (as the gateway keys a request it reads): routed with its key
        request.route = self.router.keyed(request.route)
        previous = request.head.previous
        if previous is not None:  # its body shows the last turn's answer (a side's too)
            self.release_answered(request.route.conversation, frozenset((previous.history,)))
        for side in request.sides:
            self._send(side, now)
        if self.flow is not None:
            self.flow.admit(request, now)  # routed now or later, by flow control
        else:
            self.routed(request, self.route(request.route), now)

    def routed(self, request: Request, ticket: Ticket | None, now: float) -> None:
        """The router's pick for ``request`` (None: no replica at all); it goes there."""
        request.ticket = ticket
        if ticket is None:  # no replica at all: answered at once with 503, like the gateway
            request.status, request.error = 503, "no replica"
            request.started_at = request.first_token_at = request.finished_at = now
            self.done(request, now)
            return
        self.router.sent(ticket, request.history)
        decision = ticket.decision
        request.replica = decision.replica
        request.reason = decision.reason
        request.predicted_cached = decision.predicted_cached_tokens
        replica = self.replicas[decision.replica]
        relief = self.fleet.relief
        if relief is not None:
            wait = relief.move(self.replicas, request, replica)
            if wait:  # it arrives with its cache
                self.push(now + wait, _HOOK, lambda sim, at: sim._arrive(request, replica, at))
                return
        self._arrive(request, replica, now)

    def _arrive(self, request: Request, replica: Replica | PagedReplica, now: float) -> None:
        server = replica.cost.server  # the longest prompt + output it accepts (none: no limit, as the CPU models)
        if server is not None and request.prompt_tokens + request.max_tokens > server.context_tokens:
            self._reject(request, now)
            return
        if self.models is not None:
            assert isinstance(replica, Replica)  # router mode runs llama.cpp slot servers
            self.models.arrive(request, replica, now)  # now, or once its model is loaded
        else:
            self.serve(request, replica, now)

    def serve(self, request: Request, replica: Replica | PagedReplica, now: float) -> None:
        """``request`` reaches the server (router mode: its model loaded): a slot, or the queue."""
        was_idle = not replica.running
        if not replica.arrive(request, now):
            return  # queued: the replica's pending wake-up still holds
        self.seq = seq = self.seq + 1  # _reschedule(replica, now), inlined: once or twice per request
        replica.version = seq
        wait = replica.next_change()
        if wait is not None:
            heappush(self.heap, (now + wait, seq, _WAKE, replica))
        if was_idle and self.shared_host:
            self._share_host(now, +1)

    def _reject(self, request: Request, now: float) -> None:
        """Longer than the server's context: answered at once with 400, like vLLM and llama.cpp."""
        request.status, request.error = 400, "context length exceeded"
        request.started_at = request.first_token_at = request.finished_at = now
        assert request.ticket is not None  # routed, then refused
        self.release(request.ticket, False)
        self.done(request, now)

    def _wake(self, replica: Replica | PagedReplica, now: float) -> None:
        finished = replica.wake(now)
        self.seq = seq = self.seq + 1  # _reschedule(replica, now), inlined
        replica.version = seq
        wait = replica.next_change()
        if wait is not None:
            heappush(self.heap, (now + wait, seq, _WAKE, replica))
        if not finished:
            return
        if not replica.running and self.shared_host:
            self._share_host(now, -1)
        lag = self.fleet.release_lag_s
        release, report = self.release, self.report
        speeds = self.learnt_speeds()
        for request in finished:
            request.status = 200
            ticket = request.ticket
            assert ticket is not None  # served, so routed
            report(ticket, replica.name, request.predicted_cached or 0, request.cache_n, timings_of(request))
            if speeds is not None:
                self.outcome.speeds.append((now, replica.name, replica.cost.name, speeds.speed(replica.name),
                                            true_speed(replica)))
            if lag:
                self.push(now + lag, _RELEASE, request)
            else:
                release(ticket, True)
            self.done(request, now)
            if self.models is not None:
                assert isinstance(replica, Replica)
                self.models.finished(request, replica, now)

    def done(self, request: Request, now: float) -> None:
        self.record(request)
        request = request.head
        if request.waiting:  # a fan-out: the conversation goes on once every answer is in
            request.waiting -= 1
            if request.waiting:
                return
        follow = request.next
        if follow is not None:
            at = now + follow.think_s
            follow.users = request.users
            if at <= self.deadline:
                self.seq = seq = self.seq + 1  # push(at, _SEND, follow), inlined
                heappush(self.heap, (at, seq, _SEND, follow))
        elif request.users is not None:  # closed loop: the user takes the next conversation
            self._next_conversation(request.users, now)

    def _reschedule(self, replica: Replica | PagedReplica, now: float) -> None:
        self.seq = seq = self.seq + 1
        replica.version = seq  # the one wake-up that counts is the one with this sequence number
        wait = replica.next_change()
        if wait is not None:
            heappush(self.heap, (now + wait, seq, _WAKE, replica))

    def learnt_speeds(self) -> ReplicaSpeeds | None:
        """The speeds the (first) router learnt; None without learning."""
        speeds = self.router.routers[0].speeds
        return speeds if speeds.learning else None

    def _slow_down(self, name: str, factor: float, now: float) -> None:
        """``name`` runs ``factor`` times slower from now on (a shared CPU, thermal throttling)."""
        replica = self.replicas.get(name)
        if replica is None:
            return
        replica.advance(now)  # progress so far at the old speed
        replica.prefill_slowdown = tuple(value * factor for value in replica.prefill_slowdown)
        replica.decode_slowdown = tuple(value * factor for value in replica.decode_slowdown)
        self._reschedule(replica, now)

    def _share_host(self, now: float, change: int) -> None:
        """A replica became busy or idle: on a shared host, every busy replica's speed changes.

        Replicas on one machine (the local stack) share its cores: when the busy replicas
        want more threads than there are cores, all of them run that much slower.
        """
        self.busy += change
        factor = max(1.0, self.busy * self.fleet.replica_threads / self.fleet.host_cores)
        if factor == self.host_factor:
            return
        self.host_factor = factor
        for replica in self.every_replica:  # draining ones too: they still use the CPU
            if replica.running:
                replica.advance(now)  # progress so far at the old speed
            replica.host_factor = factor
            if replica.running:
                self._reschedule(replica, now)

    def _set_fleet(self, count: int, now: float) -> None:
        names = self.fleet.names(count)
        for name in names:
            replica = self.replicas.get(name)
            if replica is None or replica.draining:  # a returning replica is a fresh server
                replica = self._new_replica(name)
                replica.host_factor = self.host_factor
                self.replicas[name] = replica
                self.every_replica.append(replica)
                if self.models is not None:
                    self.models.add(name)
        for name, replica in self.replicas.items():
            replica.draining = name not in names
        self.router.set_replicas(names)
        self.outcome.scale_times.append((now, count))

    def _new_replica(self, name: str) -> Replica | PagedReplica:
        cost, cache = self.cost, self.fleet.cache_tokens
        models = self.fleet.models
        if models:
            cost, cache = models[int(name.rpartition("-")[2]) % len(models)]
        if cost.server is not None and cost.server.kv_cache == "paged":
            return PagedReplica(name, cost)
        return Replica(name, cost, self.fleet.slots, cache)


def timings_of(request: Request) -> AnswerTimings:
    """What the replica's answer reports (llama.cpp's ``timings``): prefill from its start on a slot
    (the queue's wait not included) to its first token, then decode to its end."""
    return AnswerTimings(request.prompt_n, (request.first_token_at - request.started_at) * 1000,
                         request.max_tokens, (request.finished_at - request.first_token_at) * 1000, request.cache_n)


def true_speed(replica: Replica | PagedReplica) -> Speed:
    """The replica's speed alone, as its cost model says (the per-token parts at zero context),
    slowed as a ``--slow`` event made it."""
    cost, factor = replica.cost, replica.prefill_slowdown[1]
    return Speed(cost.prefill_per_token_s * factor, cost.decode_per_token_s * replica.decode_slowdown[1],
                 cost.prefill_overhead_s * factor)
