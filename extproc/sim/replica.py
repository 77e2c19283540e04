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

from extproc.sim.clock import TwoPhaseClock
from extproc.sim.costmodel import CostModel
from extproc.sim.prompts import HostCache, common_prefix
from extproc.sim.request import Request, Slot

SLOT_SIMILARITY = 0.1  # llama.cpp --slot-prompt-similarity default
SAVE_BELOW_KEEP = 0.5  # a slot's content is saved to host RAM when a prompt keeps less than this share


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

    def forget(self, model: int) -> None:
        """Router mode: the model seeded ``model`` was unloaded; its slots' content and host-RAM
        entries (keys ``router_mode.model_key``) are gone with its process. Its slots are idle."""
        def owned(key: Hashable) -> bool:
            return isinstance(key, tuple) and key[0] == model

        for slot in self.slots:
            if owned(slot.key):
                slot.key, slot.blocks, slot.tokens = None, None, 0
        self.cache.forget(owned)

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
