"""llm-aware's prefix index: the prompts sent to each replica, as chains of blocks, bounded in tokens.

Each replica holds at most its capacity in tokens (a block weighs the tokens of the prompt
that brought it ÷ its blocks); beyond it the least recently used blocks are forgotten (a
prompt is used when sent, and again when its request ends: ``touch``), a prompt from its
end, as a server's LRU frees a finished request's blocks tail first. So a
block is held only with every block before it in its chain (the held blocks are closed under
prefixes), and a replica's held blocks form a tree whose leaves are the ends of the prompts
sent there.

That is what keeps a request cheap however long its prompt: sending a prompt touches only
its new blocks and its last block, a "tip" in the replica's recency order (a block's
recency is that of the newest tip below it), and a lookup is a binary search per distinct
depth. Forgetting pops the oldest tip and walks up from it while a block is a leaf that no
newer prompt ends at. A replica's capacity moves (``resize``) when it reports holding
less, or more, than the index believed.

Which replicas hold a block is one int, a bit per replica: a lookup's probe is one dict
get and one ``&``, whatever the fleet's size, and a depth's holders become names only when
listed.

Several routers keep their indexes alike (docs/shared-state.md#the-prefix-index): with a
``journal``, every change a router makes (a prompt sent, used, failed; a capacity moved) is
also kept as an ``IndexChange``, which its edge sends to the others (a store), and each router
``apply``-s the others' changes in their order, as if made here. Evictions are not sent: each
index derives them from the same changes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import compress
from typing import Any, NamedTuple

from extproc.routing.lru import TwoGenerationLru

# A held block's node is a list [the block before it (None: the first), its tokens, how many
# held blocks continue it]: one dict entry a block, built fast.
CHILDREN = 2
# what an IndexChange did, as its method of PrefixIndex
SENT, USED, FAILED, RESIZED = 0, 1, 2, 3
CHANGE_KINDS = 4


class IndexChange(NamedTuple):
    """One change a router made to its index, as another router applies it."""

    kind: int  # SENT (add_prompt), USED (touch), FAILED (forget) or RESIZED (resize)
    replica: str
    blocks: tuple[int, ...]  # SENT, FAILED: the prompt's blocks; USED: its last block alone; RESIZED: none
    tokens: int  # SENT: a new block's weight; FAILED: the blocks held before; RESIZED: tokens more (or fewer)
    floor: int  # RESIZED: the capacity's floor; else 0


class _Replica:
    """One replica's view: its held blocks, who each one continues, and its prompts' ends."""

    __slots__ = ("nodes", "tips", "used", "capacity")

    def __init__(self, capacity: int) -> None:
        self.nodes: dict[int, list[Any]] = {}  # held block -> its node
        self.tips: OrderedDict[int, int] = OrderedDict()  # prompts' last blocks -> when used, least recent first
        self.used = 0  # tokens its blocks weigh
        self.capacity = capacity


class PrefixIndex:
    """Per replica, the blocks sent there, at most ``capacity`` tokens each (``resize`` moves it below)."""

    __slots__ = ("capacity", "journal", "_replicas", "_holders", "_bits", "_known", "_by_name", "_named", "_uses",
                 "_forgotten")

    NAMED_SETS = 4_096  # sets of replicas whose names are remembered (a fleet meets few), then afresh
    FORGOTTEN_OPENINGS = 65_536  # first blocks remembered as forgotten (lru.py), ~3 MB

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a prefix index holds at least one token per replica")
        self.capacity = capacity
        self.journal: list[IndexChange] | None = None  # a list: this router's changes are kept for the others
        self._replicas: dict[str, _Replica] = {}
        self._holders: dict[int, int] = {}  # block -> the bits of the replicas holding it
        self._bits: dict[str, int] = {}  # replica -> its bit
        self._known = 0  # the bits of every replica in the index
        self._by_name: tuple[tuple[str, ...], tuple[int, ...]] = ((), ())  # names sorted, their bits
        self._named: dict[int, tuple[str, ...]] = {}  # bits -> those replicas' names, sorted
        self._uses = 0  # prompts sent or refreshed so far, on every replica: a tip's recency (a count, not a clock)
        # first blocks of prompts the index held and forgot (on some replica): the latest
        self._forgotten: TwoGenerationLru[bool] = TwoGenerationLru(self.FORGOTTEN_OPENINGS)

    def add_prompt(self, replica: str, blocks: Sequence[int], weight: int, held: int | None = None) -> None:
        """``replica`` was sent a prompt of ``blocks``, each new one weighing ``weight`` tokens:
        its held prefix (``held`` blocks, when a lookup just counted them) becomes the most
        recent, its new blocks are added, then the least recent blocks elsewhere are forgotten
        while it holds more than its capacity."""
        if not blocks:
            return
        if self.journal is not None:
            self.journal.append(IndexChange(SENT, replica, tuple(blocks), weight, 0))
        view = self._replicas.get(replica)
        if view is None:
            view = self._add_replica(replica)
        nodes, holders = view.nodes, self._holders
        if held is None:
            held = self._held(view, blocks)
        previous = blocks[held - 1] if held else None
        if held < len(blocks):
            bit, added = self._bits[replica], 0
            above = nodes[previous] if previous is not None else None
            for block in blocks[held:]:
                if block in nodes:  # an id repeated within the prompt (a broken client): the chain ends
                    break
                node = nodes[block] = [previous, weight, 0]
                if above is not None:
                    above[CHILDREN] += 1
                holders[block] = holders.get(block, 0) | bit
                previous, above = block, node
                added += 1
            view.used += added * weight
        tips = view.tips
        assert previous is not None  # blocks[0] was held or added
        self._uses += 1
        tips[previous] = self._uses  # the prompt's end: its recency
        tips.move_to_end(previous)
        if view.used > view.capacity:
            self._evict(replica, view)

    def touch(self, replica: str, blocks: Sequence[int]) -> None:
        """A prompt sent to ``replica`` becomes its most recent, if it still holds all of it."""
        if self.journal is not None and blocks:
            self.journal.append(IndexChange(USED, replica, (blocks[-1],), 0, 0))
        view = self._replicas.get(replica)
        if view is not None and blocks and blocks[-1] in view.nodes:  # and so every block before it
            self._uses += 1
            view.tips[blocks[-1]] = self._uses
            view.tips.move_to_end(blocks[-1])

    def forget(self, replica: str, blocks: Sequence[int], held: int) -> None:
        """``replica`` did not cache the prompt of ``blocks`` (its request failed): forget its blocks
        past the first ``held`` (those it held before), from its end, while no other prompt ends at
        or continues them. The block left at its end, a leaf again, takes the least recent place.
        What sending it made the replica forget, and the refresh of a prompt it held whole, stay."""
        if self.journal is not None:
            self.journal.append(IndexChange(FAILED, replica, tuple(blocks), held, 0))
        view = self._replicas.get(replica)
        if view is None:
            return
        nodes, tips = view.nodes, view.tips
        end = position = len(blocks)
        while position > held:
            block = blocks[position - 1]
            node = nodes.get(block)
            if node is None or node[CHILDREN] or (position < end and block in tips):
                break
            tips.pop(block, None)
            self._remove_leaf(replica, view, block)
            position -= 1
        if position < end and position:
            self._end_least_recent(view, blocks[position - 1], next(iter(tips.values()), 0))

    def resize(self, replica: str, tokens: int, floor: int) -> None:
        """``replica`` holds ``tokens`` more (or, negative, fewer) than the index believed: move
        its capacity by as much, within [``floor``, the capacity it started with], and forget
        its least recent blocks down to it."""
        if self.journal is not None and tokens:
            self.journal.append(IndexChange(RESIZED, replica, (), tokens, floor))
        view = self._replicas.get(replica)
        if view is None or not tokens:
            return
        view.capacity = min(self.capacity, max(1, floor, view.capacity + tokens))
        self._evict(replica, view)

    def apply(self, changes: Iterable[IndexChange]) -> None:
        """Another router's changes, in its order, made here as it made them (not journaled:
        they are not this router's to send)."""
        journal, self.journal = self.journal, None
        try:
            for kind, replica, blocks, tokens, floor in changes:
                if kind == SENT:
                    self.add_prompt(replica, blocks, tokens)
                elif kind == USED:
                    self.touch(replica, blocks)
                elif kind == FAILED:
                    self.forget(replica, blocks, tokens)
                else:
                    self.resize(replica, tokens, floor)
        finally:
            self.journal = journal

    def lookup(self, blocks: Sequence[int], avoid: Iterable[str] = ()) -> list[tuple[int, int]]:
        """The replicas (but ``avoid``) holding a leading part of ``blocks``, grouped by how
        many blocks they hold: (blocks held, the bits of the replicas holding that many),
        deepest first (``names`` turns bits into names). Held blocks are closed under
        prefixes, so a replica's match is one past its deepest block: one binary search per
        distinct depth instead of a walk over every block."""
        holders = self._holders
        groups: list[tuple[int, int]] = []
        left = self._known  # the replicas not yet counted: each holds fewer than ``high`` blocks
        for name in avoid:
            left &= ~self._bits.get(name, 0)
        high = len(blocks)
        while high and left and holders.get(blocks[0], 0) & left:  # some replica left holds the first block
            low, top = 1, high  # the first block in [0, high) no replica in ``left`` holds
            while low < top:
                middle = (low + top) // 2
                if holders.get(blocks[middle], 0) & left:
                    low = middle + 1
                else:
                    top = middle
            fresh = holders[blocks[low - 1]] & left
            groups.append((low, fresh))
            left ^= fresh
            high = low - 1
        return groups

    def forgot(self, block: int) -> bool:
        """Whether a replica held a prompt opening with ``block`` and the index forgot it (evicted,
        or its request failed), recently: not a prompt it never saw."""
        return block in self._forgotten

    def held_prefix(self, replica: str, blocks: Sequence[int]) -> int:
        """How many leading ``blocks`` ``replica`` holds."""
        view = self._replicas.get(replica)
        return self._held(view, blocks) if view is not None else 0

    def used(self, replica: str) -> int:
        """Tokens ``replica``'s blocks weigh (never above its capacity, unless one prompt alone is)."""
        view = self._replicas.get(replica)
        return view.used if view is not None else 0

    def least_recent_use(self, replica: str, tokens: int) -> int:
        """When ``replica``'s least recent prompt, what ``tokens`` more make it forget first, was last
        used (a count over every replica); -1 while it has room for them (it forgets nothing)."""
        view = self._replicas.get(replica)
        if view is None or view.used + tokens <= view.capacity or not view.tips:
            return -1
        return next(iter(view.tips.values()))

    def capacity_of(self, replica: str) -> int:
        view = self._replicas.get(replica)
        return view.capacity if view is not None else self.capacity

    def size(self, replica: str) -> int:
        """Blocks ``replica`` holds."""
        view = self._replicas.get(replica)
        return len(view.nodes) if view is not None else 0

    def set_replicas(self, replicas: Iterable[str]) -> None:
        """Forget replicas that are gone (their caches went with them)."""
        wanted = set(replicas)
        for gone in [name for name in self._replicas if name not in wanted]:
            for block, node in self._replicas.pop(gone).nodes.items():
                self._drop(gone, block)
                if node[0] is None:
                    self._forgot_opening(block)
            self._known &= ~self._bits.pop(gone)  # its bit is free for a replica that comes later
        self._sort_names()

    def _add_replica(self, replica: str) -> _Replica:
        bit = 1
        while bit & self._known:  # the lowest free bit
            bit <<= 1
        self._bits[replica] = bit
        self._known |= bit
        view = self._replicas[replica] = _Replica(self.capacity)
        self._sort_names()
        return view

    def _sort_names(self) -> None:
        ordered = sorted(self._bits.items())
        self._by_name = (tuple(name for name, _ in ordered), tuple(bit for _, bit in ordered))
        self._named = {}

    def names(self, bits: int) -> tuple[str, ...]:
        """The names of the replicas in ``bits``, sorted."""
        named = self._named.get(bits)
        if named is None:
            if len(self._named) >= self.NAMED_SETS:
                self._named.clear()
            names, each = self._by_name
            named = self._named[bits] = tuple(compress(names, map(bits.__and__, each)))
        return named

    def bit(self, replica: str) -> int:
        return self._bits.get(replica, 0)

    def holder_bits(self, block: int) -> int:
        """The bits of the replicas holding ``block``."""
        return self._holders.get(block, 0)

    @staticmethod
    def _held(view: _Replica, blocks: Sequence[int]) -> int:
        """The leading blocks ``view`` holds: a binary search (held blocks are closed under prefixes)."""
        nodes = view.nodes
        low, top = 0, len(blocks)
        while low < top:
            middle = (low + top) // 2
            if blocks[middle] in nodes:
                low = middle + 1
            else:
                top = middle
        return low

    def _evict(self, replica: str, view: _Replica) -> None:
        """Forget least recent blocks while ``view`` holds more than its capacity. The newest
        prompt goes last, from its end, only when it alone is larger than the capacity."""
        tips, nodes = view.tips, view.nodes
        while view.used > view.capacity and tips:
            block: int | None
            block, last_use = tips.popitem(last=False)
            while block is not None and block not in tips and not nodes[block][CHILDREN]:
                block = self._remove_leaf(replica, view, block)
                if view.used <= view.capacity:
                    self._end_least_recent(view, block, last_use)  # the rest of that prompt keeps its place
                    return

    def _remove_leaf(self, replica: str, view: _Replica, block: int) -> int | None:
        """Forget ``block``, a leaf of ``view``'s tree; returns the block before it (None: none)."""
        above, tokens, _ = view.nodes.pop(block)
        view.used -= tokens
        self._drop(replica, block)
        if above is not None:
            view.nodes[above][CHILDREN] -= 1
        else:
            self._forgot_opening(block)
        return above

    def _forgot_opening(self, block: int) -> None:
        """A prompt's first block left a replica (``forgot``)."""
        self._forgotten.put(block, True)

    @staticmethod
    def _end_least_recent(view: _Replica, block: int | None, use: int) -> None:
        """``block``, a leaf again once the blocks after it were forgotten, ends a prompt: the
        least recent one (last used at ``use``), unless a prompt ends there already."""
        if block is not None and block not in view.tips and not view.nodes[block][CHILDREN]:
            view.tips[block] = use
            view.tips.move_to_end(block, last=False)

    def _drop(self, replica: str, block: int) -> None:
        left = self._holders[block] & ~self._bits[replica]
        if left:
            self._holders[block] = left
        else:
            del self._holders[block]

