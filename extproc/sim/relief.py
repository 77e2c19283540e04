"""Hot-spot relief in the simulator (docs/migration.md): a conversation whose turn the router
sends away from the replica holding its cache (that replica over its bound) takes the cache
along, when moving it is quicker than computing it again on the replica it goes to.

The turn then reaches its replica after the transfer (its tokens x the cost model's KV bytes
a token / ``transfer_bytes_per_second``) and finds its history there: a paged server gets the
blocks as cached, evictable blocks in its pool's free room, a llama.cpp replica gets an entry
in its host-RAM cache. What the source holds is counted from its slots (a llama.cpp replica)
or its pool (a paged one); a llama.cpp source's host-RAM cache is not looked at.
"""

from __future__ import annotations

from extproc.sim.paged import PagedReplica
from extproc.sim.prompts import common_prefix
from extproc.sim.replica import Replica
from extproc.sim.request import Request


class Relief:
    def __init__(self, transfer_bytes_per_second: float, min_tokens: int) -> None:
        self.transfer_bytes_per_second = transfer_bytes_per_second
        self.min_tokens = min_tokens
        self.moves = 0
        self.moved_bytes = 0
        self.last: dict[str, Request] = {}  # conversation -> its latest turn routed (a trace links no turns)

    def move(self, replicas: dict[str, Replica | PagedReplica], request: Request,
             target: Replica | PagedReplica) -> float:
        """Seconds the turn waits for its cache to arrive on ``target`` (0: nothing moved)."""
        previous = self.last.get(request.conversation)
        self.last[request.conversation] = request
        source = replicas.get(previous.replica) if previous is not None and previous.replica else None
        if previous is None or source is None or source is target or previous.status != 200:
            return 0.0
        held, there = held_tokens(source, previous), held_tokens(target, request)
        tokens = held - there
        if tokens < self.min_tokens:
            return 0.0
        size = tokens * target.cost.kv_bytes_per_token
        seconds = size / self.transfer_bytes_per_second
        prompt, cost = request.prompt_tokens, target.cost
        if seconds >= cost.prefill_s(prompt - there, there) - cost.prefill_s(max(0, prompt - held), held):
            return 0.0  # computing it is quicker
        if not _land(target, previous, held):
            return 0.0
        self.moves += 1
        self.moved_bytes += size
        return seconds


def held_tokens(replica: Replica | PagedReplica, request: Request) -> int:
    """Leading tokens of ``request``'s prompt the replica holds (slots or pool)."""
    if isinstance(replica, PagedReplica):
        return replica.pooled_prefix_tokens(request)
    return max((common_prefix(slot.key, slot.blocks, slot.tokens, request.key, request.blocks, request.prompt_tokens)
                for slot in replica.slots), default=0)


def _land(target: Replica | PagedReplica, previous: Request, tokens: int) -> bool:
    if isinstance(target, PagedReplica):
        return target.pool.add_cached(target._blocks(previous)[0])
    if target.cache.capacity_tokens <= 0:
        return False
    target.cache.save(previous.key, previous.blocks, tokens)
    return True
