"""The gateway's state and per-request logic, between the gRPC streams and the routing core.

One HTTP request meets the service on (see extproc/envoy/config.py):
  - the *route* stream: the request headers with attributes (path, id, content type,
    x-conversation-id, x-turn) and the whole body -> ``route_request`` -> the answer to the
    headers (answers.py: pre-serialized, cached per (replica, reason, streamed)); the service
    lets the body pass and closes the stream (fewer gRPC operations than waiting for Envoy
    to end it);
  - Envoy's access log entry, for every request that got a pick (status, the upstream that
    served, reset flags, the timings Envoy copied from a JSON body) -> ``access_logged``:
    the HTTP request is over;
  - a streamed (SSE) answer: the *observe* stream, the response body chunks (the first with
    status and the upstream that served), never answered -> ``observe_*``.
They meet in ``pending`` by request id: the service's own, set as the request's
``x-request-id`` by its answer (a client's id is only logged, bounded). An access log entry
that carries Envoy's id instead (``envoy_ids``) means the answer never landed: Envoy failed
open past ext_proc's timeout and served the request round robin. The request is over, and
logged, in ``_finish``:
when the access log entry has come and, for a streamed answer, the observer has seen its end
(or ``observe_grace`` after the entry). An entry that never comes (the access log stream
broke) is made up for by ``release_lost``: Envoy itself ends a request that shows no activity
for STREAM_IDLE_TIMEOUT_S, so a request silent for twice that long is over.

Back-to-back turns. Envoy sends the access log entry after the answer has gone to the client,
so a client that sends its next turn at once (an agent loop) would be routed while its last
turn still looks in flight and its cache unplaced. The next turn itself proves the last one
answered: its messages are the last turn's messages plus the answer (bodies.py: ``answered``
holds the histories a body shows answered). So before routing a chat request, every pending
request of the same conversation whose history it shows answered is released (load freed,
placement remembered, ``Router.complete``) — by construction, whatever the timing, for JSON
and SSE answers alike. Such a request still waits in ``pending`` for its access log entry,
which brings its outcome and timings. Parallel requests on one prefix carry no answer of each
other: each stays charged until its own end.

Several gateways (store.url set, store.py): a request is decided by ``route_shared``, which
first reads the other routers' picture from the store in one round trip (their load, the
conversation's placement, its requests pending on them: peers.py leaves out those this body
shows answered) and then decides as above; the decision, the release and the placement are
queued for the store's writer. Without a store ``route_request`` decides on local state alone.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
import xxhash

from extproc.envoy.contract import (
    STREAM_IDLE_TIMEOUT_S,
)
from extproc.routing import Decision, Router, RouteRequest, estimate_tokens
from extproc.routing.blocks import BlockMemory
from extproc.routing.continuation import Claim, ConversationDigests, Shown, claim, shown
from extproc.routing.peers import PeerRequest, PeerView, peer_view
from extproc.routing.placement import Placement
from extproc.routing.speeds import AnswerTimings
from extproc.routing.tokens import TokenCounter, shared_opening
from extproc.service.answers import (
    RESPONSE_HEADERS_CONTINUE,
    AnswerCache,
    Phase,
    immediate,
    request_id_header,
    route_answer,
)
from extproc.service.bodies import (
    BadRequest,
    BodyLimits,
    ParsedRequest,
    Timings,
    parse_request,
    parse_timings,
)
from extproc.service.metrics import Metrics, ReplicaState
from extproc.service.migrations import Migrations
from extproc.service.store import EntryBounds, SharedStore
from extproc.service.tokenizer import make_counter
from extproc.settings import ServiceSettings, StoreSettings

log = structlog.get_logger("extproc.service")

MAX_JSON_RESPONSE_BYTES = 1 << 20  # larger JSON answers are passed on unread (no timings)
SSE_TAIL_BYTES = 64 << 10  # the last events of a stream are all we read
LOST_AFTER_S = 2 * STREAM_IDLE_TIMEOUT_S  # no access log entry by then: it was lost
BOUNDED_CHARS = 64  # client-chosen ids kept in state and logs: longer ones are cut and hashed
PASS_THROUGH = "pass-through"  # the reason of a pick for a request that is no generation
NO_PEERS = PeerView({}, None)  # the store is configured but not answering: this router's state alone
TEMPLATE_OPENING_TOKENS = 1024  # what a chat template may add before the first message (a default system prompt)


def bounded(value: str, limit: int = BOUNDED_CHARS) -> str:
    """``value``, or its head and a hash of the whole when longer than ``limit``: a client's id
    can neither blow up a log line or the placement memory, nor collide by sharing a head."""
    if len(value) <= limit:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return value
    return value[: limit - 17] + "~" + xxhash.xxh64_hexdigest(value.encode(errors="replace"))


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request read and ready to be decided."""

    request: RouteRequest
    parsed: ParsedRequest
    path: str
    shown: Shown  # the body's history digests (continuation.py)
    claim: Claim  # the conversation it is routed under, and whether it continues a known one


@dataclass(slots=True)
class Pending:
    """A routed request between its decision and the release of its load."""

    request: RouteRequest
    decision: Decision
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


class Gateway:
    def __init__(
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)router: Router,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)settings: ServiceSettings,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)metrics: Metrics,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)on_replica_failed: Callable[[str], None] = lambda name: None,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)counter: TokenCounter | None = None,
    ) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""counter: how prompts are counted (None: the one service.tokenizer names)."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.router = router
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.counter = counter or make_counter(settings.tokenizer, settings.chars_per_token)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)# replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.openings: dict[str, deque[tuple[int, ...]]] = {}
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.settings = settings
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.metrics = metrics
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.on_replica_failed = on_replica_failed
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.endpoints: dict[str, str] = {}
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.unhealthy: set[str] = set()
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.pending: dict[str, Pending] = {}
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)# conversation -> {request id: history} of pending requests not yet shown answered
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.unanswered: dict[str, dict[str, int]] = {}
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.answers = AnswerCache(settings.routing_headers)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self._sequence = 0
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self._pass_turn = 0  # pass_through's rotation
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self._id_prefix = secrets.token_hex(3) + "-"  # ids differ across restarts of the service
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.envoy_ids: dict[str, str] = {}  # Envoy's id -> ours, while pending
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.limits = BodyLimits(settings.max_messages, settings.max_prompt_chars, settings.max_output_tokens)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.store: SharedStore | None = None  # several routers' shared state (main.py sets it from [store])
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.block_memory: BlockMemory | None = None  # the last prompt's blocks per conversation, when hashed
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)# conversation key -> digest of its last completed request: who may use its placement
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.digests = ConversationDigests(router.settings.memory_capacity)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.claims: dict[str, tuple[int, bool]] = {}  # request id -> (its digest, it continued), while in flight
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.migrations = Migrations(router.settings.memory_capacity, metrics.registry)

    # ------------------------------------------------------------------ replicas

    def set_replicas(self, replicas: Mapping[str, str]) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.endpoints = dict(replicas)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.openings = {name: seen for name, seen in self.openings.items() if name in self.endpoints}
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.router.set_replicas(self.endpoints)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.unhealthy &= set(self.endpoints)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.answers.forget_routes()
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if self.store is not None:  # in-flight load on a removed replica went with it
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.store.load_changed()

    def mark_unhealthy(self, name: str) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if name in self.endpoints and name not in self.unhealthy:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.unhealthy.add(name)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.answers.forget_routes()
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.on_replica_failed(name)

    def mark_healthy(self, name: str) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if name in self.unhealthy:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.unhealthy.discard(name)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.answers.forget_routes()

    def replica_states(self) -> list[ReplicaState]:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""Each replica now: address, health, load in flight (for /metrics and the Admin API)."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)ledger = self.router.ledger
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return [
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    ReplicaState(name, self.endpoints.get(name, ""), name not in self.unhealthy,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)                 ledger.requests(name), ledger.tokens(name))
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    for name in self.router.replicas
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)]  # fmt: skip

    async def share_state(self, settings: StoreSettings, router_id: str) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""Agree with the other routers on the same store (main.py, when store.url is set). A store
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)that does not answer now leaves this router on its own state until a retry succeeds."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)service = self.settings
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)# the model's tokenizer: at most a token per byte of the body (a message's JSON outweighs its
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)# template tokens), and the template's opening
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)largest = max(service.max_prompt_chars, estimate_tokens(service.max_prompt_chars, service.chars_per_token),
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)              service.max_body_bytes + TEMPLATE_OPENING_TOKENS)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)bounds = EntryBounds(settings.max_peer_requests, largest + service.max_output_tokens)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.store = SharedStore(settings, router_id, self.own_loads, self.metrics, bounds, self.republish_pending,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)                         self.learn_answer)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)await self.store.start()

    def learn_answer(self, replica: str, timings: AnswerTimings) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""Another router's answer, read from the store: its replica's speed is learnt as from one's own."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.router.speeds.learn(replica, timings)

    def own_loads(self) -> dict[str, tuple[int, int]]:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""This router's own in-flight (requests, tokens) per replica: what it publishes to the store."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)ledger = self.router.ledger
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return {name: (ledger.requests(name), ledger.tokens(name)) for name in self.router.replicas
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        if ledger.requests(name)}

    def republish_pending(self) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""The store is back: publish again this router's requests still waiting for an answer."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)for waiting in self.unanswered.values():
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    for request_id, history in waiting.items():
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        self._publish_pending(request_id, history)

    def _publish_pending(self, request_id: str, history: int) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)assert self.store is not None
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)pending = self.pending[request_id]
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)request, decision = pending.request, pending.decision
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.store.routed(
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.router.conversation_key(request.conversation), request_id,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    PeerRequest(self.store.router_id, decision.replica, decision.charged_tokens, request.prompt_tokens,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)                history),
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots))  # fmt: skip

    def _complete(self, request_id: str, request: RouteRequest, ok: bool, served: str | None = None) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""Release a request's load (Router.complete: once), remember who continues its
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)conversation and tell the store."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)decision = self.router.complete(request_id, ok=ok, served=served)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)digest, continued = self.claims.pop(request_id, (0, False))
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if decision is not None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    key = self.router.conversation_key(request.conversation)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    if ok:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        self.digests.remember(key, digest)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    if self.store is not None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        placement = Placement(served or decision.replica, request.prompt_tokens) if ok else None
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        self.store.completed(key, request_id, placement, digest, continued)

    # ------------------------------------------------------------------ route stream

    def route_request(
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)*,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)path: str,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)content_type: str,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)conversation_id: str,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)turn: str,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)request_id: str,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)body: bytes,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)parsed_elsewhere: ParsedRequest | BadRequest | None = None,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)phase: Phase = "own",
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)subset: frozenset[str] | None = None,
    ) -> tuple[bytes, str | None]:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""(the serialized ProcessingResponse answering the request, our id of the routed request):
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)the pick, or an immediate error answer that Envoy sends the client itself (id None).
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)parsed_elsewhere: the body's parse_request result (or refusal) from offload.py.
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)phase: the answer's shape (answers.py); subset: the endpoints a gateway allows (None: all).
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)Decided on this router's own state: the service without a store (route_shared with one)."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)started = time.perf_counter()
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)step = self._prepare(path, content_type, conversation_id, body, parsed_elsewhere)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if isinstance(step, bytes):
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return step, None
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return self._decide(step, turn, request_id, started, None, phase, subset)

    async def route_shared(
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self, *, path: str, content_type: str, conversation_id: str, turn: str, request_id: str, body: bytes,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)parsed_elsewhere: ParsedRequest | BadRequest | None = None, phase: Phase = "own",
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)subset: frozenset[str] | None = None,
    ) -> tuple[bytes, str | None]:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""route_request with the other routers' picture, read from the store in one round trip
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)(at most store.timeout_ms; then this router's own state)."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)started = time.perf_counter()
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)step = self._prepare(path, content_type, conversation_id, body, parsed_elsewhere)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if isinstance(step, bytes):
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return step, None
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)step, peers = await self._peers(step)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return self._decide(step, turn, request_id, started, peers, phase, subset)

    def pass_through(self, phase: Phase, subset: frozenset[str] | None) -> bytes:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""The answer for a request that is no generation (an Endpoint Picker sees every request
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)of its route: GET /v1/models, /health, ...): the next eligible replica in turn, no load
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)charged, nothing tracked."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)eligible = self._eligible(subset)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if not eligible:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return self._no_replica(subset)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self._pass_turn += 1
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)replica = eligible[self._pass_turn % len(eligible)]
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.metrics.passed_through += 1
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return self._pick_answer(replica, PASS_THROUGH, False, phase, subset)

    def _eligible(self, subset: frozenset[str] | None) -> list[str]:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""The replicas a pick may land on: the healthy ones (all when none is) of the subset."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)names = sorted(self.endpoints)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if subset is not None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    names = [name for name in names if self.endpoints[name] in subset]
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)healthy = [name for name in names if name not in self.unhealthy]
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return healthy or names

    def _to_shed(self, avoid: Collection[str]) -> bool:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)limit = self.settings.shed_requests_per_replica
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if not limit:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return False
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)ledger = self.router.ledger
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return all(ledger.requests(name) >= limit for name in self.endpoints if name not in avoid)

    def _no_replica(self, subset: frozenset[str] | None) -> bytes:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.metrics.errors["no_replica"] += 1
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if subset is not None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return immediate(503, "no replica of the gateway's subset is available", replicas=len(self.endpoints),
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)                     subset=sorted(subset)[:16])  # fmt: skip
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return immediate(503, "no replica available", replicas=len(self.endpoints), unhealthy=sorted(self.unhealthy))

    def _prepare(
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self, path: str, content_type: str, conversation_id: str, body: bytes,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)parsed_elsewhere: ParsedRequest | BadRequest | None,
    ) -> Prepared | bytes:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""The request as the router sees it, or the answer refusing it."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)try:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    parsed = self._parse(path, content_type, body, parsed_elsewhere)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)except BadRequest as exc:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.metrics.errors["bad_request"] += 1
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return immediate(exc.status, exc.message)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)unique_id = self._request_id()
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)digests = shown(parsed.history, parsed.answered, parsed.opening_key)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)named = bounded(conversation_id) or parsed.opening_key
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)known = self.digests.get(self.router.conversation_key(named))
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)claimed = claim(named, parsed.opening_key, () if known is None else (known,), digests)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)# under the key the router places it by (a reused id that does not continue its chat has its own)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.migrations.opened(self.router.conversation_key(claimed.conversation), parsed.opening_key)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)prompt_tokens = parsed.prompt_token_ids or parsed.prompt_tokens
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)request = RouteRequest(
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    unique_id, claimed.conversation, prompt_tokens, parsed.max_tokens or self.settings.default_max_tokens,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    parsed.prefix_blocks,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots))
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return Prepared(request, parsed, path, digests, claimed)

    async def _peers(self, step: Prepared) -> tuple[Prepared, PeerView]:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""What the other live routers hold, for this request (nothing while the store is not in
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)use). A request that does not continue the conversation the store knows by its id is
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)routed as a new one (continuation.py): it gets the others' load, nothing of the conversation."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)assert self.store is not None
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)request = step.request
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)snapshot = await self.store.read(self.router.conversation_key(request.conversation))
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if snapshot is None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return step, NO_PEERS
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if snapshot.placement is not None and not step.claim.foreign:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    local = self.digests.get(self.router.conversation_key(request.conversation))
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    known = (snapshot.digest,) if local is None else (snapshot.digest, local)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    claimed = claim(request.conversation, step.parsed.opening_key, known, step.shown)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    if claimed.foreign:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        step = Prepared(request._replace(conversation=claimed.conversation), step.parsed, step.path,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)                        step.shown, claimed)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        self.migrations.opened(self.router.conversation_key(claimed.conversation), step.parsed.opening_key)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        return step, peer_view(snapshot.loads, (), frozenset(), None)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    step = Prepared(request, step.parsed, step.path, step.shown, claimed)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return step, peer_view(snapshot.loads, snapshot.pending, step.parsed.answered, snapshot.placement)

    def _decide(
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self, step: Prepared, turn: str, request_id: str, started: float, peers: PeerView | None,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)phase: Phase = "own", subset: frozenset[str] | None = None,
    ) -> tuple[bytes, str | None]:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)request, parsed = step.request, step.parsed
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)conversation, unique_id = request.conversation, request.request_id
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if parsed.answered:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self._release_answered(conversation, parsed.answered)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if parsed.answered_tokens:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self._holds_answer(request, parsed.answered_tokens)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if subset is None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    avoid: Collection[str] = self.unhealthy if len(self.unhealthy) < len(self.endpoints) else ()
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)else:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    allowed = self._eligible(subset)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    avoid = [name for name in self.endpoints if name not in allowed]
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if self._to_shed(avoid):
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.metrics.errors["shed"] += 1
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return immediate(429, "every replica is at service.shed_requests_per_replica requests in flight"), None
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)decision = self.router.route(request, avoid=avoid, peers=peers) if len(avoid) < len(self.endpoints) else None
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if decision is None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return self._no_replica(subset), None
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if parsed.opening:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    decision = self._with_opening(decision, parsed.opening, request.prompt_tokens)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)# Behind an Endpoint Picker's gateway no access log comes: the stream itself says when
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)# the request is over (stream_ended), as if logged at once.
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.pending[unique_id] = Pending(
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    request, decision, self.endpoints[decision.replica], step.path, bounded(turn), parsed.stream, started,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    time.monotonic(), envoy_id=self._remember_envoy_id(request_id, unique_id), logged=phase != "own",
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots))  # fmt: skip
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if parsed.history:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.unanswered.setdefault(conversation, {})[unique_id] = parsed.history
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.claims[unique_id] = (step.shown.digest, step.claim.continues)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if self.store is not None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self._publish_pending(unique_id, parsed.history)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.metrics.decision(decision.trace.policy, decision.reason, time.perf_counter() - started)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)answer = self._pick_answer(decision.replica, decision.reason, parsed.stream, phase, subset)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if self.settings.routing_headers:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    answer += self.answers.predicted_cached(decision.predicted_cached_tokens, phase)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if phase == "own":  # our id, for Envoy's access log entry; a gateway's own id is left alone
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    answer += request_id_header(unique_id)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return answer, unique_id

    def _holds_answer(self, request: RouteRequest, answered_tokens: int) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""The replica that served the conversation's last turn holds its prompt and the answer it
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)wrote, all of this body's tokens up to that answer's end but its last token (sampled, never
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)decoded: measured, cache_n = that count - 1): placement memory learns the longer figure,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)which is what the prediction and the cost count as cached there."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)key = self.router.conversation_key(request.conversation)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)placement = self.router.memory.get(key)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)held = answered_tokens - 1
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if placement is not None and placement.prompt_tokens < held <= request.prompt_tokens:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.router.memory.remember(key, placement.replica, held)

    def _with_opening(self, decision: Decision, opening: tuple[int, ...], prompt_tokens: int) -> Decision:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""The decision predicting at least what the pick shares with the last prompts sent to it:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)the chat template's opening and a common system prompt are cached for a new conversation
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)too. llama.cpp gives a request the idle slot most like it, so only while a slot that holds
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)a prompt is idle: fewer requests in flight there (this one aside) than slots filled. At
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)most the prompt but one token: the replica computes one at least."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)routing = self.router.settings
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)slots = max(1, getattr(routing.params[routing.policy], "replica_slots", 1))  # llm-aware's; others: one
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)seen = self.openings.get(decision.replica)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if seen is None or seen.maxlen != slots:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    seen = self.openings[decision.replica] = deque(seen or (), maxlen=slots)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)idle_filled = len(seen) > self.router.ledger.requests(decision.replica) - 1
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)shared = min(shared_opening(opening, seen), prompt_tokens - 1) if idle_filled else 0
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)seen.append(opening)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if shared > decision.predicted_cached_tokens:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return decision._replace(predicted_cached_tokens=shared)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return decision

    def _release_answered(self, conversation: str, answered: frozenset[int]) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""Release the pending requests of ``conversation`` that this new body shows answered."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)waiting = self.unanswered.get(conversation)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if not waiting:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)for request_id in [rid for rid, history in waiting.items() if history in answered]:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    del waiting[request_id]
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    pending = self.pending[request_id]
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    pending.released_by_next_turn = True
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self._complete(request_id, pending.request, ok=True)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.metrics.released_by_next_turn += 1
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if not waiting:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    del self.unanswered[conversation]

    # ------------------------------------------------------------------ access log

    def access_logged(self, request_id: str, status: int, served: str, cut_off: bool, timings: Timings | None) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""Envoy's access log entry for a request: it is over. cut_off: the client went away,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)or the upstream broke off a started answer (ends as abandoned). A streamed answer's
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)timings are in its last events: wait for the observer's end, at most observe_grace."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)pending = self.pending.get(request_id)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if pending is None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self._served_without_pick(request_id, status, served)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)pending.logged = True
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)pending.status = status
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)pending.served = served
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)pending.answered = pending.answered or not cut_off
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if not pending.stream:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    pending.timings = timings
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self._finish(request_id)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)elif pending.observed_end or cut_off:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self._finish(request_id)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)else:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    grace = self.settings.observe_grace_ms / 1000
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    pending.timer = asyncio.get_running_loop().call_later(grace, self._finish, request_id)

    def _served_without_pick(self, envoy_id: str, status: int, served: str) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""An entry under Envoy's own id: the service decided too late (Envoy failed open) and
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)the request went round robin. Release the load; the pick is not to blame for anything."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)request_id = self.envoy_ids.get(envoy_id)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if request_id is None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return  # not a routed request (a 404/405, a request ext_proc never saw)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)pending = self.pending[request_id]
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)pending.logged = pending.not_applied = True
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)pending.status, pending.served = status, served
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self._finish(request_id)

    def release_lost(self, now: float) -> int:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""Release requests silent for LOST_AFTER_S (monotonic ``now``): their access log
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)entry was lost, e.g. while the log stream was down. Returns how many."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)lost = [request_id for request_id, p in self.pending.items() if now - p.last_seen > LOST_AFTER_S]
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)for request_id in lost:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.pending[request_id].lost = True
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.metrics.errors["access_log_lost"] += 1
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self._finish(request_id)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return len(lost)

    # ------------------------------------------------------------------ observe stream

    def observe_start(self, request_id: str, status: int, served: str) -> str | None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""The response begins (first body chunk): None when the request is not ours to track."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)pending = self.pending.get(request_id)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if pending is None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    log.debug("response_not_tracked", request_id=request_id, status=status, served=served)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return None
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)pending.status = status
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)pending.served = served
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return request_id

    def observe_body(self, request_id: str, chunk: bytes, end_of_stream: bool) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)pending = self.pending.get(request_id)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if pending is None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)pending.last_seen = time.monotonic()
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if chunk:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    if not pending.chunks:  # SSE starts with "data:", "event:" or ":"; JSON with "{"
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        pending.event_stream = not chunk.lstrip().startswith(b"{")
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    pending.chunks.append(chunk)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    pending.size += len(chunk)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    if pending.event_stream:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        while pending.size - len(pending.chunks[0]) >= SSE_TAIL_BYTES:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)            pending.size -= len(pending.chunks.popleft())
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    elif pending.size > MAX_JSON_RESPONSE_BYTES:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        pending.chunks.clear()
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if end_of_stream:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    pending.observed_end = pending.answered = True
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    if pending.logged:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        if pending.timer is not None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)            pending.timer.cancel()
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        self._finish(request_id)

    def response_headers_answer(self, request_id: str | None) -> bytes:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""An Endpoint Picker's answer to the response headers (x-routed-to, x-route-reason
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)added for a tracked request)."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)pending = self.pending.get(request_id) if request_id is not None else None
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if pending is None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return RESPONSE_HEADERS_CONTINUE
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return self.answers.response(pending.decision.replica, pending.decision.reason)

    def stream_ended(self, request_id: str) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""An Endpoint Picker's stream for the request closed (Envoy ends it with the HTTP
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)request): over, as abandoned unless its answer passed whole."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if request_id in self.pending:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self._finish(request_id)

    # ------------------------------------------------------------------ the end

    def _finish(self, request_id: str) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)pending = self.pending.pop(request_id, None)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if pending is None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if self.envoy_ids.get(pending.envoy_id) == request_id:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    del self.envoy_ids[pending.envoy_id]
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)decision = pending.decision
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)failed_over = not pending.not_applied and bool(pending.served) and pending.served != pending.endpoint
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)# ok: a whole 2xx answer from the pick; failed_over: a whole 2xx answer from a fallback
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)# (the pick refused; placement memory now points where the cache went); failed: an error
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)# status; abandoned: the request ended before its answer did (the client hung up, or the
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)# upstream broke off).
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)succeeded = pending.answered and 200 <= pending.status < 300
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if pending.not_applied:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    outcome = "not_applied"
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)elif not pending.answered:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    outcome = "abandoned"
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)elif not succeeded:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    outcome = "failed"
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)else:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    outcome = "failed_over" if failed_over else "ok"
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)served_replica = self._served_replica(pending)  # a name, or the address when it is no replica of ours
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)waiting = self.unanswered.get(pending.request.conversation)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if waiting is not None and waiting.pop(request_id, None) is not None and not waiting:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    del self.unanswered[pending.request.conversation]
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self._complete(  # a no-op when a later turn released it already
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    request_id,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    pending.request,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    ok=succeeded,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    served=served_replica if failed_over and served_replica in self.endpoints else None,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots))
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.metrics.completed[outcome] += 1
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)refused = pending.answered and pending.status in (502, 503) and not pending.served
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)# 504 from the pick itself: it took the request and sent nothing until Envoy's stream idle
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)# timeout (a hung server). Avoided until its /health answers, like a refusing one.
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)silent = pending.status == 504 and pending.served == pending.endpoint
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if failed_over or ((refused or silent) and not pending.not_applied):
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.metrics.errors["replica_timed_out" if silent else "replica_failed"] += 1
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.mark_unhealthy(decision.replica)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)timings = pending.timings
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if pending.observed_end and pending.chunks:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    timings = parse_timings(b"".join(pending.chunks), pending.event_stream)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if timings is not None and timings.cache_n is not None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    learnt = answer_timings(timings)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.router.report_cached(pending.request, served_replica, decision.predicted_cached_tokens,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)                              timings.cache_n, learnt)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    if self.store is not None and self.router.speeds.learning and served_replica in self.router.replicas:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        self.store.answered(served_replica, learnt)  # the other routers learn from it too
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.metrics.cache_tokens(
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        served_replica,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        decision.predicted_cached_tokens,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        timings.cache_n,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        timings.cache_n + (timings.prompt_n or 0),
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    )
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self._log(request_id, pending, outcome, served_replica, timings)

    def _served_replica(self, pending: Pending) -> str:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if not pending.served or pending.served == pending.endpoint:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return pending.decision.replica
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)for name, endpoint in self.endpoints.items():
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    if endpoint == pending.served:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)        return name
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return pending.served

    def _log(
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self, request_id: str, pending: Pending, outcome: str, served_replica: str, timings: Timings | None
    ) -> None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)decision = pending.decision
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)fields: dict[str, Any] = {
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "request_id": request_id,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "envoy_request_id": pending.envoy_id,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "conversation": pending.request.conversation,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "turn": pending.turn,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "path": pending.path,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "stream": pending.stream,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "replica": decision.replica,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "endpoint": pending.endpoint,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "reason": decision.reason,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "policy": decision.trace.policy,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "prompt_tokens": pending.request.prompt_tokens,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "max_tokens": pending.request.max_tokens,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "cost": decision.cost,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "charged_tokens": decision.charged_tokens,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "predicted_cached_tokens": decision.predicted_cached_tokens,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "trace": decision.trace.as_dict(),
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "outcome": outcome,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "status": pending.status,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "served": pending.served,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "served_replica": served_replica if pending.served else "",
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    "duration_ms": round((time.perf_counter() - pending.started) * 1000, 3),
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)}
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if pending.lost:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    fields["access_log_lost"] = True
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if pending.released_by_next_turn:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    fields["released_by_next_turn"] = True
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if timings is not None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    fields.update(timings.as_dict())
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)log.info("route_decision", **fields)

    # ------------------------------------------------------------------ helpers

    def _parse(
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self, path: str, content_type: str, body: bytes, done: ParsedRequest | BadRequest | None
    ) -> ParsedRequest:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if isinstance(done, BadRequest):
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    raise done
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if done is not None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return done
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)block_chars = self.router.policy.prefix_block_chars
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if block_chars and (self.block_memory is None or self.block_memory.block_chars != block_chars):
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    self.block_memory = BlockMemory(block_chars)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return parse_request(path, content_type, body, self.limits, block_chars, self.block_memory, self.counter)

    def _request_id(self) -> str:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self._sequence += 1
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return f"{self._id_prefix}{self._sequence:x}"

    def _pick_answer(
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self, replica: str, reason: str, streamed: bool, phase: Phase, subset: frozenset[str] | None
    ) -> bytes:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""The answer for a pick: kept for reuse, unless the gateway named a subset (the
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)fallbacks must come from it too)."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)if subset is None:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)    return self.answers.route(replica, reason, streamed, self._destination, phase)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return route_answer(self._destination(replica, subset), replica, reason, streamed, phase,
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)                    self.settings.routing_headers)

    def _destination(self, replica: str, subset: frozenset[str] | None = None) -> str:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""The pick's endpoint, then up to service.fallbacks healthy others (in name order
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)after it, of the subset when one is named): where Envoy retries when the pick refuses."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)names = sorted(self.endpoints)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)start = names.index(replica)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)fallbacks = [n for n in names[start + 1 :] + names[:start]
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)             if n not in self.unhealthy and (subset is None or self.endpoints[n] in subset)]
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return ",".join([self.endpoints[replica]] + [self.endpoints[n] for n in fallbacks[: self.settings.fallbacks]])

    def _remember_envoy_id(self, envoy_id: str, request_id: str) -> str:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)"""Envoy's id for the request (bounded), mapped to ours until it ends. A client may
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)reuse an id: the newest request holds it, an older one ends by its own id (or as lost)."""
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)envoy_id = bounded(envoy_id)
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)self.envoy_ids[envoy_id] = request_id
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return envoy_id


def answer_timings(timings: Timings) -> AnswerTimings:
    """The figures the router learns a replica's speed from; a missing one as -1 (ignored)."""
    def known(value: float | None) -> float:
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)return -1.0 if value is None else value

    return AnswerTimings(int(known(timings.prompt_n)), known(timings.prompt_ms), int(known(timings.predicted_n)),
 replica -> the openings of the last prompts sent to it, one per slot (routing.replica_slots)                 known(timings.predicted_ms), int(known(timings.cache_n)))
