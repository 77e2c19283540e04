"""What keeps the prefix index in step with the replicas: the prompts sent and how their
requests ended, migrations, the replicas' reports of their cached tokens (``prefix_feedback``),
and the changes several routers share. The Router feeds it (plugin.py: SentView, SharedView,
CacheMoves, CacheReports)."""

from __future__ import annotations

from collections.abc import Iterable

from extproc.routing.decision import Decision, RouteRequest
from extproc.routing.policies.llm_aware.trace import LlmAwareTrace
from extproc.routing.prefix_index import IndexChange, PrefixIndex


class IndexView:
    def __init__(self, index: PrefixIndex, feedback: bool) -> None:
        self.index = index
        self.feedback = feedback
        # request in flight -> (its replica, the blocks that replica held before it)
        self.held_before: dict[str, tuple[str, int]] = {}

    def routed(self, request: RouteRequest, decision: Decision) -> None:
        blocks = request.prefix_blocks
        if blocks:
            details = decision.trace.details
            # the holders entered, deepest first: the pick's held blocks when it heads them
            listed = details.candidates if isinstance(details, LlmAwareTrace) else ()
            held = listed[0].matched_blocks if listed and listed[0].replica == decision.replica else None
            if held is None:
                held = self.index.held_prefix(decision.replica, blocks)
            self.held_before[request.request_id] = (decision.replica, held)
            self.index.add_prompt(decision.replica, blocks, max(1, request.prompt_tokens // len(blocks)), held)

    def completed(self, request: RouteRequest, decision: Decision, ok: bool) -> None:
        """A server cannot evict a running request's blocks and frees them, as its most recent,
        when it ends (vLLM's free-block queue): the prompt is refreshed, if the index still holds
        it (if not, requests sent after it have taken its place, as in a llama.cpp slot). A failed
        request cached nothing (a prompt longer than the context is refused whole): its new blocks
        are forgotten, as placement memory remembers only a success."""
        before = self.held_before.pop(request.request_id, None)
        if ok:
            self.index.touch(decision.replica, request.prefix_blocks)
        elif before is not None:
            self.index.forget(decision.replica, request.prefix_blocks, before[1])

    def share_changes(self, on: bool) -> None:
        """Several routers keep their indexes alike (a store): from now on (``on``) the index's
        changes are kept until ``changes`` takes them."""
        self.index.journal = [] if on else None

    def changes(self) -> list[IndexChange]:
        journal = self.index.journal
        if not journal:
            return []
        self.index.journal = []
        return journal

    def apply_changes(self, changes: Iterable[IndexChange]) -> None:
        self.index.apply(changes)

    def moved(self, blocks: tuple[int, ...], tokens: int, source: str | None, receiver: str) -> None:
        """A migration restored the prompt's cache on ``receiver``: it holds those blocks now,
        and ``source`` (which leaves) no longer counts as holding them, or the next turn would
        look cached on both and go to whichever the ring prefers."""
        if not blocks:
            return
        self.index.add_prompt(receiver, blocks, max(1, tokens // len(blocks)))
        if source is not None and source != receiver:
            self.index.forget(source, blocks, 0)

    def set_replicas(self, replicas: tuple[str, ...]) -> None:
        """The requests in flight on a replica that left are never completed (the router drops them)."""
        self.index.set_replicas(replicas)
        kept = set(replicas)
        self.held_before = {request: before for request, before in self.held_before.items() if before[0] in kept}

    def reported(self, request: RouteRequest, replica: str, predicted: int, cached: int) -> None:
        """``replica`` served ``request`` from ``cached`` cached tokens; ``predicted`` were expected.

        Whole blocks missing mean the replica forgot them while the index still held them: it
        holds fewer tokens than the index believes, so its capacity is lowered by as many (the
        request's own blocks stay: serving it cached them again). Whole blocks more than
        predicted raise it again (a pool that was full of running requests has room again)."""
        blocks, prompt = request.prefix_blocks, request.prompt_tokens
        if not (self.feedback and blocks and prompt and cached >= 0):
            return
        count = len(blocks)
        # whole blocks, rounded up: the blocks may cover less than the prompt (a paged server
        # caches whole blocks only), so rounding down would count one it holds as missing
        expected, found = -(-predicted * count // prompt), -(-cached * count // prompt)
        self.index.resize(replica, (found - expected) * max(1, prompt // count), floor=prompt)
