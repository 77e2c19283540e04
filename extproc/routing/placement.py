"""Placement memory: where each conversation was last served, and how long it was.

Bounded so memory stays flat with millions of conversations: a two-generation LRU
(lru.py). Keys are the conversation's 64-bit ring hash, which the router has already
computed, and values one packed int (the replica's number and the prompt's tokens).

With a ``journal`` (a list), each placement remembered is also kept there, in order, for a
caller that passes them on to the other routers (the simulator's store model,
extproc/sim/routers.py); theirs come back through ``learn``, which keeps none.
"""

from __future__ import annotations

from typing import NamedTuple

from extproc.routing.lru import TwoGenerationLru

_REPLICA_BITS = 20  # up to ~1 M distinct replica names over a router's lifetime
_REPLICA_MASK = (1 << _REPLICA_BITS) - 1
_new = tuple.__new__  # builds a Placement without NamedTuple's Python-level __new__ (3x faster)


class Placement(NamedTuple):
    replica: str
    prompt_tokens: int


# (conversation key, replica, prompt tokens) of a placement remembered
PlacementChange = tuple[int, str, int]


# compiled (extproc/compiled.py)
class PlacementMemory:
    __slots__ = ("_entries", "_names", "_ids", "journal")

    def __init__(self, capacity: int) -> None:
        self._entries: TwoGenerationLru[int] = TwoGenerationLru(capacity)  # packed placements
        self._names: list[str] = []
        self._ids: dict[str, int] = {}
        self.journal: list[PlacementChange] | None = None  # a list: the placements remembered, oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: int) -> Placement | None:
        packed = self._entries.get(key)
        if packed is None:
            return None
        return _new(Placement, (self._names[packed & _REPLICA_MASK], packed >> _REPLICA_BITS))

    def remember(self, key: int, replica: str, prompt_tokens: int) -> None:
        self.learn(key, replica, prompt_tokens)
        if self.journal is not None:
            self.journal.append((key, replica, prompt_tokens))

    def learn(self, key: int, replica: str, prompt_tokens: int) -> None:
        """Another router's placement (read from a store): held here as one remembered, not journaled."""
        replica_id = self._ids.get(replica)
        if replica_id is None:
            replica_id = self._ids[replica] = len(self._names)
            self._names.append(replica)
        self._entries.put(key, (prompt_tokens << _REPLICA_BITS) | replica_id)

    def placed_on(self, replica: str) -> list[tuple[int, int]]:
        """(key, prompt tokens) of the conversations last served by ``replica``, the least recent
        generation first: for a migration, not per request."""
        replica_id = self._ids.get(replica)
        if replica_id is None:
            return []
        return [(key, packed >> _REPLICA_BITS) for key, packed in self._entries.items()
                if packed & _REPLICA_MASK == replica_id]

    def clear(self) -> None:
        self._entries.clear()

    def reset(self, capacity: int) -> None:
        """Forget everything and hold up to ``capacity`` from now on (the same object: a router's
        memory may be shared with a caller)."""
        self._entries.reset(capacity)
