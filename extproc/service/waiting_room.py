"""Flow control in the service: a request that finds no replica with room waits here, its
ext_proc stream simply not answered, until flow control (extproc/routing/flow_control.py)
dispatches it.

One request, on either data plane (our own Envoy's route stream, an Endpoint Picker's stream):

- read and prepared as ever (Gateway.prepare, the store's picture, the turns it shows answered
  released: Gateway.before_route); its flow from the tenant and objective headers;
- nothing waits and a replica has room: routed at once, the gateway's answer as without flow
  control (``at_once`` in its trace);
- else it waits. Behind our own Envoy the service first asks Envoy to wait that long for the
  answer (ext_proc's override_message_timeout, allowed up to the rendered max_message_timeout:
  the TTL and a margin); a gateway keeps its own message timeout, which the TTL must stay below
  (docs/flow-control.md). While it waits, the stream is read: Envoy half-closes it when the
  client goes away, and the request leaves the queue with nothing charged (``cancelled``);
- dispatched when room frees: on the release of a request's load (Gateway's lifecycle hooks:
  the access log entry, the stream's end, a next turn showing its answer), a change of the
  fleet, or another arrival. Its Pending is made at that moment (Gateway.routed), so a client
  that leaves just then is finished as abandoned, and nothing leaks;
- a request waiting for its full cache holder (flow_control.py, patience) is looked at again
  when its patience ends;
- ``ttl_seconds`` without room: 429 with ``x-llm-ring-dropped-reason: ttl-expired`` (503,
  ``no-replica``, when no replica it may go to is left); a full band: 429 ``queue-full``.

Its wait goes into the decision trace and the route_decision line (``queue_wait_ms``, the trace's
``queue``), and into ``x-route-queue-wait-ms`` with the routing headers (the experiments' records).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from extproc.envoy.contract import DROPPED_REASON, QUEUE_WAIT_MARGIN_S
from extproc.routing.flow_control import NO_REPLICA, Dispatched, FlowControl, Refused, Routed, Wait
from extproc.routing.flows import Flow, FlowSettings, flow_of
from extproc.routing.peers import PeerView
from extproc.routing.queue import Waiting
from extproc.service.answers import AnswerShape, immediate, immediate_headers, wait_longer
from extproc.service.bodies import BadRequest, ParsedRequest
from extproc.service.bounds import BOUNDED_CHARS, bounded
from extproc.service.flow_metrics import FlowMetrics
from extproc.service.gateway import Gateway
from extproc.service.lifecycle import Lifecycle
from extproc.service.reading import Prepared

LEFT = b""  # route()'s answer when the client went away while its request waited: nothing to say
FLOWS_KEPT = 1024  # flows remembered by their header values (all forgotten when full)


@dataclass(slots=True)
class _Waiter:
    """A request waiting, with what its answer needs once it is dispatched."""

    step: Prepared
    flow: Flow
    turn: str
    request_id: str  # the id the data plane gave it
    started: float  # perf_counter when it arrived
    shape: AnswerShape  # its data plane's
    subset: frozenset[str] | None
    answer: asyncio.Future[tuple[bytes, str | None]]


class WaitingRoom(Lifecycle):
    def __init__(self, gateway: Gateway, settings: FlowSettings) -> None:
        self.gateway = gateway
        self.settings = settings
        self.control = FlowControl(gateway.router, settings)
        self.metrics = FlowMetrics(gateway.metrics.registry, self.control.queue.depths, time.monotonic)
        self.headers = (settings.tenant_header, settings.objective_header)
        self._waiters: dict[str, _Waiter] = {}
        self._flows: dict[tuple[str, str], Flow] = {}  # (tenant, objective) header values -> their flow
        self._timer: asyncio.TimerHandle | None = None
        self._dispatch_planned = False
        gateway.lifecycle = self

    def waiting(self) -> int:
        """Requests waiting now."""
        return len(self._waiters)

    async def route(
        self, stream: HeldReads, *, shape: AnswerShape, path: str, content_type: str,
        session_headers: Mapping[str, str], turn: str, request_id: str, body: bytes, tenant: str = "",
        objective: str = "", parsed_elsewhere: ParsedRequest | BadRequest | None = None,
        subset: frozenset[str] | None = None,
    ) -> tuple[bytes, str | None]:
        """Gateway.route_request (route_shared with a store) through flow control: the answer and
        our id of the routed request, as there; LEFT when the client went away while it waited.
        stream: the request's ext_proc stream, read while the request waits."""
        started = time.perf_counter()
        gateway = self.gateway
        step = gateway.reader.prepare(path, content_type, session_headers, body, parsed_elsewhere)
        if isinstance(step, bytes):
            return step, None
        peers: PeerView | None = None
        if gateway.store is not None:
            step, peers = await gateway.reader.peers(step, gateway.store)
        step, avoid = gateway.before_route(step, subset, peers)
        flow = self._flow(tenant, objective)
        now = time.monotonic()
        admitted = self.control.admit(step.request, flow, avoid, now, peers)
        if isinstance(admitted, Routed):  # nothing waits, a replica has room: the path without flow control
            self._went(flow, admitted.wait, admitted.ticket.decision.predicted_cached_tokens, step, now)
            answer = gateway.routed(step, admitted.ticket, turn, request_id, started, shape, subset, admitted.wait)
            return answer, step.request.request_id
        if isinstance(admitted, Refused):
            return self._refused(flow, admitted.reason, subset), None
        future: asyncio.Future[tuple[bytes, str | None]] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(step, flow, turn, request_id, started, shape, subset, future)
        self._waiters[step.request.request_id] = waiter
        self.metrics.fairness.waited(now, flow.tenant)
        self.dispatch()  # it may go at once: a turn it showed answered freed a slot
        if not waiter.answer.done() and shape.waits_announced:
            await stream.write(wait_longer(math.ceil(self.settings.ttl_seconds) + QUEUE_WAIT_MARGIN_S))
        return await self._wait(step.request.request_id, waiter, stream)

    def _flow(self, tenant: str, objective: str) -> Flow:
        """The flow of a request carrying these header values, kept for the next request that
        carries them (FLOWS_KEPT at most, of values of at most BOUNDED_CHARS: a client inventing
        tenants or long values grows nothing)."""
        flow = self._flows.get((tenant, objective))
        if flow is None:
            flow = flow_of(self.settings, bounded(tenant), bounded(objective))
            if len(tenant) <= BOUNDED_CHARS and len(objective) <= BOUNDED_CHARS:
                if len(self._flows) >= FLOWS_KEPT:
                    self._flows.clear()
                self._flows[tenant, objective] = flow
        return flow

    async def _wait(self, request_id: str, waiter: _Waiter, stream: HeldReads) -> tuple[bytes, str | None]:
        """The answer once dispatched or expired; LEFT when the stream ended first (the client left)."""
        watcher = stream.watch()
        try:
            await asyncio.wait((waiter.answer, watcher), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this task was cancelled: the stream was reset
            stream.drop()
            self._left(request_id, waiter)
            raise
        if not watcher.done():  # the read stays under way: the stream's next read returns its message
            return waiter.answer.result()
        stream.drop()
        self._left(request_id, waiter)
        return LEFT, None

    def _left(self, request_id: str, waiter: _Waiter) -> None:
        """The client went away: out of the queue with nothing charged, or, dispatched that very
        moment, finished as abandoned (its load released)."""
        if self.control.cancel(request_id):
            del self._waiters[request_id]
            self.metrics.outcome(waiter.flow, "cancelled")
            self._arm_timer()
        elif waiter.answer.done() and waiter.answer.result()[1] is not None:
            self.gateway.requests.stream_ended(request_id)

    def dispatch(self) -> None:
        """Send what may go now (flow_control.py's order), and answer it."""
        self._dispatch_planned = False
        now = time.monotonic()
        for sent in self.control.dispatch(now):
            self._answer(sent, now)
        self._arm_timer()

    def _answer(self, sent: Dispatched, now: float) -> None:
        request_id = sent.waiting.request.request_id
        waiter = self._waiters.pop(request_id)
        flow = sent.waiting.flow
        if sent.ticket is None:
            waiter.answer.set_result((self._refused(flow, NO_REPLICA, waiter.subset), None))
            return
        self.metrics.left_queue(flow, sent.wait.waited)
        self._went(flow, sent.wait, sent.ticket.decision.predicted_cached_tokens, waiter.step, now)
        answer = self.gateway.routed(waiter.step, sent.ticket, waiter.turn, waiter.request_id, waiter.started,
                                     waiter.shape, waiter.subset, sent.wait)
        waiter.answer.set_result((answer, request_id))

    def _went(self, flow: Flow, wait: Wait, predicted_cached: int, step: Prepared, now: float) -> None:
        self.metrics.outcome(flow, wait.kind)
        self.metrics.fairness.served(now, flow.tenant, self.control.work(step.request, predicted_cached))

    def _timer_fired(self) -> None:
        """A deadline came (429 for the expired), or a request stopped waiting for its holder."""
        self._timer = None
        for waiting in self.control.expire(time.monotonic()):
            waiter = self._waiters.pop(waiting.request.request_id)
            waiter.answer.set_result((self._expired(waiting, waiter.subset), None))
        self.dispatch()

    def _expired(self, waiting: Waiting, subset: frozenset[str] | None) -> bytes:
        if not any(name not in waiting.avoid for name in self.gateway.router.replicas):
            return self._refused(waiting.flow, NO_REPLICA, subset)
        self.metrics.outcome(waiting.flow, "expired")
        ttl = self.settings.ttl_seconds
        return immediate(429, f"no replica had room for {ttl:g} s (flow.ttl_seconds): try again later",
                         "rate_limit_exceeded", headers=[(DROPPED_REASON, "ttl-expired")])

    def _refused(self, flow: Flow, reason: str, subset: frozenset[str] | None) -> bytes:
        self.metrics.outcome(flow, reason)
        if reason == NO_REPLICA:
            return self.gateway.local.no_replica(subset) + immediate_headers([(DROPPED_REASON, "no-replica")])
        return immediate(429, f"{self.settings.band_size} requests already wait in band {flow.priority} "
                         f"(flow.band_size): try again later", "rate_limit_exceeded",
                         headers=[(DROPPED_REASON, "queue-full")])

    def _arm_timer(self) -> None:
        """A timer for the oldest waiting request's deadline, or sooner for the first request that
        stops waiting for its holder (none while nothing waits)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = self.control.queue.next_deadline()
        if deadline is not None:
            wake = self.control.wake
            at = deadline if wake is None else min(deadline, wake)
            self._timer = asyncio.get_running_loop().call_later(max(0.0, at - time.monotonic()), self._timer_fired)

    def _plan_dispatch(self) -> None:
        """Dispatch once the event loop's current turn is over: a next turn that released its
        last answer's slot is queued first, then considered with the others."""
        if self._waiters and not self._dispatch_planned:
            self._dispatch_planned = True
            asyncio.get_running_loop().call_soon(self.dispatch)

    # Gateway's lifecycle hooks (gateway.Lifecycle)

    def released(self, request_id: str) -> None:
        self.control.released(request_id)
        self._plan_dispatch()

    def finished(self, request_id: str, computed: tuple[int, int] | None) -> None:
        self.control.released(request_id)
        self.control.settle(request_id, computed)
        self._plan_dispatch()

    def replicas_changed(self) -> None:
        self._plan_dispatch()


class HeldReads:
    """An ext_proc stream (grpc.aio's context) whose read started while a request waited is kept
    for the stream's next read. Cancelling a grpc.aio read under way may lose the message it was
    receiving (the picker's stream then answers the wrong phase), so it is never cancelled while
    the stream goes on."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self._pending: asyncio.Future[Any] | None = None

    def watch(self) -> asyncio.Future[Any]:
        """The next message, read from now on."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self.context.read())
        return self._pending

    async def read(self) -> Any:
        pending, self._pending = self._pending, None
        return await pending if pending is not None else await self.context.read()

    async def write(self, message: bytes) -> None:
        await self.context.write(message)

    def drop(self) -> None:
        """The stream is over: the read under way cancelled, or its outcome (EOF, an error) taken."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if not pending.done():
            pending.cancel()
        elif not pending.cancelled():
            pending.exception()
