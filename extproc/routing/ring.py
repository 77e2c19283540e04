"""A consistent-hash ring with virtual nodes over replica names."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator

from extproc.routing.hashing import hash_bytes


class HashRing:
    """Each replica owns ``vnodes`` points; a key belongs to the first point clockwise.

    Adding a replica to n others moves about 1/(n+1) of the keys, all of them to the
    new replica; removing one moves only its own keys. Immutable: discovery changes
    build a new ring (100 k points take ~50 ms, and membership changes are rare).
    """

    __slots__ = ("_points", "_owners", "replicas")

    def __init__(self, replicas: Iterable[str], vnodes: int, seed: int) -> None:
        self.replicas: tuple[str, ...] = tuple(sorted(set(replicas)))
        points = sorted(
            (hash_bytes(f"{name}#{index}".encode(), seed), name)  # = stable_hash()
            for name in self.replicas
            for index in range(vnodes)
        )
        self._points = [point for point, _ in points]
        self._owners = [owner for _, owner in points]

    def __len__(self) -> int:
        return len(self.replicas)

    def home(self, key_hash: int) -> str | None:
        """The replica owning the first point clockwise from ``key_hash``."""
        if not self._points:
            return None
        index = bisect_right(self._points, key_hash) % len(self._points)
        return self._owners[index]

    def walk(self, key_hash: int) -> Iterator[str]:
        """Distinct replicas in clockwise order from ``key_hash``: home first, then overflow order."""
        owners = self._owners
        count = len(owners)
        if not count:
            return
        start = bisect_right(self._points, key_hash)
        seen: set[str] = set()
        wanted = len(self.replicas)
        for offset in range(count):
            owner = owners[(start + offset) % count]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == wanted:
                    return
