"""A routed request from its pick to its end: the gateway (gateway.py) decides it and hands its
``Pending`` here; the data plane's events end it.

Its events (see dataplanes/ for the streams):
  - Envoy's access log entry, for every request that got a pick (status, the upstream that
    served, reset flags, the timings Envoy copied from a JSON body) -> ``access_logged``:
    the HTTP request is over;
  - a streamed (SSE) answer: the *observe* stream, the response body chunks (the first with
    status and the upstream that served), never answered -> ``observe_*``;
  - behind an Endpoint Picker's gateway, no access log: the picker's stream says when the
    request is over -> ``stream_ended``.
They meet in ``pending`` by request id: the service's own, set as the request's
``x-request-id`` by its answer (a client's id is only logged, bounded). An access log entry
that carries Envoy's id instead (``envoy_ids``) means the answer never landed: Envoy failed
open past ext_proc's timeout and served the request round robin. The request is over, and
logged, in ``_finish``:
when the access log entry has come and, for a streamed answer, the observer has seen its end
(or ``observe_grace`` after the entry). An entry that never comes (the access log stream
broke) is made up for by ``release_lost``: Envoy itself ends a request that shows no activity
for STREAM_IDLE_TIMEOUT_S, so a request silent for twice that long is over.

At its end the request goes back to the gateway (``RequestOwner``): its load released and its
conversation's bookkeeping done (``settle``), a failing pick marked, what its answer taught
learnt (``report_answer``), and one ``route_decision`` line written.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from extproc.envoy.contract import STREAM_IDLE_TIMEOUT_S
from extproc.routing import Decision, RouteRequest, Ticket
from extproc.routing.continuation import Shown
from extproc.routing.flow_control import Wait
from extproc.routing.speeds import AnswerTimings
from extproc.service.answers import RESPONSE_HEADERS_CONTINUE, AnswerCache
from extproc.service.bodies import Timings, parse_timings
from extproc.service.fleet import Fleet
from extproc.service.metrics import Metrics

log = structlog.get_logger("extproc.service")

MAX_JSON_RESPONSE_BYTES = 1 << 20  # larger JSON answers are passed on unread (no timings)
SSE_TAIL_BYTES = 64 << 10  # the last events of a stream are all we read
LOST_AFTER_S = 2 * STREAM_IDLE_TIMEOUT_S  # no access log entry by then: it was lost


class Lifecycle:
    """What flow control hears of the requests it let through (waiting_room.py); this one hears
    nothing (flow control off)."""

    def released(self, request_id: str) -> None:
        """The request's load was released: its slot is free."""

    def finished(self, request_id: str, computed: tuple[int, int] | None) -> None:
        """The request is over; computed: (prompt tokens computed, tokens generated), when reported."""

    def replicas_changed(self) -> None:
        """The fleet changed: room may have appeared."""


@dataclass(slots=True)
class Pending:
    """A routed request from its decision to its end (its load may be released before: by a next
    turn showing its answer): the router's ticket and the service's own state of the request."""

    ticket: Ticket  # the request, the router's decision and the release of its load (once)
    predicted_cached_tokens: int  # the decision's, or what the pick holds of the prompt's opening
    shown: Shown  # its history's digests (continuation.py): who may use its placement once it is done
    continued: bool  # it continued a conversation the router knew
    model: str  # the model it named (bounded), "" when none
    lora: str  # its LoRA adapter configuration (bounded adapters.label), "" when it names none
    endpoint: str
    path: str
    turn: str
    stream: bool
    started: float  # perf_counter at the decision
    last_seen: float  # monotonic: the decision, then each observed chunk
    status: int = 0
    served: str = ""
    logged: bool = False  # no access log entry to wait for: it came (the HTTP request is over), or none
    # will (an Endpoint Picker's stream, whose own end says when the request is over)
    answered: bool = False  # the whole answer passed (per the access log, or the observer saw its end)
    observed_end: bool = False  # streamed: the observer saw the last chunk
    lost: bool = False  # released by release_lost: the access log entry never came
    released_by_next_turn: bool = False  # a later turn of its conversation showed its answer
    not_applied: bool = False  # Envoy served the request without the pick (fail-open)
    envoy_id: str = ""  # the id Envoy gave the request (a client's x-request-id, bounded)
    event_stream: bool = False
    chunks: deque[bytes] = field(default_factory=deque)
    size: int = 0
    timings: Timings | None = None  # from the access log (JSON answers)
    timer: asyncio.TimerHandle | None = None
    wait: Wait | None = None  # how it went through flow control (None: off)
    leaving_phase: str = ""  # a follow-up of a leaving replica's conversation: its phase (service/leaving.py)

    @property
    def request(self) -> RouteRequest:
        return self.ticket.request

    @property
    def decision(self) -> Decision:
        return self.ticket.decision


class RequestOwner(Protocol):
    """What the lifecycle needs of the gateway that routed the requests."""

    @property
    def fleet(self) -> Fleet:
        """The replicas."""

    @property
    def lifecycle(self) -> Lifecycle:
        """Flow control's ears."""

    @property
    def decision_log(self) -> Callable[[dict[str, Any]], None]:
        """Where the route_decision line goes."""

    def settle(self, request_id: str, pending: Pending, ok: bool, served: str | None) -> None:
        """The request is over: out of its conversation's bookkeeping, its load released (once).
        served: the replica that served it when another than the pick."""

    def mark_unhealthy(self, name: str) -> None:
        """The replica failed a request: avoid it until its /health answers."""

    def report_answer(self, pending: Pending, served_replica: str, cached_tokens: int, learnt: AnswerTimings) -> None:
        """What the answer reported (its prompt tokens found cached, its speeds): to be learnt."""


class PendingRequests:
    """The routed requests until their end, by our request id (and Envoy's, ``envoy_ids``)."""

    def __init__(self, owner: RequestOwner, metrics: Metrics, answers: AnswerCache, observe_grace_s: float) -> None:
        """observe_grace_s: how long a streamed answer's end may come after its access log entry."""
        self.owner = owner
        self.metrics = metrics
        self.answers = answers
        self.observe_grace_s = observe_grace_s
        self.pending: dict[str, Pending] = {}
        self.envoy_ids: dict[str, str] = {}  # Envoy's id -> ours, while pending

    def track(self, pending: Pending) -> None:
        """A routed request, pending until it ends. A client may reuse Envoy's id (pending.envoy_id):
        the newest request holds it, an older one ends by its own id (or as lost)."""
        request_id = pending.request.request_id
        self.envoy_ids[pending.envoy_id] = request_id
        self.pending[request_id] = pending

    # ------------------------------------------------------------------ access log

    def access_logged(self, request_id: str, status: int, served: str, cut_off: bool, timings: Timings | None) -> None:
        """Envoy's access log entry for a request: it is over. cut_off: the client went away,
        or the upstream broke off a started answer (a JSON answer ends as abandoned). A streamed
        answer's end and timings are in its last events: wait for the observer's end, at most
        observe_grace, cut off or not (whole when the replica sent ``[DONE]``: _finish)."""
        pending = self.pending.get(request_id)
        if pending is None:
            self._served_without_pick(request_id, status, served)
            return
        pending.logged = True
        pending.status = status
        pending.served = served
        pending.answered = pending.answered or not cut_off
        if not pending.stream:
            pending.timings = timings
            self._finish(request_id)
        elif pending.observed_end:
            self._finish(request_id)
        else:  # a client that hangs up right after [DONE] is cut off too: the observer says whether it was whole
            pending.timer = asyncio.get_running_loop().call_later(self.observe_grace_s, self._finish, request_id)

    def _served_without_pick(self, envoy_id: str, status: int, served: str) -> None:
        """An entry under Envoy's own id: the service decided too late (Envoy failed open) and
        the request went round robin. Release the load; the pick is not to blame for anything."""
        request_id = self.envoy_ids.get(envoy_id)
        if request_id is None:
            return  # not a routed request (a 404/405, a request ext_proc never saw)
        pending = self.pending[request_id]
        pending.logged = pending.not_applied = True
        pending.status, pending.served = status, served
        self._finish(request_id)

    def release_lost(self, now: float) -> int:
        """Release requests silent for LOST_AFTER_S (monotonic ``now``): their access log
        entry was lost, e.g. while the log stream was down. Returns how many."""
        lost = [request_id for request_id, p in self.pending.items() if now - p.last_seen > LOST_AFTER_S]
        for request_id in lost:
            self.pending[request_id].lost = True
            self.metrics.errors["access_log_lost"] += 1
            self._finish(request_id)
        return len(lost)

    # ------------------------------------------------------------------ observe stream

    def observe_start(self, request_id: str, status: int, served: str) -> str | None:
        """The response begins (first body chunk): None when the request is not ours to track."""
        pending = self.pending.get(request_id)
        if pending is None:
            log.debug("response_not_tracked", request_id=request_id, status=status, served=served)
            return None
        pending.status = status
        pending.served = served
        return request_id

    def observe_body(self, request_id: str, chunk: bytes, end_of_stream: bool) -> None:
        pending = self.pending.get(request_id)
        if pending is None:
            return
        pending.last_seen = time.monotonic()
        if chunk:
            if not pending.chunks:  # SSE starts with "data:", "event:" or ":"; JSON with "{"
                pending.event_stream = not chunk.lstrip().startswith(b"{")
            pending.chunks.append(chunk)
            pending.size += len(chunk)
            if pending.event_stream:
                while pending.size - len(pending.chunks[0]) >= SSE_TAIL_BYTES:
                    pending.size -= len(pending.chunks.popleft())
            elif pending.size > MAX_JSON_RESPONSE_BYTES:
                pending.chunks.clear()
        if end_of_stream:
            pending.observed_end = pending.answered = True
            if pending.logged:
                if pending.timer is not None:
                    pending.timer.cancel()
                self._finish(request_id)

    def response_headers_answer(self, request_id: str | None) -> bytes:
        """An Endpoint Picker's answer to the response headers (x-routed-to, x-route-reason
        added for a tracked request)."""
        pending = self.pending.get(request_id) if request_id is not None else None
        if pending is None:
            return RESPONSE_HEADERS_CONTINUE
        return self.answers.response(pending.decision.replica, pending.decision.reason)

    def stream_ended(self, request_id: str) -> None:
        """An Endpoint Picker's stream for the request closed (Envoy ends it with the HTTP
        request): over, as abandoned unless its answer passed whole."""
        if request_id in self.pending:
            self._finish(request_id)

    # ------------------------------------------------------------------ the end

    def _finish(self, request_id: str) -> None:
        """The request is over: back to the gateway, counted, learnt from and logged."""
        pending = self.pending.pop(request_id, None)
        if pending is None:
            return
        if self.envoy_ids.get(pending.envoy_id) == request_id:
            del self.envoy_ids[pending.envoy_id]
        # A stream is whole when the replica sent its end ([DONE], after the timings), whether or
        # not the client stayed to the end of the connection (the SDK closes it right after [DONE]).
        pending.answered = pending.answered or (pending.event_stream and _stream_done(pending.chunks))
        outcome = _outcome(pending)
        served_replica = self._served_replica(pending)  # a name, or the address when it is no replica of ours
        fallback = served_replica if _fell_back(pending) and served_replica in self.owner.fleet.endpoints else None
        # a no-op release when a later turn released it already
        self.owner.settle(request_id, pending, _succeeded(pending), fallback)
        self.metrics.completed[outcome] += 1
        failure = _replica_failure(pending)
        if failure is not None:
            self.metrics.errors[failure] += 1
            self.owner.mark_unhealthy(pending.decision.replica)
        timings = _reported_timings(pending)
        if timings is not None and timings.cache_n is not None:
            self.owner.report_answer(pending, served_replica, timings.cache_n, answer_timings(timings))
            self.metrics.cache_tokens(served_replica, pending.predicted_cached_tokens, timings.cache_n,
                                      timings.cache_n + (timings.prompt_n or 0))
        self._log(request_id, pending, outcome, served_replica, timings)
        computed = None if timings is None or timings.prompt_n is None or timings.predicted_n is None \
            else (int(timings.prompt_n), int(timings.predicted_n))
        self.owner.lifecycle.finished(request_id, computed)

    def _served_replica(self, pending: Pending) -> str:
        if not pending.served or pending.served == pending.endpoint:
            return pending.decision.replica
        for name, endpoint in self.owner.fleet.endpoints.items():
            if endpoint == pending.served:
                return name
        return pending.served

    def _log(
        self, request_id: str, pending: Pending, outcome: str, served_replica: str, timings: Timings | None
    ) -> None:
        decision = pending.decision
        fields: dict[str, Any] = {
            "request_id": request_id,
            "envoy_request_id": pending.envoy_id,
            "conversation": pending.request.conversation,
            "model": pending.model,
            "lora": pending.lora,
            "turn": pending.turn,
            "path": pending.path,
            "stream": pending.stream,
            "replica": decision.replica,
            "endpoint": pending.endpoint,
            "reason": decision.reason,
            "policy": decision.trace.policy,
            "prompt_tokens": pending.request.prompt_tokens,
            "max_tokens": pending.request.max_tokens,
            "cost": decision.cost,
            "charged_tokens": decision.charged_tokens,
            "predicted_cached_tokens": pending.predicted_cached_tokens,
            "trace": decision.trace.as_dict(),
            "outcome": outcome,
            "status": pending.status,
            "served": pending.served,
            "served_replica": served_replica if pending.served else "",
            "duration_ms": round((time.perf_counter() - pending.started) * 1000, 3),
        }
        if pending.lost:
            fields["access_log_lost"] = True
        if pending.released_by_next_turn:
            fields["released_by_next_turn"] = True
        if pending.wait is not None:  # flow control: who it was, how long it waited and why it left then
            fields["queue_wait_ms"] = round(pending.wait.waited * 1000, 3)
            fields["trace"]["queue"] = pending.wait.as_dict()
        if pending.leaving_phase:
            fields["leaving_phase"] = pending.leaving_phase
        if timings is not None:
            fields.update(timings.as_dict())
        self.owner.decision_log(fields)


def _fell_back(pending: Pending) -> bool:
    """Served by another than the pick: Envoy retried a fallback (not a fail-open round robin)."""
    return not pending.not_applied and bool(pending.served) and pending.served != pending.endpoint


def _succeeded(pending: Pending) -> bool:
    return pending.answered and 200 <= pending.status < 300


def _outcome(pending: Pending) -> str:
    """ok: a whole 2xx answer from the pick; failed_over: a whole 2xx answer from a fallback (the
    pick refused; placement memory now points where the cache went); failed: an error status;
    abandoned: the request ended before its answer did (the client hung up, or the upstream
    broke off); not_applied: Envoy served it without the pick."""
    if pending.not_applied:
        return "not_applied"
    if not pending.answered:
        return "abandoned"
    if not _succeeded(pending):
        return "failed"
    return "failed_over" if _fell_back(pending) else "ok"


def _replica_failure(pending: Pending) -> str | None:
    """The error the pick is marked unhealthy for, if any: it refused (a fallback served, or
    502/503 with none), or it went silent."""
    refused = pending.answered and pending.status in (502, 503) and not pending.served
    # 504 from the pick itself: it took the request and sent nothing until Envoy's stream idle
    # timeout (a hung server). Avoided until its /health answers, like a refusing one.
    silent = pending.status == 504 and pending.served == pending.endpoint
    if _fell_back(pending) or ((refused or silent) and not pending.not_applied):
        return "replica_timed_out" if silent else "replica_failed"
    return None


def _reported_timings(pending: Pending) -> Timings | None:
    """The answer's timings: from the access log (JSON), or from the body's end (an SSE tail holds them there)."""
    if pending.chunks and (pending.observed_end or pending.event_stream):
        return parse_timings(b"".join(pending.chunks), pending.event_stream)
    return pending.timings


def _stream_done(chunks: deque[bytes]) -> bool:
    """The tail of an SSE answer holds its last event, ``data: [DONE]``."""
    tail = b"".join(list(chunks)[-2:])[-64:]
    return b"data: [DONE]" in tail


def answer_timings(timings: Timings) -> AnswerTimings:
    """The figures the router learns a replica's speed from; a missing one as -1 (ignored)."""
    def known(value: float | None) -> float:
        return -1.0 if value is None else value

    return AnswerTimings(int(known(timings.prompt_n)), known(timings.prompt_ms), int(known(timings.predicted_n)),
                         known(timings.predicted_ms), int(known(timings.cache_n)))
