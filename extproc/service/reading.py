"""A request's body as the router sees it (``Prepared``), or the answer refusing it: the body
parsed (bodies.py), its model checked against the fleet's, its conversation claimed
(routing/conversations.py) and, with a store, the other routers' picture of it read (``peers``)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, replace

from extproc.routing import Router, RouteRequest
from extproc.routing.blocks import BlockMemory
from extproc.routing.continuation import Claim, Shown
from extproc.routing.conversations import Conversations
from extproc.routing.peers import PeerView, peer_view
from extproc.routing.tokens import TokenCounter
from extproc.service.answers import immediate
from extproc.service.bodies import BadRequest, BodyLimits, ParsedRequest, parse_request
from extproc.service.bounds import bounded, bounded_scope
from extproc.service.catalog import ModelCatalog
from extproc.service.local_answers import LocalAnswers
from extproc.service.metrics import Metrics
from extproc.service.migrations import Migrations
from extproc.service.sessions import SessionSources
from extproc.service.store import SharedStore
from extproc.settings import ServiceSettings

NO_PEERS = PeerView({}, None)  # the store is configured but not answering: this router's state alone


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


class RequestReader:
    def __init__(self, router: Router, settings: ServiceSettings, counter: TokenCounter, metrics: Metrics,
                 conversations: Conversations, migrations: Migrations, catalog: ModelCatalog,
                 local: LocalAnswers) -> None:
        """counter: how prompts are counted."""
        self.router = router
        self.settings = settings
        self.counter = counter
        self.metrics = metrics
        self.conversations = conversations
        self.migrations = migrations
        self.catalog = catalog
        self.local = local
        self.sessions = SessionSources.parse(settings.session_ids)  # where a conversation id comes from
        self.limits = BodyLimits(settings.max_messages, settings.max_prompt_chars, settings.max_output_tokens)
        self.block_memory: BlockMemory | None = None  # the last prompt's blocks per conversation, when hashed
        self._sequence = 0
        self._id_prefix = secrets.token_hex(3) + "-"  # ids differ across restarts of the service

    def prepare(
        self, path: str, content_type: str, session_headers: Mapping[str, str], body: bytes,
        parsed_elsewhere: ParsedRequest | BadRequest | None,
    ) -> Prepared | bytes:
        """The request as the router sees it, or the answer refusing it. session_headers: the
        request's headers of service.session_ids (name -> value); parsed_elsewhere: the body's
        parse_request result (or refusal) from offload.py."""
        try:
            parsed = self._parse(path, content_type, body, parsed_elsewhere)
        except BadRequest as exc:
            self.metrics.errors["bad_request"] += 1
            return immediate(exc.status, exc.message, exc.code, exc.param)
        if parsed.model and self.local.fleet.endpoints and not self.catalog.eligible(parsed.model):
            if self.catalog.known(parsed.model):
                return self.local.model_not_ready(parsed.model)
            return self.local.model_not_found(parsed.model)
        self._sequence += 1
        unique_id = f"{self._id_prefix}{self._sequence:x}"
        session = self.sessions.pick(session_headers, dict(parsed.sessions))
        digests, claimed, named = self.conversations.claim_request(
            bounded(session), bounded_scope(parsed.model, parsed.lora), parsed.opening_key, parsed.history,
            parsed.answered, self.router.settings.hash_seed)
        prompt_tokens = parsed.prompt_token_ids + parsed.prompt_tokens
        max_tokens = (parsed.max_tokens or self.settings.default_max_tokens) * parsed.prompts
        # its conversation's key, computed here once and carried by the request from here on
        request = RouteRequest(unique_id, claimed.conversation, prompt_tokens, max_tokens, parsed.prefix_blocks,
                               bounded(parsed.model), key=self.router.conversation_key(claimed.conversation))
        # under the key the router places it by (a reused id that does not continue its chat has its own)
        self.migrations.opened(request.key, parsed.opening_key, parsed.scope)
        return Prepared(request, parsed, path, digests, claimed, named)

    async def peers(self, step: Prepared, store: SharedStore) -> tuple[Prepared, PeerView]:
        """What the other live routers hold, for this request (nothing while the store is not in
        use). A request that does not continue the conversation the store knows under its key is
        routed under the next key (continuation.py): it gets the others' load, nothing of the conversation."""
        request = step.request
        snapshot = await store.read(request.key)
        if snapshot is None:
            return step, NO_PEERS
        if snapshot.placement is not None:  # the store's digest is known too, for the key it was read for
            claimed = self.conversations.claim(step.named, step.parsed.opening_key, step.shown, request.conversation,
                                               snapshot.digest, self.router.settings.hash_seed)
            if claimed.conversation != request.conversation:
                request = self.router.readdressed(request, claimed.conversation)
                step = replace(step, request=request, claim=claimed)
                self.migrations.opened(request.key, step.parsed.opening_key, step.parsed.scope)
                return step, peer_view(snapshot.loads, (), frozenset(), None)
            step = replace(step, claim=claimed)
        return step, peer_view(snapshot.loads, snapshot.pending, step.parsed.answered, snapshot.placement)

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
