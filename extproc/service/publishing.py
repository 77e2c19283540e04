"""What this router tells the other routers on the same shared store (store.url set, store.py)
and learns from them: its own load, its requests waiting for an answer, where a conversation's
cache went once a request is over, and the speeds its answers reported. Without a store
(``store`` None) nothing is published."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from extproc.routing import Router, estimate_tokens
from extproc.routing.peers import PeerRequest
from extproc.routing.placement import Placement
from extproc.routing.speeds import AnswerTimings
from extproc.service.lifecycle import Pending
from extproc.service.metrics import Metrics
from extproc.service.store import EntryBounds, SharedStore
from extproc.settings import ServiceSettings, StoreSettings

TEMPLATE_OPENING_TOKENS = 1024  # what a chat template may add before the first message (a default system prompt)


class Publishing:
    def __init__(self, router: Router, service: ServiceSettings, metrics: Metrics,
                 waiting: Callable[[], Iterable[tuple[str, int]]], pending: Callable[[str], Pending]) -> None:
        """waiting: this router's requests waiting for an answer, (id, history); pending: a routed request by id."""
        self.router = router
        self.service = service
        self.metrics = metrics
        self.waiting = waiting
        self.pending = pending
        self.store: SharedStore | None = None

    async def share_state(self, settings: StoreSettings, router_id: str) -> None:
        """Agree with the other routers on the same store (main.py, when store.url is set). A store
        that does not answer now leaves this router on its own state until a retry succeeds."""
        service = self.service
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
        for request_id, history in self.waiting():
            self.routed(request_id, history)

    def routed(self, request_id: str, history: int) -> None:
        """A request routed, waiting for its answer (``history``: the messages its body held)."""
        if self.store is None:
            return
        pending = self.pending(request_id)
        request, decision = pending.request, pending.decision
        self.store.routed(
            pending.ticket.key, request_id,
            PeerRequest(self.store.router_id, decision.replica, decision.charged_tokens, request.prompt_tokens,
                        history),
        )  # fmt: skip

    def completed(self, pending: Pending, key: int, ok: bool, served: str | None) -> None:
        """A request's load released: where its conversation's cache went, when it succeeded."""
        if self.store is None:
            return
        request, placement = pending.request, None
        if ok:  # overtaken: the move's placement again, under this request's digest (the move's is older)
            moved = self.router.memory.get(key) if pending.ticket.overtaken else None
            placement = moved or Placement(served or pending.decision.replica, request.prompt_tokens)
        self.store.completed(key, request.request_id, placement, pending.shown.digest, pending.continued)

    def answered(self, served_replica: str, learnt: AnswerTimings) -> None:
        """What an answer taught of its replica's speed: the other routers learn from it too."""
        if self.store is not None and self.router.speeds.learning and served_replica in self.router.replicas:
            self.store.answered(served_replica, learnt)
