"""Stable hashing: the same key lands on the same point in every process.

Python's built-in ``hash()`` is salted per process (PYTHONHASHSEED), so two routers
would disagree; xxhash64 with an explicit seed does not.
"""

from __future__ import annotations

import xxhash

# stable_hash(key, seed) == hash_bytes(key.encode(), seed); the hot paths call this directly
hash_bytes = xxhash.xxh64_intdigest


def stable_hash(key: str, seed: int = 0) -> int:
    """64-bit hash of ``key``, identical across processes, machines and runs."""
    return hash_bytes(key.encode(), seed)
