"""The gateway's state and per-request logic, between the gRPC streams and the routing core.

One HTTP request meets the service on (see extproc/envoy/config.py):
  - the *route* stream: the request headers with attributes (path, id, content type,
    x-turn), the session headers (sessions.py) and the whole body -> ``route_request`` -> the answer to the
    headers (answers.py: pre-serialized, cached per (replica, reason, streamed)); the service
    lets the body pass and closes the stream (fewer gRPC operations than waiting for Envoy
    to end it);
  - Envoy's access log entry (``access_logged``) and, for a streamed answer, the *observe*
    stream (``observe_*``): they end the request. Its end is lifecycle.py's room
    (``PendingRequests``, the gateway's ``requests``): the gateway hands it each routed request
    (its ``Pending``) and gets it back at its end (``settle``: load released, the conversation's
    bookkeeping done; ``report_answer``: what its answer taught).

Back-to-back turns. Envoy sends the access log entry after the answer has gone to the client,
so a client that sends its next turn at once (an agent loop) would be routed while its last
turn still looks in flight and its cache unplaced. The next turn itself proves the last one
answered: its messages are the last turn's messages plus the answer (bodies.py: ``answered``
holds the histories a body shows answered). So before routing a chat request, every pending
request of the same conversation whose history it shows answered is released (load freed,
placement remembered: its ``Ticket.release``) — by construction, whatever the timing, for JSON
and SSE answers alike. Such a request still waits in ``requests.pending`` for its access log entry,
which brings its outcome and timings. Parallel requests on one prefix carry no answer of each
other: each stays charged until its own end.

Several gateways (store.url set, store.py): a request is decided by ``route_shared``, which
first reads the other routers' picture from the store in one round trip (their load, the
conversation's placement, its requests pending on them: peers.py leaves out those this body
shows answered) and then decides as above; the decision, the release and the placement are
queued for the store's writer. Without a store ``route_request`` decides on local state alone.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import xxhash

from extproc.envoy.cors import CorsPolicy
from extproc.envoy.surface import GENERATION_PATHS, ReadOnly, Refused
from extproc.routing import Router, RouteRequest, Ticket, adapters, estimate_tokens
from extproc.routing.adapters import InFlight
from extproc.routing.blocks import BlockMemory
from extproc.routing.continuation import Claim, Shown
from extproc.routing.conversations import Conversations
from extproc.routing.flow_control import Wait
from extproc.routing.peers import PeerRequest, PeerView, peer_view
from extproc.routing.placement import Placement
from extproc.routing.speeds import AnswerTimings
from extproc.routing.tokens import TokenCounter
from extproc.service.answers import (
    AnswerCache,
    Phase,
    immediate,
    local_answer,
    request_id_header,
    route_answer,
)
from extproc.service.bodies import (
    BadRequest,
    BodyLimits,
    ParsedRequest,
    parse_request,
)
from extproc.service.catalog import ModelCatalog
from extproc.service.decision_log import through_structlog
from extproc.service.leaving import LeavingReplicas
from extproc.service.lifecycle import Lifecycle, Pending, PendingRequests
from extproc.service.metrics import Metrics, ReplicaState
from extproc.service.migrations import Migrations
from extproc.service.sessions import SessionSources
from extproc.service.store import EntryBounds, SharedStore
from extproc.service.tokenizer import make_counter
from extproc.settings import ServiceSettings, StoreSettings

BOUNDED_CHARS = 64  # client-chosen ids kept in state and logs: longer ones are cut and hashed
NO_PEERS = PeerView({}, None)  # the store is configured but not answering: this router's state alone
TEMPLATE_OPENING_TOKENS = 1024  # what a chat template may add before the first message (a default system prompt)


def bounded(value: str, limit: int = BOUNDED_CHARS) -> str:
    """``value``, or its head and a hash of the whole when longer than ``limit``: a client's id
    can neither blow up a log line or the placement memory, nor collide by sharing a head."""
    if len(value) <= limit:
        return value
    return value[: limit - 17] + "~" + xxhash.xxh64_hexdigest(value.encode(errors="replace"))


def bounded_scope(model: str, lora: str) -> str:
    """A request's cache scope (adapters.scope) as the gateway keys it: each part ``bounded``."""
    return adapters.scope(bounded(model), bounded(lora))


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request read and ready to be decided."""

    request: RouteRequest
    parsed: ParsedRequest
    path: str
    shown: Shown  # the body's history digests (continuation.py)
    claim: Claim  # the conversation it is routed under, and whether it continues a known one
    named: str  # the conversation it names (its id, or its opening's key)
    leaving_phase: str = ""  # a follow-up of a leaving replica's conversation: its phase (service/leaving.py)


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
        self.counter = counter or make_counter(settings.tokenizer, settings.chars_per_token)
        self.settings = settings
        self.metrics = metrics
        self.on_replica_failed = on_replica_failed
        self.endpoints: dict[str, str] = {}
        self.unhealthy: set[str] = set()
        self.answers = AnswerCache(settings.routing_headers, replica_key or "")
        self.requests = PendingRequests(self, metrics, self.answers, settings.observe_grace_ms / 1000)
        self._sequence = 0
        self._id_prefix = secrets.token_hex(3) + "-"  # ids differ across restarts of the service
        self.catalog = ModelCatalog()  # what each replica serves (main.py's ModelFetcher fills it)
        self.cors = CorsPolicy(frozenset(settings.cors_origins))
        self.sessions = SessionSources.parse(settings.session_ids)  # where a conversation id comes from
        self.limits = BodyLimits(settings.max_messages, settings.max_prompt_chars, settings.max_output_tokens)
        self.store: SharedStore | None = None  # several routers' shared state (main.py sets it from [store])
        self.block_memory: BlockMemory | None = None  # the last prompt's blocks per conversation, when hashed
        # what each request means for its conversation: claims, tips, branch points, unanswered requests
        self.conversations = Conversations(router.settings.memory_capacity, router.conversation_key, router.memory)
        self.migrations = Migrations(router.settings.memory_capacity, metrics.registry)
        self.adapters_in_flight = InFlight()  # the LoRA configurations running on each replica (adapters.py)
        self.decision_log: Callable[[dict[str, Any]], None] = through_structlog  # main.py: DecisionLog
        self.lifecycle = Lifecycle()  # flow control's ears (waiting_room.py sets its own)
        self.leaving = LeavingReplicas(router.conversation_key, lambda fields: self.decision_log(fields))

    # ------------------------------------------------------------------ replicas

    def set_replicas(self, replicas: Mapping[str, str]) -> None:
        self.endpoints = dict(replicas)
        self.catalog.set_replicas(self.endpoints)
        self.conversations.set_replicas(self.endpoints)
        self.router.set_replicas(self.endpoints)
        self.leaving.set_replicas(self.endpoints)
        self.unhealthy &= set(self.endpoints)
        self.answers.forget_routes()
        if self.store is not None:  # in-flight load on a removed replica went with it
            self.store.load_changed()
        self.lifecycle.replicas_changed()

    def begin_leaving(self, replica: str, seconds: float, near_seconds: float) -> tuple[int, int]:
        """``replica`` starts leaving (extproc/migration/leaving.py); (idle, in flight) conversations placed there."""
        key, ongoing = self.router.conversation_key, self.requests.pending.values()
        in_flight = {key(p.request.conversation) for p in ongoing if p.decision.replica == replica}
        idle = {k for k, _ in self.router.placed_on(replica)} - in_flight
        self.leaving.begin(replica, idle, in_flight, seconds, near_seconds)
        return len(idle), len(in_flight)

    def mark_unhealthy(self, name: str) -> None:
        if name in self.endpoints and name not in self.unhealthy:
            self.unhealthy.add(name)
            self.answers.forget_routes()
            self.on_replica_failed(name)

    def mark_healthy(self, name: str) -> None:
        if name in self.unhealthy:
            self.unhealthy.discard(name)
            self.answers.forget_routes()

    def replica_states(self) -> list[ReplicaState]:
        """Each replica now: address, health, load in flight (for /metrics and the Admin API)."""
        ledger = self.router.ledger
        return [
            ReplicaState(name, self.endpoints.get(name, ""), name not in self.unhealthy,
                         ledger.requests(name), ledger.tokens(name))
            for name in self.router.replicas
        ]  # fmt: skip

    async def share_state(self, settings: StoreSettings, router_id: str) -> None:
        """Agree with the other routers on the same store (main.py, when store.url is set). A store
        that does not answer now leaves this router on its own state until a retry succeeds."""
        service = self.settings
        # the model's tokenizer: at most a token per byte of the body (a message's JSON outweighs its
        # template tokens), and the template's opening
        largest = max(service.max_prompt_chars, estimate_tokens(service.max_prompt_chars, service.chars_per_token),
                      service.max_body_bytes + TEMPLATE_OPENING_TOKENS)
        bounds = EntryBounds(settings.max_peer_requests, largest + service.max_output_tokens)
        self.router.share_view()  # llm-aware's prefix index: its changes go to the others through the store
        self.store = SharedStore(settings, router_id, self.own_loads, self.metrics, bounds, self.republish_pending,
                                 self.learn_answer, self.router.view_changes, self.router.apply_view_changes)
        await self.store.start()

    def learn_answer(self, replica: str, timings: AnswerTimings) -> None:
        """Another router's answer, read from the store: its replica's speed is learnt as from one's own."""
        self.router.speeds.learn(replica, timings)

    def own_loads(self) -> dict[str, tuple[int, int]]:
        """This router's own in-flight (requests, tokens) per replica: what it publishes to the store."""
        ledger = self.router.ledger
        return {name: (ledger.requests(name), ledger.tokens(name)) for name in self.router.replicas
                if ledger.requests(name)}

    def republish_pending(self) -> None:
        """The store is back: publish again this router's requests still waiting for an answer."""
        for request_id, history in self.conversations.waiting():
            self._publish_pending(request_id, history)

    def _publish_pending(self, request_id: str, history: int) -> None:
        assert self.store is not None
        pending = self.requests.pending[request_id]
        request, decision = pending.request, pending.decision
        self.store.routed(
            self.router.conversation_key(request.conversation), request_id,
            PeerRequest(self.store.router_id, decision.replica, decision.charged_tokens, request.prompt_tokens,
                        history),
        )  # fmt: skip

    def _release(self, pending: Pending, ok: bool, served: str | None = None) -> None:
        """Release a request's load (its ticket: once), remember who continues its
        conversation and tell the store."""
        if pending.ticket.release(ok, served):
            self.lifecycle.released(pending.request.request_id)
            request, decision = pending.request, pending.decision
            self.adapters_in_flight.ended(pending.model, pending.lora, decision.replica)
            key = self.router.conversation_key(request.conversation)
            self.leaving.ended(key, decision.replica)
            if ok:
                chat = GENERATION_PATHS.get(pending.path) == "chat"
                chat_scope = bounded_scope(pending.model, pending.lora) if chat else None
                self.conversations.completed(key, pending.shown, served or decision.replica, request.prompt_tokens,
                                             chat_scope)
            if self.store is not None:
                placement = None
                if ok:  # overtaken: the move's placement again, under this request's digest (the move's is older)
                    moved = self.router.memory.get(key) if pending.ticket.overtaken else None
                    placement = moved or Placement(served or decision.replica, request.prompt_tokens)
                self.store.completed(key, request.request_id, placement, pending.shown.digest, pending.continued)

    # ------------------------------------------------------------------ route stream

    def route_request(
        self,
        *,
        path: str,
        content_type: str,
        session_headers: Mapping[str, str],
        turn: str,
        request_id: str,
        body: bytes,
        parsed_elsewhere: ParsedRequest | BadRequest | None = None,
        phase: Phase = "own",
        subset: frozenset[str] | None = None,
    ) -> tuple[bytes, str | None]:
        """(the serialized ProcessingResponse answering the request, our id of the routed request):
        the pick, or an immediate error answer that Envoy sends the client itself (id None).
        session_headers: the request's headers of service.session_ids (name -> value).
        parsed_elsewhere: the body's parse_request result (or refusal) from offload.py.
        phase: the answer's shape (answers.py); subset: the endpoints a gateway allows (None: all).
        Decided on this router's own state: the service without a store (route_shared with one)."""
        started = time.perf_counter()
        step = self.prepare(path, content_type, session_headers, body, parsed_elsewhere)
        if isinstance(step, bytes):
            return step, None
        return self._decide(step, turn, request_id, started, None, phase, subset)

    async def route_shared(
        self, *, path: str, content_type: str, session_headers: Mapping[str, str], turn: str, request_id: str,
        body: bytes,
        parsed_elsewhere: ParsedRequest | BadRequest | None = None, phase: Phase = "own",
        subset: frozenset[str] | None = None,
    ) -> tuple[bytes, str | None]:
        """route_request with the other routers' picture, read from the store in one round trip
        (at most store.timeout_ms; then this router's own state)."""
        started = time.perf_counter()
        step = self.prepare(path, content_type, session_headers, body, parsed_elsewhere)
        if isinstance(step, bytes):
            return step, None
        step, peers = await self.peers(step)
        return self._decide(step, turn, request_id, started, peers, phase, subset)

    def answer_locally(self, asked: ReadOnly, headers: Sequence[tuple[str, str]] = ()) -> bytes:
        """The gateway's own answer to a read-only request (surface.py): the fleet's models, one
        model, or its health (200 while a replica is healthy). ``headers``: CORS, when allowed."""
        self.metrics.answered_locally[asked.kind] += 1
        if asked.kind == "models":
            return local_answer(200, self.catalog.listing(), headers)
        if asked.kind == "model":
            entry = self.catalog.entry(asked.model)
            if entry is None:
                return self._model_not_found(asked.model, headers)
            return local_answer(200, entry, headers)
        if any(name not in self.unhealthy for name in self.endpoints):
            return local_answer(200, b'{"status":"ok"}', headers)
        return immediate(503, "no replica available", "no_replica", headers=headers)

    def refuse(self, refused: Refused, headers: Sequence[tuple[str, str]] = ()) -> bytes:
        """404 for a path the gateway does not serve, 405 for a method it does not take there."""
        self.metrics.errors["refused_path"] += 1
        allow = [("allow", refused.allow)] if refused.allow else []
        return immediate(refused.status, refused.message, refused.code, headers=[*allow, *headers])

    def preflight(self, cors: Sequence[tuple[str, str]], requested_headers: str) -> bytes:
        """A CORS preflight from an allowed origin (``cors``: its answer headers)."""
        self.metrics.answered_locally["preflight"] += 1
        return local_answer(204, b"", [*cors, *self.cors.preflight_headers(requested_headers)])

    def _model_not_found(self, model: str, headers: Sequence[tuple[str, str]] = ()) -> bytes:
        self.metrics.errors["unknown_model"] += 1
        served = ", ".join(entry.id for entry in self.catalog.entries()) or "none known yet"
        return immediate(404, f"the model {bounded(model)!r} is not served here (served: {served})",
                         "model_not_found", "model", headers)

    def _model_not_ready(self, model: str) -> bytes:
        """A model a replica served, none of whose replicas is in the fleet now."""
        self.metrics.errors["no_replica"] += 1
        return immediate(503, f"the model {bounded(model)!r} has no ready replica: retry shortly", "no_replica",
                         "model")

    def _avoid(self, subset: frozenset[str] | None, model: str) -> Collection[str]:
        """The replicas a pick must not land on: outside the gateway's subset, not serving the
        model named, and the unhealthy ones (unless no other is left)."""
        serving = self.catalog.eligible(model)
        if subset is None and len(serving) == len(self.endpoints):  # the common case: no list to build
            return self.unhealthy if len(self.unhealthy) < len(self.endpoints) else ()
        allowed = self._eligible(subset, serving)
        return [name for name in self.endpoints if name not in allowed]

    def _eligible(self, subset: frozenset[str] | None, serving: Collection[str]) -> list[str]:
        """The replicas a pick may land on: the healthy ones (all when none is) of the subset
        that serve the model."""
        names = [name for name in sorted(self.endpoints) if name in serving]
        if subset is not None:
            names = [name for name in names if self.endpoints[name] in subset]
        healthy = [name for name in names if name not in self.unhealthy]
        return healthy or names

    def _to_shed(self, avoid: Collection[str]) -> bool:
        limit = self.settings.shed_requests_per_replica
        if not limit:
            return False
        ledger = self.router.ledger
        return all(ledger.requests(name) >= limit for name in self.endpoints if name not in avoid)

    def no_replica(self, subset: frozenset[str] | None) -> bytes:
        self.metrics.errors["no_replica"] += 1
        if subset is not None:
            return immediate(503, f"no replica of the gateway's subset is available ({len(subset)} endpoints named, "
                             f"{len(self.endpoints)} replicas known)", "no_replica")
        return immediate(503, f"no replica available ({len(self.endpoints)} known, {len(self.unhealthy)} unhealthy)",
                         "no_replica")

    def prepare(
        self, path: str, content_type: str, session_headers: Mapping[str, str], body: bytes,
        parsed_elsewhere: ParsedRequest | BadRequest | None,
    ) -> Prepared | bytes:
        """The request as the router sees it, or the answer refusing it."""
        try:
            parsed = self._parse(path, content_type, body, parsed_elsewhere)
        except BadRequest as exc:
            self.metrics.errors["bad_request"] += 1
            return immediate(exc.status, exc.message, exc.code, exc.param)
        if parsed.model and self.endpoints and not self.catalog.eligible(parsed.model):
            if self.catalog.known(parsed.model):
                return self._model_not_ready(parsed.model)
            return self._model_not_found(parsed.model)
        unique_id = self._request_id()
        session = self.sessions.pick(session_headers, dict(parsed.sessions))
        digests, claimed, named = self.conversations.claim_request(
            bounded(session), bounded_scope(parsed.model, parsed.lora), parsed.opening_key, parsed.history,
            parsed.answered)
        # under the key the router places it by (a reused id that does not continue its chat has its own)
        self.migrations.opened(self.router.conversation_key(claimed.conversation), parsed.opening_key, parsed.scope)
        prompt_tokens = parsed.prompt_token_ids + parsed.prompt_tokens
        max_tokens = (parsed.max_tokens or self.settings.default_max_tokens) * parsed.prompts
        request = RouteRequest(unique_id, claimed.conversation, prompt_tokens, max_tokens, parsed.prefix_blocks,
                               bounded(parsed.model))
        return Prepared(request, parsed, path, digests, claimed, named)

    async def peers(self, step: Prepared) -> tuple[Prepared, PeerView]:
        """What the other live routers hold, for this request (nothing while the store is not in
        use). A request that does not continue the conversation the store knows under its key is
        routed under the next key (continuation.py): it gets the others' load, nothing of the conversation."""
        assert self.store is not None
        request = step.request
        snapshot = await self.store.read(self.router.conversation_key(request.conversation))
        if snapshot is None:
            return step, NO_PEERS
        if snapshot.placement is not None:  # the store's digest is known too, for the key it was read for
            claimed = self.conversations.claim(step.named, step.parsed.opening_key, step.shown, request.conversation,
                                               snapshot.digest)
            if claimed.conversation != request.conversation:
                step = Prepared(request._replace(conversation=claimed.conversation), step.parsed, step.path,
                                step.shown, claimed, step.named)
                self.migrations.opened(self.router.conversation_key(claimed.conversation), step.parsed.opening_key,
                                       step.parsed.scope)
                return step, peer_view(snapshot.loads, (), frozenset(), None)
            step = Prepared(request, step.parsed, step.path, step.shown, claimed, step.named)
        return step, peer_view(snapshot.loads, snapshot.pending, step.parsed.answered, snapshot.placement)

    def _decide(
        self, step: Prepared, turn: str, request_id: str, started: float, peers: PeerView | None,
        phase: Phase = "own", subset: frozenset[str] | None = None,
    ) -> tuple[bytes, str | None]:
        step, avoid = self.before_route(step, subset, peers)
        if self._to_shed(avoid):
            self.metrics.errors["shed"] += 1
            return immediate(429, "every replica is at service.shed_requests_per_replica requests in flight",
                             "rate_limit_exceeded"), None
        ticket = self.router.route(step.request, avoid=avoid, peers=peers) if len(avoid) < len(self.endpoints) \
            else None
        if ticket is None:
            return self.no_replica(subset), None
        return self.routed(step, ticket, turn, request_id, started, phase, subset), step.request.request_id

    def before_route(
        self, step: Prepared, subset: frozenset[str] | None, peers: PeerView | None,
    ) -> tuple[Prepared, Collection[str]]:
        """What a new body tells before its request is routed (a branch it starts, the turns it shows
        answered, the cache its last answer left); the step with its leaving phase (and the
        replicas running another LoRA configuration of its model), and the replicas it must not go to."""
        request, parsed = step.request, step.parsed
        conversation = request.conversation
        # judged on the final claim (the store may have changed it): a chat another router served
        # or still serves (its placement, or a pending request this body answers) is no branch
        elsewhere = peers is not None and peers.placement is not None
        conversations = self.conversations
        branching = conversations.branches(step.claim, parsed.history, parsed.answered) and not elsewhere
        if branching and conversations.branch(conversation, step.shown.prefixes,
                                              bounded_scope(parsed.model, parsed.lora), self.endpoints):
            self.metrics.branches += 1
        if parsed.answered:
            self._release_answered(conversation, parsed.answered)
        if parsed.answered_tokens:
            conversations.holds_answer(conversation, request.prompt_tokens, parsed.answered_tokens)
        avoid, leaving_phase = self.leaving.avoid(conversation, self._avoid(subset, parsed.model), self.endpoints)
        unbatched = self.adapters_in_flight.unbatched(bounded(parsed.model), bounded(parsed.lora))
        if unbatched:  # llama.cpp batches none of those replicas' running requests with this one
            step = replace(step, request=request._replace(unbatched=unbatched))
        return replace(step, leaving_phase=leaving_phase), avoid

    def routed(
        self, step: Prepared, ticket: Ticket, turn: str, request_id: str, started: float, phase: Phase = "own",
        subset: frozenset[str] | None = None, wait: Wait | None = None,
    ) -> bytes:
        """The answer sending a routed request to its pick, its Pending kept until it ends. wait:
        how it went through flow control."""
        request, parsed = step.request, step.parsed
        conversation, unique_id = request.conversation, request.request_id
        decision = ticket.decision
        self.leaving.sent(conversation, decision.replica)
        self.adapters_in_flight.sent(bounded(parsed.model), bounded(parsed.lora), decision.replica)
        predicted = decision.predicted_cached_tokens
        if parsed.opening:
            predicted = self.conversations.with_opening(decision, parsed.opening, request.prompt_tokens,
                                                        self.router.ledger.requests(decision.replica),
                                                        self.router.settings.replica_slots)
        # Behind an Endpoint Picker's gateway no access log comes: the stream itself says when
        # the request is over (stream_ended), as if logged at once.
        self.requests.track(Pending(
            ticket, predicted, step.shown, step.claim.continues, bounded(parsed.model), bounded(parsed.lora),
            self.endpoints[decision.replica], step.path,
            bounded(turn), parsed.stream, started, time.monotonic(),
            envoy_id=bounded(request_id), logged=phase != "own", wait=wait,
            leaving_phase=step.leaving_phase,
        ))  # fmt: skip
        self.conversations.sent(conversation, unique_id, parsed.history)
        if self.store is not None:
            self._publish_pending(unique_id, parsed.history)
        deciding = time.perf_counter() - started - (wait.waited if wait is not None else 0.0)  # the wait aside
        self.metrics.decision(decision.trace.policy, decision.reason, deciding)
        answer = self._pick_answer(decision.replica, decision.reason, parsed.stream, phase, subset)
        if self.settings.routing_headers:
            answer += self.answers.predicted_cached(predicted, phase)
            if wait is not None:
                answer += self.answers.queue_wait(wait.waited, phase)
        if phase == "own":  # our id, for Envoy's access log entry; a gateway's own id is left alone
            answer += request_id_header(unique_id)
        return answer

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
        if self.store is not None and self.router.speeds.learning and served_replica in self.router.replicas:
            self.store.answered(served_replica, learnt)  # the other routers learn from it too

    # ------------------------------------------------------------------ helpers

    def _parse(
        self, path: str, content_type: str, body: bytes, done: ParsedRequest | BadRequest | None
    ) -> ParsedRequest:
        if isinstance(done, BadRequest):
            raise done
        if done is not None:
            return done
        block_chars = self.router.policy.prefix_block_chars
        if block_chars and (self.block_memory is None or self.block_memory.block_chars != block_chars):
            self.block_memory = BlockMemory(block_chars)
        return parse_request(path, content_type, body, self.limits, block_chars, self.block_memory, self.counter,
                             self.sessions.fields)

    def _request_id(self) -> str:
        self._sequence += 1
        return f"{self._id_prefix}{self._sequence:x}"

    def _pick_answer(
        self, replica: str, reason: str, streamed: bool, phase: Phase, subset: frozenset[str] | None
    ) -> bytes:
        """The answer for a pick: kept for reuse, unless the gateway named a subset (the
        fallbacks must come from it too)."""
        if subset is None:
            return self.answers.route(replica, reason, streamed, self._destination, phase)
        return route_answer(self._destination(replica, subset), replica, reason, streamed, phase,
                            self.settings.routing_headers, self.answers.replica_key)

    def _destination(self, replica: str, subset: frozenset[str] | None = None) -> str:
        """The pick's endpoint, then up to service.fallbacks healthy others (in name order
        after it, of the subset when one is named): where Envoy retries when the pick refuses."""
        names = sorted(self.endpoints)
        start = names.index(replica)
        fallbacks = [n for n in names[start + 1 :] + names[:start]
                     if n not in self.unhealthy and (subset is None or self.endpoints[n] in subset)]
        return ",".join([self.endpoints[replica]] + [self.endpoints[n] for n in fallbacks[: self.settings.fallbacks]])
