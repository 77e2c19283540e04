"""One simulated paged-KV GPU server (vLLM-like): a token pool shared by every running request.

What it models, and what it leaves out:

- **Memory.** One pool of ``kv_capacity_tokens`` holds the KV of every running request and,
  in the space left, the prompt blocks of finished ones. A request reserves its whole
  prompt and output when it starts (no preemption: an engine that allocates as it goes
  and preempts would start requests earlier and sometimes recompute them).
- **Prefix sharing.** A prompt is a chain of blocks (a trace's hash ids of 512-token
  blocks; a profile conversation's blocks are (conversation, index)). A new request
  reuses the longest run of leading blocks present in the pool, whether a running
  request holds them or they wait unreferenced; the rest is computed and stored as new
  blocks. Sizes are rounded up to ``block_tokens``.
- **Eviction.** Unreferenced blocks leave least recently freed first; a finished
  request's blocks are freed tail first, so a conversation's opening outlives its end
  (as vLLM v1's free-block queue does).
- **Admission.** First come, first served: the head of the queue starts when fewer than
  ``max_running`` requests run and its new blocks fit after evicting unreferenced ones;
  nobody overtakes it.
- **Speed.** Prefill is compute-bound: the prefilling requests share one prefill stream
  (``prefill_slowdown[n]`` with n prefilling requests, from the cost model). Decode steps
  batch every decoding request: each runs ``decode_slowdown[n]`` times slower than alone
  with n decoding. The two phases do not slow each other (an engine with chunked prefill
  mixes them in one step: decode steps are slower while prompts are prefilled).

The clocks work as in ``replica``: per phase, solo seconds done since the start; each
request holds the clock value at which its phase ends; lists sorted by it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Hashable

from extproc.sim.costmodel import CostModel
from extproc.sim.prompts import BLOCK_TOKENS
from extproc.sim.replica import DONE_EPSILON, Request, start_order, start_prefill

Blocks = list[tuple[Hashable, int]]  # (block id, tokens) in prompt order


class BlockPool:
    """The KV pool: referenced blocks, unreferenced (evictable) blocks in LRU order, private tokens."""

    __slots__ = ("capacity", "refs", "sizes", "free", "used", "free_tokens")

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self.refs: dict[Hashable, int] = {}  # block -> running requests using it
        self.sizes: dict[Hashable, int] = {}  # referenced block -> tokens
        self.free: OrderedDict[Hashable, int] = OrderedDict()  # unreferenced block -> tokens, evicted first first
        self.used = 0  # tokens held: every block (referenced or not) + running requests' private tokens
        self.free_tokens = 0

    def __contains__(self, block: Hashable) -> bool:
        return block in self.refs or block in self.free

    def plan(self, blocks: Blocks, private: int) -> tuple[int, int] | None:
        """(leading tokens already held, tokens to add) if the request fits now, else None."""
        refs, free = self.refs, self.free
        hit, matching, add, pinned_free = 0, True, private, 0
        for block, tokens in blocks:
            if block in refs:
                hit += tokens if matching else 0
            elif block in free:
                pinned_free += free[block]  # what taking it frees up counts as stored (a tail may be shorter)
                hit += tokens if matching else 0
            else:
                matching = False
                add += tokens
        # what running requests hold (and the free blocks this one will take) cannot be evicted
        if add > self.capacity - (self.used - self.free_tokens) - pinned_free:
            return None
        return hit, add

    def take(self, blocks: Blocks, private: int, add: int) -> None:
        """Reference the request's blocks (held ones shared, new ones stored) and its private tokens."""
        refs, sizes, free = self.refs, self.sizes, self.free
        for block, tokens in blocks:
            if block in refs:
                refs[block] += 1
            elif block in free:
                tokens = free.pop(block)
                self.free_tokens -= tokens
                refs[block], sizes[block] = 1, tokens
        while self.used + add > self.capacity:  # plan() checked that evicting free blocks suffices
            _, tokens = free.popitem(last=False)
            self.used -= tokens
            self.free_tokens -= tokens
        for block, tokens in blocks:
            if block not in refs:
                refs[block], sizes[block] = 1, tokens
                self.used += tokens
        self.used += private

    def give_back(self, blocks: Blocks, private: int) -> None:
        """A request ended: its private tokens go, its blocks stay cached (tail first in line to go)."""
        refs, sizes, free = self.refs, self.sizes, self.free
        self.used -= private
        for block, _ in reversed(blocks):
            count = refs[block] - 1
            if count:
                refs[block] = count
                continue
            del refs[block]
            tokens = free[block] = sizes.pop(block)
            self.free_tokens += tokens


class PagedReplica:
    __slots__ = ("name", "cost", "pool", "block_tokens", "max_running", "queue", "running", "started",
                 "prefilling", "prefill_targets", "decoding", "decode_targets", "updated_at", "version",
                 "draining", "prefill_clock", "decode_clock", "host_factor", "prefill_slowdown",
                 "decode_slowdown", "held")

    def __init__(self, name: str, cost: CostModel) -> None:
        server = cost.server
        assert server is not None and server.kv_cache == "paged"
        self.name = name
        self.cost = cost
        self.pool = BlockPool(server.kv_capacity_tokens)
        self.block_tokens = server.block_tokens
        self.max_running = server.max_running
        self.queue: deque[Request] = deque()
        self.running = 0
        self.started = 0
        self.prefilling: list[Request] = []
        self.prefill_targets: list[float] = []
        self.decoding: list[Request] = []
        self.decode_targets: list[float] = []
        self.updated_at = 0.0
        self.version = 0
        self.draining = False
        self.prefill_clock = 0.0
        self.decode_clock = 0.0
        self.host_factor = 1.0  # GPUs do not share the host's cores
        self.prefill_slowdown, self.decode_slowdown = cost.slowdowns(server.max_running)
        self.held: dict[Request, tuple[Blocks, int]] = {}  # running request -> its blocks, private tokens

    def advance(self, now: float) -> None:
        if now > self.updated_at:
            elapsed = now - self.updated_at
            if self.prefilling:
                self.prefill_clock += elapsed / self.prefill_slowdown[len(self.prefilling)]
            if self.decoding:
                self.decode_clock += elapsed / self.decode_slowdown[len(self.decoding)]
        self.updated_at = now

    def next_change(self) -> float | None:
        """Seconds from ``updated_at`` until the next request ends a phase (None when idle)."""
        wait = None
        if self.decoding:
            wait = (self.decode_targets[0] - self.decode_clock) * self.decode_slowdown[len(self.decoding)]
        if self.prefilling:
            prefill_wait = (self.prefill_targets[0] - self.prefill_clock) * self.prefill_slowdown[len(self.prefilling)]
            if wait is None or prefill_wait <= wait:
                return prefill_wait
        return wait

    def arrive(self, request: Request, now: float) -> bool:
        """Start the request if nobody waits and it fits, else queue it (FIFO)."""
        if self.queue:
            self.queue.append(request)
            return False
        self.advance(now)
        if self._try_start(request, now):
            return True
        self.queue.append(request)
        return False

    def wake(self, now: float) -> list[Request]:
        """Advance to ``now``; prefills that ended start decoding; finished requests leave (start order)."""
        self.advance(now)
        prefill_targets, decode_targets = self.prefill_targets, self.decode_targets
        while prefill_targets and prefill_targets[0] - self.prefill_clock <= DONE_EPSILON:
            del prefill_targets[0]
            request = self.prefilling.pop(0)
            request.first_token_at = now
            request.target = target = self.decode_clock + self.cost.decode_s(request.max_tokens, request.prompt_tokens)
            index = bisect_right(decode_targets, target)
            decode_targets.insert(index, target)
            self.decoding.insert(index, request)
        finished = []
        while decode_targets and decode_targets[0] - self.decode_clock <= DONE_EPSILON:
            del decode_targets[0]
            finished.append(self.decoding.pop(0))
        finished.sort(key=start_order)
        for request in finished:
            request.finished_at = now
            blocks, private = self.held.pop(request)
            self.pool.give_back(blocks, private)
        self.running -= len(finished)
        queue = self.queue
        while queue and self._try_start(queue[0], now):
            queue.popleft()
        return finished

    def _try_start(self, request: Request, now: float) -> bool:
        if self.running >= self.max_running:
            return False
        blocks, private = self._blocks(request)
        plan = self.pool.plan(blocks, private)
        if plan is None:
            return False
        hit, add = plan
        self.pool.take(blocks, private, add)
        self.held[request] = (blocks, private)
        start_prefill(self, request, hit, now)
        return True

    def _blocks(self, request: Request) -> tuple[Blocks, int]:
        """The prompt's blocks with their sizes (rounded up to block_tokens), and the private tokens
        (output, and any prompt tail the block list does not cover)."""
        prompt, unit = request.prompt_tokens, self.block_tokens
        ids: tuple[Hashable, ...] | None = request.blocks
        if ids is None:  # a profile conversation: one growing prefix; a partial tail block is its own
            full = prompt // BLOCK_TOKENS
            ids = tuple((request.key, index) for index in range(full))
            if prompt > full * BLOCK_TOKENS:
                ids += ((request.key, full, prompt),)
        blocks: Blocks = []
        seen: set[Hashable] = set()
        covered = 0
        for index, block in enumerate(ids):
            tokens = min(BLOCK_TOKENS, prompt - index * BLOCK_TOKENS)
            if tokens <= 0 or block in seen:  # a repeated id cannot hold two different contents
                break
            seen.add(block)
            blocks.append((block, -(-tokens // unit) * unit))
            covered += tokens
        private = prompt - covered + request.max_tokens
        return blocks, -(-private // unit) * unit

