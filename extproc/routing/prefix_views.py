"""What a peer policy remembers about the prefix blocks it sent: pure, bounded data structures.

``BlockIndex`` is the routers' approximate cache view (llm-d's approximate prefix
indexer, SGLang's approximate radix tree, Dynamo's approximate KV indexer): the blocks
routed to each replica, at most ``capacity`` per replica (in blocks, or in units when each
block is given its weight), least recently sent forgotten first (llm-aware's own index,
bounded in tokens: ``extproc.routing.prefix_index``). Blocks are chained hashes
(``extproc.routing.blocks``), so a block names its whole prefix and a map from block to
replicas is a radix tree flattened.

``ActiveBlocks`` is Dynamo's view of the requests in flight: their blocks (counted once
per replica however many requests share them) and their uncached prompt tokens.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain

_NONE: frozenset[str] = frozenset()


class BlockIndex:
    """Blocks per replica, at most ``capacity`` units on each (a block weighs ``weight`` units)."""

    __slots__ = ("capacity", "_sent", "_holders", "_used")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a block index holds at least one block per replica")
        self.capacity = capacity
        self._sent: dict[str, OrderedDict[int, int]] = {}  # replica -> its blocks (-> weight), least recent first
        self._holders: dict[int, set[str]] = {}  # block -> replicas it was sent to
        self._used: dict[str, int] = {}  # replica -> units its blocks weigh

    def add(self, replica: str, blocks: Iterable[int], weight: int = 1) -> None:
        """Record ``blocks`` as sent to ``replica``, refreshed in the order given (so of
        these, the first is forgotten first); beyond capacity the least recent go."""
        sent = self._sent.setdefault(replica, OrderedDict())
        holders = self._holders
        used, capacity = self._used.get(replica, 0), self.capacity
        for block in blocks:
            if block in sent:
                sent.move_to_end(block)
                continue
            sent[block] = weight
            holders.setdefault(block, set()).add(replica)
            used += weight
            while used > capacity:
                oldest, oldest_weight = sent.popitem(last=False)
                used -= oldest_weight
                self._drop(replica, oldest)
        self._used[replica] = used

    def forget(self, replica: str, blocks: Iterable[int]) -> None:
        """``replica`` does not hold ``blocks`` (it said so)."""
        sent = self._sent.get(replica)
        if sent is None:
            return
        for block in blocks:
            weight = sent.pop(block, None)
            if weight is not None:
                self._used[replica] -= weight
                self._drop(replica, block)

    def holders(self, block: int) -> frozenset[str] | set[str]:
        return self._holders.get(block, _NONE)

    def matches(self, blocks: Sequence[int]) -> tuple[int, dict[str, int]]:
        """(depth, counts): walk the blocks until one no replica holds; depth is how many
        were held somewhere, counts[r] how many of those ``r`` holds (llm-d's greedy match)."""
        held = []
        for block in blocks:
            holders = self._holders.get(block)
            if not holders:
                break
            held.append(holders)
        return len(held), Counter(chain.from_iterable(held))  # counted in C: shared prompts have many holders

    def depth(self, blocks: Sequence[int]) -> int:
        """How many leading blocks some replica holds (the deepest node of a radix tree walk)."""
        holders = self._holders
        for depth, block in enumerate(blocks):
            if block not in holders:
                return depth
        return len(blocks)

    def leading_matches(self, blocks: Sequence[int]) -> dict[str, int]:
        """Per replica, how many leading blocks it holds without a gap (a radix tree walk)."""
        counts: dict[str, int] = {}
        alive: set[str] = set(self._holders.get(blocks[0], ())) if blocks else set()
        depth = 1
        for block in blocks[1:]:
            if not alive:
                break
            holders = self._holders.get(block, _NONE)
            if not alive <= holders:  # some drop out here, having matched ``depth`` blocks
                for replica in alive - holders:
                    counts[replica] = depth
                alive &= holders
            depth += 1
        for replica in alive:
            counts[replica] = depth
        return counts

    def held_prefix(self, replica: str, blocks: Sequence[int]) -> int:
        """How many leading blocks ``replica`` holds without a gap."""
        sent = self._sent.get(replica)
        if sent is None:
            return 0
        for depth, block in enumerate(blocks):
            if block not in sent:
                return depth
        return len(blocks)

    def size(self, replica: str) -> int:
        return len(self._sent.get(replica, ()))

    def used(self, replica: str) -> int:
        """Units ``replica``'s blocks weigh (never above ``capacity``)."""
        return self._used.get(replica, 0)

    def set_replicas(self, replicas: Iterable[str]) -> None:
        """Forget replicas that are gone (their caches went with them)."""
        wanted = set(replicas)
        for gone in [name for name in self._sent if name not in wanted]:
            del self._used[gone]
            for block in self._sent.pop(gone):
                self._drop(gone, block)

    def _drop(self, replica: str, block: int) -> None:
        holders = self._holders[block]
        holders.discard(replica)
        if not holders:
            del self._holders[block]


class ActiveBlocks:
    __slots__ = ("_holders", "_distinct", "_prefill", "_requests")

    def __init__(self) -> None:
        self._holders: dict[int, dict[str, int]] = {}  # block -> replica -> requests in flight holding it
        self._distinct: dict[str, int] = {}  # replica -> distinct blocks held by its requests in flight
        self._prefill: dict[str, int] = {}  # replica -> uncached prompt tokens in flight
        self._requests: dict[str, tuple[str, tuple[int, ...], int]] = {}

    def add(self, request_id: str, replica: str, blocks: tuple[int, ...], prefill_tokens: int) -> None:
        self._requests[request_id] = (replica, blocks, prefill_tokens)
        fresh = 0
        for block in blocks:
            holders = self._holders.setdefault(block, {})
            count = holders.get(replica, 0)
            fresh += count == 0
            holders[replica] = count + 1
        self._distinct[replica] = self._distinct.get(replica, 0) + fresh
        self._prefill[replica] = self._prefill.get(replica, 0) + prefill_tokens

    def remove(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        replica, blocks, prefill_tokens = entry
        for block in blocks:
            holders = self._holders[block]
            if holders[replica] == 1:
                del holders[replica]
                self._distinct[replica] -= 1
                if not holders:
                    del self._holders[block]
            else:
                holders[replica] -= 1
        self._prefill[replica] -= prefill_tokens

    def blocks(self) -> Mapping[str, int]:
        """Per replica, the distinct blocks of its requests in flight (absent: none)."""
        return self._distinct

    def shared(self, blocks: Iterable[int]) -> dict[str, int]:
        """Per replica, how many of ``blocks`` its requests in flight already hold."""
        get = self._holders.get
        return Counter(chain.from_iterable(get(block, ()) for block in blocks))

    def prefill_tokens(self) -> Mapping[str, int]:
        """Per replica, the uncached prompt tokens of its requests in flight (absent: none)."""
        return self._prefill

    def in_flight(self) -> int:
        return len(self._requests)

    def set_replicas(self, replicas: Iterable[str]) -> None:
        """Forget the requests in flight on replicas that are gone (as the ledger does)."""
        wanted = set(replicas)
        for request_id in [rid for rid, (name, _, _) in self._requests.items() if name not in wanted]:
            self.remove(request_id)
