"""The gateway's state and per-request logic, between the data planes' streams (dataplanes/)
and the routing core.

A data plane reads a request and hands its body to ``route_request`` (``route_shared`` with a
store), which decides it and answers in the data plane's shape (``AnswerShape``, answers.py). The
request's end is lifecycle.py's room (``PendingRequests``, the gateway's ``requests``): the gateway
hands it each routed request (its ``Pending``) and gets it back at its end (``settle``: load
released, the conversation's bookkeeping done; ``report_answer``: what its answer taught).
The gateway's rooms: the replicas (fleet.py), its own answers (local_answers.py), what each
request means for its conversation (routing/conversations.py) and the shared store (publishing.py).

Back-to-back turns. Envoy sends the access log entry after the answer has gone to the client,
so a client that sends its next turn at once (an agent loop) would be routed while its last
turn still looks in flight and its cache unplaced. The next turn itself proves the last one
answered: its messages are the last turn's messages plus the answer (bodies.py: ``answered``
holds the histories a body shows answered). So before routing a chat request, every pending
request of the same conversation whose history it shows answered is released (load freed,
placement remembered: its ``Ticket.release``) — by construction, whatever the timing, for JSON
and SSE answers alike. Such a request still waits in ``requests.pending`` for its end, which
brings its outcome and timings. Parallel requests on one prefix carry no answer of each other:
each stays charged until its own end.

Several gateways (store.url set, store.py): a request is decided by ``route_shared``, which
first reads the other routers' picture from the store in one round trip (their load, the
conversation's placement, its requests pending on them: peers.py leaves out those this body
shows answered) and then decides as above; the decision, the release and the placement are
queued for the store's writer. Without a store ``route_request`` decides on local state alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from typing import Any

from extproc.envoy.cors import CorsPolicy
from extproc.envoy.surface import GENERATION_PATHS
from extproc.routing import Router, Ticket
from extproc.routing.adapters import InFlight
from extproc.routing.conversations import Conversations
from extproc.routing.flow_control import Wait
from extproc.routing.peers import PeerView
from extproc.routing.speeds import AnswerTimings
from extproc.routing.tokens import TokenCounter
from extproc.service.answers import AnswerCache, AnswerShape, immediate
from extproc.service.bodies import BadRequest, ParsedRequest
from extproc.service.bounds import bounded, bounded_scope
from extproc.service.catalog import ModelCatalog
from extproc.service.decision_log import through_structlog
from extproc.service.fleet import Fleet
from extproc.service.leaving import LeavingReplicas
from extproc.service.lifecycle import Lifecycle, Pending, PendingRequests
from extproc.service.local_answers import LocalAnswers
from extproc.service.metrics import Metrics, ReplicaState
from extproc.service.migrations import Migrations
from extproc.service.publishing import Publishing
from extproc.service.reading import Prepared, RequestReader
from extproc.service.store import SharedStore
from extproc.service.tokenizer import make_counter
from extproc.settings import ServiceSettings


class Gateway:
    def __init__(
        self,
        router: Router,
        settings: ServiceSettings,
        metrics: Metrics,
        on_replica_failed: Callable[[str], None] = lambda name: None,
        counter: TokenCounter | None = None,
        replica_key: str | None = None,
    ) -> None:
        """counter: how prompts are counted (None: the one service.tokenizer names);
        replica_key: the replicas' API key (service.replica_api_key_file's), set on every
        generation routed, never on a request passed through."""
        self.router = router
        self.settings = settings
        self.metrics = metrics
        self.on_replica_failed = on_replica_failed
        self.fleet = Fleet(settings.fallbacks)
        self.answers = AnswerCache(settings.routing_headers, replica_key or "")
        self.requests = PendingRequests(self, metrics, self.answers, settings.observe_grace_ms / 1000)
        self.catalog = ModelCatalog()  # what each replica serves (main.py's ModelFetcher fills it)
        self.cors = CorsPolicy(frozenset(settings.cors_origins))
        self.local = LocalAnswers(self.fleet, self.catalog, self.cors, metrics)
        # what each request means for its conversation: claims, tips, branch points, unanswered requests
        self.conversations = Conversations(router.settings.memory_capacity, router.memory)
        # several routers' shared state (main.py shares it when [store] is set)
        self.publishing = Publishing(router, settings, metrics, self.conversations.waiting,
                                     self.requests.pending.__getitem__)
        self.migrations = Migrations(router.settings.memory_capacity, metrics.registry)
        self.reader = RequestReader(router, settings, counter or make_counter(settings.tokenizer,
                                    settings.chars_per_token), metrics, self.conversations, self.migrations,
                                    self.catalog, self.local)
        self.adapters_in_flight = InFlight()  # the LoRA configurations running on each replica (adapters.py)
        self.decision_log: Callable[[dict[str, Any]], None] = through_structlog  # main.py: DecisionLog
        self.lifecycle = Lifecycle()  # flow control's ears (waiting_room.py sets its own)
        self.leaving = LeavingReplicas(lambda fields: self.decision_log(fields))

    @property
    def store(self) -> SharedStore | None:
        return self.publishing.store

    # ------------------------------------------------------------------ replicas

    def set_replicas(self, replicas: Mapping[str, str]) -> None:
        self.fleet.set(replicas)
        endpoints = self.fleet.endpoints
        self.catalog.set_replicas(endpoints)
        self.conversations.set_replicas(endpoints)
        self.router.set_replicas(endpoints)
        self.leaving.set_replicas(endpoints)
        self.answers.forget_routes()
        if self.store is not None:  # in-flight load on a removed replica went with it
            self.store.load_changed()
        self.lifecycle.replicas_changed()

    def begin_leaving(self, replica: str, seconds: float, near_seconds: float) -> tuple[int, int]:
        """``replica`` starts leaving (extproc/routing/leaving.py); (idle, in flight) conversations placed there."""
        in_flight = {p.ticket.key for p in self.requests.pending.values() if p.decision.replica == replica}
        idle = {k for k, _ in self.router.placed_on(replica)} - in_flight
        self.leaving.begin(replica, idle, in_flight, seconds, near_seconds)
        return len(idle), len(in_flight)

    def mark_unhealthy(self, name: str) -> None:
        if self.fleet.mark_unhealthy(name):
            self.answers.forget_routes()
            self.on_replica_failed(name)

    def mark_healthy(self, name: str) -> None:
        if self.fleet.mark_healthy(name):
            self.answers.forget_routes()

    def replica_states(self) -> list[ReplicaState]:
        """Each replica now: address, health, load in flight (for /metrics and the Admin API)."""
        return self.fleet.states(self.router.ledger, self.router.replicas)

    def _release(self, pending: Pending, ok: bool, served: str | None = None) -> None:
        """Release a request's load (its ticket: once), remember who continues its
        conversation and tell the store."""
        if pending.ticket.release(ok, served):
            self.lifecycle.released(pending.request.request_id)
            request, decision = pending.request, pending.decision
            self.adapters_in_flight.ended(pending.model, pending.lora, decision.replica)
            key = pending.ticket.key
            self.leaving.ended(key, decision.replica)
            if ok:
                chat = GENERATION_PATHS.get(pending.path) == "chat"
                chat_scope = bounded_scope(pending.model, pending.lora) if chat else None
                self.conversations.completed(key, pending.shown, served or decision.replica, request.prompt_tokens,
                                             chat_scope)
            self.publishing.completed(pending, key, ok, served)

    # ------------------------------------------------------------------ a request's body

    def route_request(
        self, *, shape: AnswerShape, path: str, content_type: str, session_headers: Mapping[str, str], turn: str,
        request_id: str, body: bytes, parsed_elsewhere: ParsedRequest | BadRequest | None = None,
        subset: frozenset[str] | None = None,
    ) -> tuple[bytes, str | None]:
        """(the serialized ProcessingResponse answering the request, our id of the routed request):
        the pick in the data plane's ``shape``, or an immediate error answer that Envoy sends the
        client itself (id None). session_headers: the request's headers of service.session_ids
        (name -> value). parsed_elsewhere: the body's parse_request result (or refusal) from
        offload.py. subset: the endpoints a gateway allows (None: all). Decided on this router's
        own state: the service without a store (route_shared with one)."""
        started = time.perf_counter()
        step = self.reader.prepare(path, content_type, session_headers, body, parsed_elsewhere)
        if isinstance(step, bytes):
            return step, None
        return self._decide(step, turn, request_id, started, None, shape, subset)

    async def route_shared(
        self, *, shape: AnswerShape, path: str, content_type: str, session_headers: Mapping[str, str], turn: str,
        request_id: str, body: bytes, parsed_elsewhere: ParsedRequest | BadRequest | None = None,
        subset: frozenset[str] | None = None,
    ) -> tuple[bytes, str | None]:
        """route_request with the other routers' picture, read from the store in one round trip
        (at most store.timeout_ms; then this router's own state)."""
        started = time.perf_counter()
        step = self.reader.prepare(path, content_type, session_headers, body, parsed_elsewhere)
        if isinstance(step, bytes):
            return step, None
        assert self.store is not None
        step, peers = await self.reader.peers(step, self.store)
        return self._decide(step, turn, request_id, started, peers, shape, subset)

    def _decide(
        self, step: Prepared, turn: str, request_id: str, started: float, peers: PeerView | None,
        shape: AnswerShape, subset: frozenset[str] | None,
    ) -> tuple[bytes, str | None]:
        step, avoid = self.before_route(step, subset, peers)
        limit, endpoints, ledger = self.settings.shed_requests_per_replica, self.fleet.endpoints, self.router.ledger
        if limit and all(ledger.requests(name) >= limit for name in endpoints if name not in avoid):
            self.metrics.errors["shed"] += 1
            return immediate(429, "every replica is at service.shed_requests_per_replica requests in flight",
                             "rate_limit_exceeded"), None
        ticket = self.router.route(step.request, avoid=avoid, peers=peers) if len(avoid) < len(endpoints) else None
        if ticket is None:
            return self.local.no_replica(subset), None
        return self.routed(step, ticket, turn, request_id, started, shape, subset), step.request.request_id

    def before_route(
        self, step: Prepared, subset: frozenset[str] | None, peers: PeerView | None,
    ) -> tuple[Prepared, Collection[str]]:
        """What a new body tells before its request is routed (a branch it starts, the turns it shows
        answered, the cache its last answer left); the step with its leaving phase (and the
        replicas running another LoRA configuration of its model), and the replicas it must not go to."""
        request, parsed = step.request, step.parsed
        conversation, endpoints = request.conversation, self.fleet.endpoints
        # judged on the final claim (the store may have changed it): a chat another router served
        # or still serves (its placement, or a pending request this body answers) is no branch
        elsewhere = peers is not None and peers.placement is not None
        conversations = self.conversations
        branching = conversations.branches(step.claim, parsed.history, parsed.answered) and not elsewhere
        if branching and conversations.branch(request.key, step.shown.prefixes,
                                              bounded_scope(parsed.model, parsed.lora), endpoints):
            self.metrics.branches += 1
        if parsed.answered:
            self._release_answered(conversation, parsed.answered)
        if parsed.answered_tokens:
            conversations.holds_answer(request.key, request.prompt_tokens, parsed.answered_tokens)
        avoid = self.fleet.avoid(subset, self.catalog.eligible(parsed.model))
        avoid, leaving_phase = self.leaving.avoid(request.key, avoid, endpoints)
        unbatched = self.adapters_in_flight.unbatched(bounded(parsed.model), bounded(parsed.lora))
        if unbatched:  # llama.cpp batches none of those replicas' running requests with this one
            step = replace(step, request=request._replace(unbatched=unbatched))
        return replace(step, leaving_phase=leaving_phase), avoid

    def routed(
        self, step: Prepared, ticket: Ticket, turn: str, request_id: str, started: float, shape: AnswerShape,
        subset: frozenset[str] | None = None, wait: Wait | None = None,
    ) -> bytes:
        """The answer sending a routed request to its pick, its Pending kept until it ends. wait:
        how it went through flow control."""
        request, parsed = step.request, step.parsed
        conversation, unique_id = request.conversation, request.request_id
        decision = ticket.decision
        self.leaving.sent(ticket.key, decision.replica)
        self.adapters_in_flight.sent(bounded(parsed.model), bounded(parsed.lora), decision.replica)
        predicted = decision.predicted_cached_tokens
        if parsed.opening:
            predicted = self.conversations.with_opening(decision, parsed.opening, request.prompt_tokens,
                                                        self.router.ledger.requests(decision.replica),
                                                        self.router.facts(decision.replica).slots)
        # Without an access log the stream itself says when the request is over (stream_ended),
        # as if logged at once.
        self.requests.track(Pending(
            ticket, predicted, step.shown, step.claim.continues, bounded(parsed.model), bounded(parsed.lora),
            self.fleet.endpoints[decision.replica], step.path,
            bounded(turn), parsed.stream, started, time.monotonic(),
            envoy_id=bounded(request_id), logged=not shape.access_logged, wait=wait,
            leaving_phase=step.leaving_phase,
        ))  # fmt: skip
        self.conversations.sent(conversation, unique_id, parsed.history)
        self.publishing.routed(unique_id, parsed.history)
        deciding = time.perf_counter() - started - (wait.waited if wait is not None else 0.0)  # the wait aside
        self.metrics.decision(decision.trace.policy, decision.reason, deciding)
        # the answer kept for reuse, unless the gateway named a subset (the fallbacks must come from it too)
        destination = self.fleet.destination if subset is None else lambda name: self.fleet.destination(name, subset)
        return self.answers.for_pick(shape, decision, parsed.stream, destination, subset is None, predicted, wait,
                                     unique_id)

    def _release_answered(self, conversation: str, answered: frozenset[int]) -> None:
        """Release the pending requests of ``conversation`` that this new body shows answered."""
        for request_id in self.conversations.answered(conversation, answered):
            pending = self.requests.pending[request_id]
            pending.released_by_next_turn = True
            self._release(pending, ok=True)
            self.metrics.released_by_next_turn += 1

    # ------------------------------------------------------------------ a request's end (lifecycle.py)

    def settle(self, request_id: str, pending: Pending, ok: bool, served: str | None) -> None:
        """The request is over: no longer waiting for a next turn to show its answer, its load
        released (a no-op when a later turn released it already)."""
        self.conversations.settled(pending.request.conversation, request_id)
        self._release(pending, ok=ok, served=served)

    def report_answer(self, pending: Pending, served_replica: str, cached_tokens: int, learnt: AnswerTimings) -> None:
        """What the answer reported: the router learns it, and the other routers through the store."""
        self.router.report_cached(pending.request, served_replica, pending.predicted_cached_tokens, cached_tokens,
                                  learnt)
        self.publishing.answered(served_replica, learnt)
