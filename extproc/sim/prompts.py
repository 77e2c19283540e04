"""What a replica has cached, and how much of a new prompt it covers.

A prompt (or a slot's / cache entry's content) is described by three values instead of
its tokens:

- ``key``: content that can share a prefix has the same key. For generated profiles
  it is the conversation (a turn's prompt is the previous prompt + answer + a new
  message); for Mooncake traces it is the first 512-token block's hash id.
- ``blocks``: None for profiles (the whole history is one growing prefix), or the
  trace's hash ids of 512-token blocks (equal ids at equal positions = equal prefix).
- ``tokens``: its length.

The host-RAM prompt cache follows llama.cpp's server (``--cache-ram``): a slot's
content is saved when a new prompt would discard most of it; entries fully contained
in a newly saved one are dropped; a slot about to serve a prompt takes the entry
that beats what it holds (keeping >= 25 % of the entry, matching more of the
prompt); the oldest entries go first when the capacity (in tokens) is exceeded, but
the newest one always stays.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

BLOCK_TOKENS = 512  # Mooncake's block size


def common_prefix(
    key_a: Hashable, blocks_a: tuple[int, ...] | None, tokens_a: int,
    key_b: Hashable, blocks_b: tuple[int, ...] | None, tokens_b: int,
) -> int:
    """Tokens two contents share from the start."""
    if key_a != key_b or tokens_a <= 0:
        return 0
    if blocks_a is None or blocks_b is None:
        return tokens_a if tokens_a < tokens_b else tokens_b
    same = 0
    for a, b in zip(blocks_a, blocks_b, strict=False):
        if a != b:
            break
        same += 1
    return min(same * BLOCK_TOKENS, tokens_a, tokens_b)


class HostCache:
    """One replica's host-RAM prompt cache: entries (key, blocks, tokens), oldest first."""

    __slots__ = ("capacity_tokens", "_entries", "_by_key", "_next_id", "tokens")

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._entries: dict[int, tuple[Hashable, tuple[int, ...] | None, int]] = {}
        self._by_key: dict[Hashable, list[int]] = {}
        self._next_id = 0
        self.tokens = 0

    def save(self, key: Hashable, blocks: tuple[int, ...] | None, tokens: int) -> None:
        if self.capacity_tokens <= 0 or tokens <= 0:
            return
        ids = self._by_key.get(key)
        if ids:
            for entry_id in ids:
                e_key, e_blocks, e_tokens = self._entries[entry_id]
                if common_prefix(e_key, e_blocks, e_tokens, key, blocks, tokens) >= tokens:
                    return  # already held in full
            for entry_id in list(ids):
                e_key, e_blocks, e_tokens = self._entries[entry_id]
                if common_prefix(e_key, e_blocks, e_tokens, key, blocks, tokens) >= e_tokens:
                    self._remove(entry_id)  # the new entry contains it
        entry_id = self._next_id
        self._next_id += 1
        self._entries[entry_id] = (key, blocks, tokens)
        self._by_key.setdefault(key, []).append(entry_id)
        self.tokens += tokens
        while self.tokens > self.capacity_tokens and len(self._entries) > 1:
            self._remove(next(iter(self._entries)))

    def take_best(
        self, key: Hashable, blocks: tuple[int, ...] | None, tokens: int, keep: float, sim: float
    ) -> tuple[Hashable, tuple[int, ...] | None, int] | None:
        """Remove and return the entry that beats (keep, sim) for this prompt, if any."""
        ids = self._by_key.get(key)
        if not ids:
            return None
        best = None
        for entry_id in ids:
            e_key, e_blocks, e_tokens = self._entries[entry_id]
            shared = common_prefix(e_key, e_blocks, e_tokens, key, blocks, tokens)
            e_keep = shared / e_tokens
            e_sim = shared / tokens
            if e_keep >= 0.25 and e_keep > keep and e_sim > sim:
                best, keep, sim = entry_id, e_keep, e_sim
        if best is None:
            return None
        entry = self._entries[best]
        self._remove(best)
        return entry

    def forget(self, owned: Callable[[Hashable], bool]) -> None:
        """Drop every entry whose key is ``owned`` (an unloaded model's: its process is gone)."""
        for entry_id in [entry_id for entry_id, (key, _, _) in self._entries.items() if owned(key)]:
            self._remove(entry_id)

    def _remove(self, entry_id: int) -> None:
        key, _, tokens = self._entries.pop(entry_id)
        self.tokens -= tokens
        ids = self._by_key[key]
        ids.remove(entry_id)
        if not ids:
            del self._by_key[key]
