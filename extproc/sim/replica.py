"""One simulated llama.cpp replica: slots that keep a prefix, a FIFO queue, a host-RAM cache.

Requests run in two phases, prefill then decode, on the clock of ``clock.TwoPhaseClock``.
The slots share one CPU: with k busy slots every request, in either phase, runs
``slowdown[phase][k]`` times slower than alone (processor sharing), and slower again by
the host's factor when the busy replicas want more threads than the host has cores.

Slot choice follows llama.cpp's server: the idle slot whose content covers the largest
share of the prompt (more than 10 %), else the least recently used idle slot; then the
host-RAM cache is consulted (see ``prompts``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

from extproc.routing import RouteRequest, Ticket
from extproc.sim.clock import TwoPhaseClock
from extproc.sim.costmodel import CostModel
from extproc.sim.prompts import BLOCK_TOKENS, HostCache, common_prefix

SLOT_SIMILARITY = 0.1  # llama.cpp --slot-prompt-similarity default
SAVE_BELOW_KEEP = 0.5  # a slot's content is saved to host RAM when a prompt keeps less than this share


class Request:
    """One request through the whole simulation: its input, then what happened to it."""

    __slots__ = (
        "route", "request_id", "conversation", "turn", "key", "blocks", "prompt_tokens", "max_tokens", "arrival_s",
        "think_s", "next", "previous", "sides", "waiting", "head", "replica", "reason", "predicted_cached",
        "cache_n", "prompt_n", "arrived_at", "started_at", "first_token_at", "finished_at", "status", "error",
        "order", "target", "slot", "ticket",
    )

    def __init__(
        self, request_id: str, conversation: str, turn: int, key: Hashable, blocks: tuple[int, ...] | None,
        prompt_tokens: int, max_tokens: int, arrival_s: float | None = None, think_s: float = 0.0,
    ) -> None:
        # built once, up front; block-aware policies see the trace's chained hashes of the full blocks
        full_blocks = blocks[: prompt_tokens // BLOCK_TOKENS] if blocks else ()
        self.route = RouteRequest(request_id, conversation, prompt_tokens, max_tokens, full_blocks)
        self.request_id = request_id
        self.conversation = conversation
        self.turn = turn  # 1-based
        self.key = key
        self.blocks = blocks
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.arrival_s = arrival_s  # open loop (traces): fixed arrival time
        self.think_s = think_s  # closed loop (profiles): pause after the previous turn's answer
        self.next: Request | None = None  # closed loop: the conversation's next turn
        self.previous: Request | None = None  # closed loop: the turn this one carries the answer of
        self.sides: tuple[Request, ...] = ()  # sent at the same moment on the same history (fan-out)
        self.waiting = 0  # with sides: requests of this turn not yet answered
        self.head: Request = self  # the turn a side belongs to (itself otherwise)
        self.ticket: Ticket | None = None  # the router's, from its decision to its release
        self.replica: str | None = None
        self.reason: str | None = None
        self.predicted_cached: int | None = None
        self.cache_n = 0
        self.prompt_n = 0
        self.arrived_at = 0.0
        self.started_at = 0.0
        self.first_token_at = 0.0
        self.finished_at = 0.0
        self.status = 0
        self.error: str | None = None
        self.order = 0  # the replica's start counter when it got a slot
        self.target = 0.0  # the replica's clock for its current phase when the phase is done
        self.slot: Slot | None = None


class Slot:
    __slots__ = ("key", "blocks", "tokens", "last_used", "busy")

    def __init__(self) -> None:
        self.key: Hashable = None
        self.blocks: tuple[int, ...] | None = None
        self.tokens = 0
        self.last_used = -1.0
        self.busy = False


class Replica(TwoPhaseClock):
    __slots__ = ("name", "slots", "slot_count", "queue", "version", "cache", "draining")

    def __init__(self, name: str, cost: CostModel, slots: int, cache_tokens: int) -> None:
        super().__init__(cost, slots)
        self.name = name
        self.slots = [Slot() for _ in range(slots)]
        self.slot_count = slots
        self.queue: deque[Request] = deque()
        self.version = 0  # sequence number of the pending wake-up: older ones are stale
        self.cache = HostCache(cache_tokens)
        self.draining = False  # removed from the router; finishes what it holds

    def sharing(self) -> tuple[int, int, float]:
        k = self.running  # requests holding a slot, in either phase, share the CPU
        return k, k, self.host_factor

    def arrive(self, request: Request, now: float) -> bool:
        """A routed request arrives at ``now``: start it on an idle slot, or queue it (FIFO).

        Returns whether it started. A queued request leaves the clocks alone: nothing that
        runs changes pace, so the pending wake-up still holds (most arrivals of a loaded
        replica only queue).
        """
        if self.running >= self.slot_count:
            self.queue.append(request)
            return False
        self.advance(now)
        self._start(request, now)
        return True

    def wake(self, now: float) -> list[Request]:
        """Advance to ``now`` and move on the requests whose phase ran out.

        Returns those that finished (their slots freed and the queue served), in the
        order they were started.
        """
        finished = self.end_phases(now)
        if not finished:
            return finished
        self.running -= len(finished)
        for request in finished:
            request.finished_at = now
            slot = request.slot
            assert slot is not None  # every running request holds a slot
            slot.busy = False
            slot.tokens = request.prompt_tokens + request.max_tokens
            slot.last_used = now
            request.slot = None
        queue = self.queue
        while queue and self.running < self.slot_count:
            self._start(queue.popleft(), now)
        return finished

    def _start(self, request: Request, now: float) -> None:
        slot, shared = self._pick_slot(request)
        key, blocks, prompt = request.key, request.blocks, request.prompt_tokens
        cache = self.cache
        if cache.capacity_tokens > 0:
            if slot.tokens and shared < SAVE_BELOW_KEEP * slot.tokens:
                cache.save(slot.key, slot.blocks, slot.tokens)
            keep = shared / slot.tokens if slot.tokens else -1.0
            entry = cache.take_best(key, blocks, prompt, keep, shared / prompt)
            if entry is not None:
                slot.key, slot.blocks, slot.tokens = entry
                shared = common_prefix(slot.key, slot.blocks, slot.tokens, key, blocks, prompt)
        request.slot = slot
        slot.busy = True
        slot.key, slot.blocks, slot.tokens = key, blocks, prompt
        self.start_prefill(request, shared, now)

    def _pick_slot(self, request: Request) -> tuple[Slot, int]:
        """The idle slot to use, and the tokens of the prompt it already holds."""
        best, best_sim, best_shared, lru = None, SLOT_SIMILARITY, 0, None
        key, blocks, prompt = request.key, request.blocks, request.prompt_tokens
        for slot in self.slots:
            if slot.busy:
                continue
            if slot.key == key:
                shared = common_prefix(slot.key, slot.blocks, slot.tokens, key, blocks, prompt)
                if shared / prompt > best_sim:
                    best, best_sim, best_shared = slot, shared / prompt, shared
            if lru is None or slot.last_used < lru.last_used:
                lru = slot
        if best is not None:
            return best, best_shared
        assert lru is not None  # a free slot exists when called
        return lru, common_prefix(lru.key, lru.blocks, lru.tokens, key, blocks, prompt) if lru.key == key else 0
