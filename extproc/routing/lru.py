"""A bounded map from ints that forgets the least recently used entries first, to within one
generation: the router's memories of conversations (placement memory, history digests), and the
prefix index's memory of the prompts it forgot.

An exact LRU needs a linked list per entry (OrderedDict costs ~230 bytes an entry); instead
two plain dicts act as generations. Entries go into the young one; when it holds half the
capacity it becomes the old one and the previous old one is dropped. A lookup that hits the
old generation moves the entry back to the young one. So at most ``capacity`` entries are
kept, and what is forgotten is what went unused longest (to within one generation).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

V = TypeVar("V")


class TwoGenerationLru(Generic[V]):
    __slots__ = ("_young", "_old", "_generation_size")

    def __init__(self, capacity: int) -> None:
        self._generation_size = 0
        self._young: dict[int, V] = {}
        self._old: dict[int, V] = {}
        self.reset(capacity)

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def __contains__(self, key: int) -> bool:
        """Whether ``key`` is held (it does not become the most recently used)."""
        return key in self._young or key in self._old

    def get(self, key: int) -> V | None:
        """The value of ``key`` (None: not held), now the most recently used."""
        value = self._young.get(key)
        if value is None:
            value = self._old.pop(key, None)
            if value is not None:
                self._young_put(key, value)
        return value

    def put(self, key: int, value: V) -> None:
        self._old.pop(key, None)
        self._young_put(key, value)

    def items(self) -> Iterator[tuple[int, V]]:
        """Every (key, value), the least recent generation first."""
        yield from self._old.items()
        yield from self._young.items()

    def clear(self) -> None:
        self._young.clear()
        self._old.clear()

    def reset(self, capacity: int) -> None:
        """Forget everything and hold up to ``capacity`` entries from now on."""
        if capacity < 2:
            raise ValueError(f"capacity must be at least 2 (got {capacity})")
        self.clear()
        self._generation_size = capacity // 2

    def _young_put(self, key: int, value: V) -> None:
        young = self._young
        young[key] = value
        if len(young) >= self._generation_size:
            self._old = young
            self._young = {}
