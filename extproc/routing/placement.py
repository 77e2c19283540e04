"""Placement memory: where each conversation was last served, and how long it was.

Bounded so memory stays flat with millions of conversations. An exact LRU needs a
linked list per entry (OrderedDict costs ~230 bytes an entry); instead two plain
dicts act as generations: entries go into the young one; when it holds half the
capacity it becomes the old one and the previous old one is dropped. A lookup that
hits the old generation moves the entry back to the young one. So at most
``capacity`` entries are kept, and what is forgotten is what went unused longest
(to within one generation). Keys are the conversation's 64-bit ring hash, which the
router has already computed, and values one packed int.
"""

from __future__ import annotations

from typing import NamedTuple

from mypy_extensions import mypyc_attr

_REPLICA_BITS = 20  # up to ~1 M distinct replica names over a router's lifetime
_REPLICA_MASK = (1 << _REPLICA_BITS) - 1
_new = tuple.__new__  # builds a Placement without NamedTuple's Python-level __new__ (3x faster)


class Placement(NamedTuple):
    replica: str
    prompt_tokens: int


# compiled (extproc/compiled.py); the simulator's store-backed memory extends it (extproc/sim/routers.py)
@mypyc_attr(allow_interpreted_subclasses=True)
class PlacementMemory:
    __slots__ = ("capacity", "_young", "_old", "_generation_size", "_names", "_ids")

    def __init__(self, capacity: int) -> None:
        if capacity < 2:
            raise ValueError("placement memory capacity must be at least 2")
        self.capacity = capacity
        self._generation_size = capacity // 2
        self._young: dict[int, int] = {}
        self._old: dict[int, int] = {}
        self._names: list[str] = []
        self._ids: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def get(self, key: int) -> Placement | None:
        packed = self._young.get(key)
        if packed is None:
            packed = self._old.pop(key, None)
            if packed is None:
                return None
            self._store(key, packed)
        return _new(Placement, (self._names[packed & _REPLICA_MASK], packed >> _REPLICA_BITS))

    def remember(self, key: int, replica: str, prompt_tokens: int) -> None:
        replica_id = self._ids.get(replica)
        if replica_id is None:
            replica_id = self._ids[replica] = len(self._names)
            self._names.append(replica)
        self._old.pop(key, None)
        young = self._young  # _store(), inlined: once per request
        young[key] = (prompt_tokens << _REPLICA_BITS) | replica_id
        if len(young) >= self._generation_size:
            self._old = young
            self._young = {}

    def placed_on(self, replica: str) -> list[tuple[int, int]]:
        """(key, prompt tokens) of the conversations last served by ``replica``, the least recent
        generation first: for a migration, not per request."""
        replica_id = self._ids.get(replica)
        if replica_id is None:
            return []
        return [(key, packed >> _REPLICA_BITS) for generation in (self._old, self._young)
                for key, packed in generation.items() if packed & _REPLICA_MASK == replica_id]

    def clear(self) -> None:
        self._young.clear()
        self._old.clear()

    def reset(self, capacity: int) -> None:
        """Forget everything and hold up to ``capacity`` from now on (the same object: a router's
        memory may be a store-backed one)."""
        if capacity < 2:
            raise ValueError("placement memory capacity must be at least 2")
        self.clear()
        self.capacity, self._generation_size = capacity, capacity // 2

    def _store(self, key: int, packed: int) -> None:
        young = self._young
        young[key] = packed
        if len(young) >= self._generation_size:
            self._old = young
            self._young = {}
