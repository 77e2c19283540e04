"""Flow control in the simulated gateway: the core's own ``FlowControl`` (extproc/routing/
flow_control.py), driven as the service's waiting room drives it (extproc/service/waiting_room.py).

- a request arrives: ``admit`` (its flow from its tenant and objective, as the headers give
  them); routed at once, or it waits, or it is refused (429 queue-full, 503 no-replica);
- a request's load is released (its answer ended, or its conversation's next turn carried the
  answer): ``released``, and a dispatch once the moment's other events are done (a next turn
  that freed its own slot is queued first, as the service plans its dispatch);
- an answer reports its tokens: ``settle``; a request refused by its replica (too long) settles
  its charge as it stands;
- the oldest waiting request's deadline, or the end of a request's patience (``wake``): expire
  (429 ttl-expired) and dispatch.

A dispatched request keeps its ``Wait`` (the service puts it in the decision trace as
``queue``). Room is a replica's slots as the router knows them (``Router.facts``): the caller makes
it the simulated replicas' room (flow_runs.replica_room).
"""

from __future__ import annotations

from typing import NamedTuple

from extproc.routing import Router, Ticket
from extproc.routing.flow_control import QUEUE_FULL, FlowControl, Queued, Refused
from extproc.routing.flows import FlowSettings, flow_of
from extproc.routing.speeds import AnswerTimings
from extproc.sim.driven import Simulation
from extproc.sim.request import Request
from extproc.sim.routers import RouterTier


class FlowSpec(NamedTuple):
    settings: FlowSettings
    order: str  # extproc/routing/orders: vtc-local, vtc, fifo, round-robin, las
    patience: bool  # a request whose cache holder is full waits for it a while
    patience_scale: float = 1.0  # that while, in times its recompute (FlowControl)
    turn_waits: bool = False  # its flow's turn waits for its holder too (FairQueue)


class SimFlow:
    def __init__(self, sim: Simulation, spec: FlowSpec) -> None:
        self.sim = sim
        self.settings = spec.settings
        self.control = FlowControl(_one_router(sim.router), spec.settings, spec.order, spec.patience,
                                   spec.patience_scale, spec.turn_waits)
        self.waiting: dict[str, Request] = {}
        self.dispatch_planned = False
        self.timer_at = float("inf")
        release, release_answered, report = sim.release, sim.release_answered, sim.report

        def released(ticket: Ticket, ok: bool) -> None:
            release(ticket, ok)
            self._freed(ticket.request.request_id)

        def released_by_next_turn(conversation: str, shown: frozenset[int]) -> list[str]:
            freed = release_answered(conversation, shown)
            for request_id in freed:
                self._freed(request_id)
            return freed

        def reported(ticket: Ticket, replica: str, predicted: int, cached: int, timings: AnswerTimings) -> None:
            report(ticket, replica, predicted, cached, timings)
            self.control.settle(ticket.request.request_id, (timings.prompt_n, timings.predicted_n), sim.now)

        sim.release, sim.release_answered, sim.report = released, released_by_next_turn, reported

    def admit(self, request: Request, now: float) -> None:
        flow = flow_of(self.settings, request.tenant, request.objective)
        admitted = self.control.admit(request.route, flow, (), now)
        if isinstance(admitted, Refused):
            self._refuse(request, 429 if admitted.reason == QUEUE_FULL else 503, admitted.reason, now)
        elif isinstance(admitted, Queued):
            self.waiting[request.request_id] = request
            self._plan_dispatch(now)
        else:
            request.wait = admitted.wait
            self.sim.routed(request, admitted.ticket, now)

    def dispatch(self, now: float) -> None:
        """Expire what waited too long, then send what may go now (flow_control.py's order)."""
        self.dispatch_planned = False
        for waiting in self.control.expire(now):
            self._refuse(self.waiting.pop(waiting.request.request_id), 429, "ttl-expired", now)
        for sent in self.control.dispatch(now):
            request = self.waiting.pop(sent.waiting.request.request_id)
            if sent.ticket is None:
                self._refuse(request, 503, "no_replica", now)
            else:
                request.wait = sent.wait
                self.sim.routed(request, sent.ticket, now)
        self._arm_timer(now)

    def _freed(self, request_id: str) -> None:
        self.control.released(request_id)
        self.control.settle(request_id, None, self.sim.now)  # a no-op once its answer settled it
        self._plan_dispatch(self.sim.now)

    def _plan_dispatch(self, now: float) -> None:
        if self.waiting and not self.dispatch_planned:
            self.dispatch_planned = True
            self.sim.push_hook(now, lambda _, at: self.dispatch(at))

    def _arm_timer(self, now: float) -> None:
        """A dispatch at the oldest waiting request's deadline, or sooner when a request stops
        waiting for its holder; an earlier one already planned stands."""
        deadline = self.control.queue.next_deadline()
        if deadline is None:
            return
        wake = self.control.wake
        at = deadline if wake is None else min(deadline, wake)
        if now < self.timer_at <= at:
            return
        self.timer_at = at
        self.sim.push_hook(at, self._timer_fired)

    def _timer_fired(self, _: object, now: float) -> None:
        if now >= self.timer_at:
            self.timer_at = float("inf")
        self.dispatch(now)

    def _refuse(self, request: Request, status: int, reason: str, now: float) -> None:
        """Answered without a replica (the service's 429 or 503)."""
        request.status, request.error = status, reason
        request.started_at = request.first_token_at = request.finished_at = now
        self.sim.done(request, now)


def _one_router(tier: RouterTier) -> Router:
    """Flow control sits in one router: the queue is that router's."""
    routers = tier.distinct()
    if len(routers) != 1:
        raise ValueError(f"flow control: simulated with one gateway router only (got {len(routers)})")
    return routers[0]
