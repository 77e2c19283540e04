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

The clocks are ``clock.TwoPhaseClock``'s, as in ``replica``, but each phase is paced by the
requests in it alone, and the host's cores do not slow a GPU.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable

from extproc.sim.clock import TwoPhaseClock
from extproc.sim.costmodel import CostModel
from extproc.sim.prompts import BLOCK_TOKENS
from extproc.sim.request import Request

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

    def add_cached(self, blocks: Blocks) -> bool:
        """The blocks as a finished request leaves them (cached, evictable, the tail first in line),
        into the pool's room only, as many leading blocks as fit: a migration does not evict the
        receiver's own caches, which are as recent as the moved one (evicting them cost more
        cached share than the moves won, on the Mooncake trace)."""
        room = self.capacity - self.used
        landing = []
        for block, tokens in blocks:
            if block in self:
                continue
            if tokens > room:
                break
            landing.append((block, tokens))
            room -= tokens
        for block, tokens in reversed(landing):
            self.free[block] = tokens
            self.used += tokens
            self.free_tokens += tokens
        return bool(landing)

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


class PagedReplica(TwoPhaseClock):
    __slots__ = ("name", "pool", "block_tokens", "max_running", "queue", "version", "draining", "held")

    def __init__(self, name: str, cost: CostModel) -> None:
        server = cost.server
        assert server is not None and server.kv_cache == "paged"
        super().__init__(cost, server.max_running)
        self.name = name
        self.pool = BlockPool(server.kv_capacity_tokens)
        self.block_tokens = server.block_tokens
        self.max_running = server.max_running
        self.queue: deque[Request] = deque()
        self.version = 0
        self.draining = False
        self.held: dict[Request, tuple[Blocks, int]] = {}  # running request -> its blocks, private tokens

    def sharing(self) -> tuple[int, int, float]:
        # one prefill stream, one decode batch, each paced by its own requests; GPUs do not share the host's cores
        return len(self.prefilling), len(self.decoding), 1.0

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
        finished = self.end_phases(now)
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
        self.start_prefill(request, hit, now)
        return True

    def pooled_prefix_tokens(self, request: Request) -> int:
        """Leading tokens of ``request``'s prompt whose blocks the pool holds (cached or referenced)."""
        blocks, _ = self._blocks(request)
        tokens = 0
        for block, size in blocks:
            if block not in self.pool:
                break
            tokens += size
        return tokens

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

