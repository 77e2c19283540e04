"""What a request means for its conversation, as one router holds it (pure: no I/O, no clock).

The gateway (extproc/service/gateway.py) asks it, around each request it routes:
  - which conversation the request is routed under (``claim_request``: its key under its model,
    the claim rule of continuation.py over the tips held here and the requests still in flight;
    ``claim`` again with the store's digest when the store knows the conversation);
  - what its body tells before it is routed: a branch it starts from a completed request
    (``branches``, ``branch``), the pending requests it shows answered (``answered``: the
    gateway releases them), the cache their last answer left (``holds_answer``);
  - what the pick holds of its opening (``with_opening``);
  - and at its end: its tips and branch point (``completed``), no longer waiting for a next
    turn (``settled``).
Its memories are bounded like placement memory. Placement memory itself stays the router's
(``memory``): a branch and an answer held write there, under the key the request carries. A claim
weighs conversations no request carries yet: it keys them as the router does (``stable_hash``
under the router's ``hash_seed``, given with the claim).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterator
from typing import NamedTuple

from extproc.routing.continuation import Claim, Shown, claim, model_point, of_model, shown, tips_after
from extproc.routing.decision import Decision
from extproc.routing.hashing import stable_hash
from extproc.routing.lru import TwoGenerationLru
from extproc.routing.placement import PlacementMemory
from extproc.routing.tokens import shared_opening


class Claimed(NamedTuple):
    """A request's place in its conversation, before the store has a say."""

    shown: Shown  # the body's history digests (continuation.py)
    claim: Claim  # the conversation it is routed under, and whether it continues a known one
    named: str  # the conversation it names (its id, or its opening's key), under its model


class Conversations:
    def __init__(self, capacity: int, memory: PlacementMemory) -> None:
        """capacity: how many conversations are remembered (routing.memory_capacity); memory: the
        router's placement memory."""
        self.memory = memory
        # conversation key -> the digests of its tips (continuation.py): who may use its placement
        self.digests: TwoGenerationLru[tuple[int, ...]] = TwoGenerationLru(capacity)
        # history digest of a completed chat request (under its model: model_point) -> where it was
        # served and its prompt tokens: where a branch of it (an edited or regenerated turn) finds its prefix cached
        self.branch_points = PlacementMemory(capacity)
        # conversation -> {request id: history} of pending requests not yet shown answered
        self.unanswered: dict[str, dict[str, int]] = {}
        # replica -> the openings of the last prompts sent to it, one per slot (Router.facts)
        self.openings: dict[str, deque[tuple[int, ...]]] = {}

    def forget(self) -> None:
        """Forget every conversation (a reset between experiment runs, which empties the replicas'
        caches): a conversation sent again under its id is then new, routed under its own key."""
        self.digests.clear()
        self.branch_points.clear()
        self.unanswered.clear()
        self.openings.clear()

    # ------------------------------------------------------------------ before a request is routed

    def claim_request(
        self, name: str, scope: str, opening_key: str, history: int, answered: frozenset[int], seed: int,
    ) -> Claimed:
        """The conversation a body is routed under. name: the id it names ("" for none: its
        opening's key names it); scope: its cache scope (adapters.scope); seed: the router's hash_seed."""
        digests = shown(history, answered, opening_key)
        named = of_model(scope, name or opening_key)
        return Claimed(digests, claim(named, opening_key, lambda key: self.known(key, seed), digests), named)

    def claim(
        self, named: str, opening_key: str, body: Shown, read: str, store_digest: int, seed: int,
    ) -> Claim:
        """A body's claim again, with the store's last digest of the conversation ``read`` known too."""

        def known(key: str) -> tuple[int, ...]:
            held = self.known(key, seed)
            return (store_digest, *held) if key == read else held

        return claim(named, opening_key, known, body)

    def known(self, conversation: str, seed: int) -> tuple[int, ...]:
        """The tips held for ``conversation`` (continuation.py; keyed under ``seed``), with the
        histories of its requests still waiting for their end: a next turn may come before Envoy's
        access log says its last request is over (after an agent's fan-out, its other requests ended)."""
        tips = self.digests.get(stable_hash(conversation, seed)) or ()
        waiting = self.unanswered.get(conversation)
        return (*tips, *waiting.values()) if waiting else tips

    @staticmethod
    def branches(claimed: Claim, history: int, answered: frozenset[int]) -> bool:
        """A chat body that may branch from a completed request: it continues nothing known, and
        names a conversation it does not continue (an edit, a regenerate, a retried message) or
        resends an earlier request with its answer. A new conversation that only shares an opening
        with others is routed on its own key, as any new one."""
        return bool(history) and not claimed.continues and (claimed.foreign or bool(answered))

    def branch(self, key: int, prefixes: frozenset[int], scope: str, live: Collection[str]) -> bool:
        """Whether a chat that continues no conversation known here but resends a completed request's
        whole history (an edited or regenerated turn, a retry of an earlier message, a new id on an
        old chat) starts where that history was served (one of ``live``), under its own key: placed
        with the proven prefix's tokens, it finds that cache, and its own completion never moves the
        conversation it branched from (docs/security.md#edited-histories). key: the chat's
        conversation key."""
        if self.memory.get(key) is not None:
            return False
        found = [point for digest in prefixes
                 if (point := self.branch_points.get(model_point(digest, scope))) is not None]
        best = max(found, key=lambda point: point.prompt_tokens, default=None)
        if best is None or best.replica not in live:
            return False
        self.memory.remember(key, best.replica, best.prompt_tokens)
        return True

    def answered(self, conversation: str, answered: frozenset[int]) -> list[str]:
        """The pending requests of ``conversation`` that a new body shows answered, no longer
        waiting: the caller releases them."""
        waiting = self.unanswered.get(conversation)
        if not waiting:
            return []
        done = [request_id for request_id, history in waiting.items() if history in answered]
        for request_id in done:
            del waiting[request_id]
        if not waiting:
            del self.unanswered[conversation]
        return done

    def holds_answer(self, key: int, prompt_tokens: int, answered_tokens: int) -> None:
        """The replica that served conversation ``key``'s last turn holds its prompt and the answer it
        wrote, all of this body's tokens up to that answer's end but its last token (sampled, never
        decoded: measured, cache_n = that count - 1): placement memory learns the longer figure,
        which is what the prediction and the cost count as cached there."""
        placement = self.memory.get(key)
        held = answered_tokens - 1
        if placement is not None and placement.prompt_tokens < held <= prompt_tokens:
            self.memory.remember(key, placement.replica, held)

    # ------------------------------------------------------------------ routed

    def with_opening(
        self, decision: Decision, opening: tuple[int, ...], prompt_tokens: int, in_flight: int, slots: int,
    ) -> int:
        """The prompt tokens predicted cached: the decision's, or what the pick shares with the last
        prompts sent to it when that is more: the chat template's opening and a common system
        prompt are cached for a new conversation too. llama.cpp gives a request the idle slot most
        like it, so only while a slot that holds a prompt is idle: fewer requests in flight there
        (``in_flight``, this one aside) than slots filled (of ``slots``). At most the prompt but
        one token: the replica computes one at least."""
        seen = self.openings.get(decision.replica)
        if seen is None or seen.maxlen != slots:
            seen = self.openings[decision.replica] = deque(seen or (), maxlen=slots)
        idle_filled = len(seen) > in_flight - 1
        shared = min(shared_opening(opening, seen), prompt_tokens - 1) if idle_filled else 0
        seen.append(opening)
        return max(shared, decision.predicted_cached_tokens)

    def set_replicas(self, names: Collection[str]) -> None:
        """The fleet changed: the openings sent to a replica gone are forgotten."""
        self.openings = {name: seen for name, seen in self.openings.items() if name in names}

    def sent(self, conversation: str, request_id: str, history: int) -> None:
        """A request of a chat (``history``: 0 for a completion) went out: it waits for its end,
        or for a next turn showing its answer."""
        if history:
            self.unanswered.setdefault(conversation, {})[request_id] = history

    def waiting(self) -> Iterator[tuple[str, int]]:
        """(request id, history) of every request still waiting for a next turn or its end."""
        for waiting in self.unanswered.values():
            yield from waiting.items()

    # ------------------------------------------------------------------ a request's end

    def settled(self, conversation: str, request_id: str) -> None:
        """The request is over: no longer waiting for a next turn to show its answer."""
        waiting = self.unanswered.get(conversation)
        if waiting is not None and waiting.pop(request_id, None) is not None and not waiting:
            del self.unanswered[conversation]

    def completed(self, key: int, body: Shown, replica: str, prompt_tokens: int, chat_scope: str | None) -> None:
        """A request under conversation ``key`` completed on ``replica``: its history is the newest
        tip; a chat's (``chat_scope``: its cache scope, None for a completion) is a branch point."""
        self.digests.put(key, tips_after(self.digests.get(key) or (), body))
        if chat_scope is not None:
            self.branch_points.remember(model_point(body.digest, chat_scope), replica, prompt_tokens)

    def last_tip(self, key: int) -> int:
        """The newest tip's digest of conversation ``key`` (0 when none is held)."""
        return (self.digests.get(key) or (0,))[-1]
