"""One simulated llama.cpp replica: slots that keep a prefix, a FIFO queue, a host-RAM cache.

Requests run in two phases, prefill then decode, each a fixed amount of "solo" work
from the cost model. The slots share one CPU: with k busy slots every request runs
``slowdown[phase][k]`` times slower than alone (processor sharing). Since all requests
in a phase progress at the same rate, the replica keeps one clock per phase (solo
seconds a request in that phase has done since the start) and each request the clock
value at which its phase ends: advancing time is O(1), and the engine needs one
pending wake-up per replica, not one event per token. For the same reason the requests
of a phase end in the order of those clock values: each phase keeps its requests
sorted by them, so the next phase change is read off the front of two lists.

Slot choice follows llama.cpp's server: the idle slot whose content covers the largest
share of the prompt (more than 10 %), else the least recently used idle slot; then the
host-RAM cache is consulted (see ``prompts``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Hashable
from typing import Protocol

from extproc.routing import RouteRequest
from extproc.sim.costmodel import CostModel
from extproc.sim.prompts import BLOCK_TOKENS, HostCache, common_prefix

SLOT_SIMILARITY = 0.1  # llama.cpp --slot-prompt-similarity default
SAVE_BELOW_KEEP = 0.5  # a slot's content is saved to host RAM when a prompt keeps less than this share
DONE_EPSILON = 1e-7  # solo seconds below which a phase counts as finished (float rounding of the clocks)


class Request:
    """One request through the whole simulation: its input, then what happened to it."""

    __slots__ = (
        "route", "request_id", "conversation", "turn", "key", "blocks", "prompt_tokens", "max_tokens", "arrival_s",
        "think_s", "next", "previous", "sides", "waiting", "head", "replica", "reason", "predicted_cached",
        "cache_n", "prompt_n", "arrived_at", "started_at", "first_token_at", "finished_at", "status", "error",
        "order", "target", "slot",
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


class Replica:
    __slots__ = ("name", "cost", "slots", "slot_count", "queue", "running", "started", "prefilling",
                 "prefill_targets", "decoding", "decode_targets", "updated_at", "version", "cache",
                 "prefill_slowdown", "decode_slowdown", "draining", "prefill_clock", "decode_clock", "host_factor")

    def __init__(self, name: str, cost: CostModel, slots: int, cache_tokens: int) -> None:
        self.name = name
        self.cost = cost
        self.slots = [Slot() for _ in range(slots)]
        self.slot_count = slots
        self.queue: deque[Request] = deque()
        self.running = 0  # requests holding a slot (k)
        self.started = 0  # requests ever started (orders them)
        # running requests per phase, sorted by target (the order their phase ends), and their targets
        self.prefilling: list[Request] = []
        self.prefill_targets: list[float] = []
        self.decoding: list[Request] = []
        self.decode_targets: list[float] = []
        self.updated_at = 0.0
        self.version = 0  # sequence number of the pending wake-up: older ones are stale
        self.cache = HostCache(cache_tokens)
        self.prefill_slowdown, self.decode_slowdown = cost.slowdowns(slots)
        self.draining = False  # removed from the router; finishes what it holds
        self.prefill_clock = 0.0
        self.decode_clock = 0.0
        self.host_factor = 1.0  # >1 when busy replicas want more CPU threads than the host has

    def advance(self, now: float) -> None:
        """Move the phase clocks up to ``now`` at the current sharing rate."""
        k = self.running
        if k and now > self.updated_at:
            elapsed = (now - self.updated_at) / self.host_factor
            self.prefill_clock += elapsed / self.prefill_slowdown[k]
            self.decode_clock += elapsed / self.decode_slowdown[k]
        self.updated_at = now

    def next_change(self) -> float | None:
        """Seconds from ``updated_at`` until the next request ends a phase (None when idle)."""
        k = self.running
        if not k:
            return None
        prefill_targets, decode_targets = self.prefill_targets, self.decode_targets
        if not decode_targets:
            return (prefill_targets[0] - self.prefill_clock) * (self.prefill_slowdown[k] * self.host_factor)
        wait = (decode_targets[0] - self.decode_clock) * (self.decode_slowdown[k] * self.host_factor)
        if prefill_targets:
            prefill_wait = (prefill_targets[0] - self.prefill_clock) * (self.prefill_slowdown[k] * self.host_factor)
            if prefill_wait <= wait:
                return prefill_wait
        return wait

    def arrive(self, request: Request, now: float) -> bool:
        """A routed request arrives at ``now``: start it on an idle slot, or queue it (FIFO).

        Returns whether it started. A queued request leaves the clocks alone: nothing that
        runs changes pace, so the pending wake-up still holds (most arrivals of a loaded
        replica only queue).
        """
        k = self.running
        if k >= self.slot_count:
            self.queue.append(request)
            return False
        if k and now > self.updated_at:  # advance(now), inlined: this and wake() run on every event
            elapsed = (now - self.updated_at) / self.host_factor
            self.prefill_clock += elapsed / self.prefill_slowdown[k]
            self.decode_clock += elapsed / self.decode_slowdown[k]
        self.updated_at = now
        self._start(request, now)
        return True

    def wake(self, now: float) -> list[Request]:
        """Advance to ``now`` and move on the requests whose phase ran out.

        Returns those that finished (their slots freed and the queue served), in the
        order they were started.
        """
        k = self.running
        prefill_clock, decode_clock = self.prefill_clock, self.decode_clock
        if k and now > self.updated_at:  # advance(now), inlined
            elapsed = (now - self.updated_at) / self.host_factor
            self.prefill_clock = prefill_clock = prefill_clock + elapsed / self.prefill_slowdown[k]
            self.decode_clock = decode_clock = decode_clock + elapsed / self.decode_slowdown[k]
        self.updated_at = now
        prefill_targets, decode_targets = self.prefill_targets, self.decode_targets
        while prefill_targets and prefill_targets[0] - prefill_clock <= DONE_EPSILON:
            del prefill_targets[0]
            request = self.prefilling.pop(0)
            request.first_token_at = now
            request.target = target = decode_clock + self.cost.decode_s(request.max_tokens, request.prompt_tokens)
            index = bisect_right(decode_targets, target)  # the phase's lists stay sorted by target
            decode_targets.insert(index, target)
            self.decoding.insert(index, request)
        finished = []
        while decode_targets and decode_targets[0] - decode_clock <= DONE_EPSILON:
            del decode_targets[0]
            finished.append(self.decoding.pop(0))
        if not finished:
            return finished
        if len(finished) > 1:
            finished.sort(key=start_order)
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
        start_prefill(self, request, shared, now)

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


class Prefilling(Protocol):
    """What ``start_prefill`` needs of a replica (the llama.cpp and the paged one)."""

    cost: CostModel
    started: int
    running: int
    prefill_clock: float
    prefill_targets: list[float]
    prefilling: list[Request]


def start_prefill(replica: Prefilling, request: Request, hit: int, now: float) -> None:
    """The request starts at ``now`` with ``hit`` prompt tokens found cached: its prefill phase begins."""
    prompt = request.prompt_tokens
    cached = min(hit, prompt - 1)  # the last prompt token is always evaluated
    request.cache_n = cached
    request.prompt_n = prompt - cached
    request.started_at = now
    request.order = replica.started
    replica.started += 1
    replica.running += 1
    request.target = target = replica.prefill_clock + replica.cost.prefill_s(prompt - cached, cached)
    index = bisect_right(replica.prefill_targets, target)  # the phase's lists stay sorted by target
    replica.prefill_targets.insert(index, target)
    replica.prefilling.insert(index, request)


def start_order(request: Request) -> int:
    return request.order
