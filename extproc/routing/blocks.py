"""Prefix blocks: a prompt as chained hashes of fixed-size blocks of its text.

The prompt text is cut into blocks of BLOCK_CHARS characters (the last one may be
shorter) and block i is hashed together with the hash of block i-1:

    h[0] = xxh64(block[0], seed=s)        h[i] = xxh64(block[i], seed=h[i-1])

so h[i] names the whole prefix up to block i: two prompts share h[0..k] exactly when
their first k+1 blocks are equal. The seed s names the model (0: none named, ``model_seed``):
two models' equal prompts share no block, as they share no cache. 64 characters is about 16 tokens at 4 characters a
token: the block llm-d's approximate prefix scorer hashes (16-token blocks x 4
characters). The hash is the project's stable xxhash64, identical in every process.
Pure: the service renders the prompt text (``extproc.service.bodies``), the simulator
takes a trace's hash_ids, and the peer policies only compare these numbers.
"""

from __future__ import annotations

from collections import OrderedDict

from xxhash import xxh3_64_intdigest as digest

from extproc.routing.hashing import hash_bytes

BLOCK_CHARS = 64


def prefix_blocks(text: str, block_chars: int = BLOCK_CHARS, seed: int = 0) -> tuple[int, ...]:
    """Chained hashes of ``text``'s blocks, oldest first, the first seeded with ``seed``; () for an empty text."""
    data = text.encode()
    if len(data) == len(text):  # ASCII: a character is a byte, so the blocks are cut from one encoding
        return tuple(_chain(_cut(data, 0, block_chars), seed))
    return tuple(_chain([text[at : at + block_chars].encode() for at in range(0, len(text), block_chars)], seed))


def model_seed(model: str) -> int:
    """The seed of a prompt's blocks under ``model`` (0 when the request names none)."""
    return hash_bytes(model.encode(), 0) if model else 0


class BlockMemory:
    """Prefix blocks as ``prefix_blocks`` cuts them, remembered per conversation: a next turn
    resends the last prompt, so only its new blocks are hashed. What is reused is checked (a
    digest of the remembered part of the text), so a conversation key shared by two chats only
    costs a full hashing. At most ``max_blocks`` blocks are remembered (46 bytes each: 12 MB),
    the least recent conversations forgotten first; a text with non-ASCII characters is hashed
    in full."""

    __slots__ = ("block_chars", "max_blocks", "_last", "_held")

    def __init__(self, block_chars: int, max_blocks: int = 262_144) -> None:
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self._last: OrderedDict[str, tuple[int, int, tuple[int, ...]]] = OrderedDict()  # key -> (bytes, digest, blocks)
        self._held = 0  # blocks remembered

    def last(self, key: str) -> tuple[int, ...]:
        """The whole blocks of the conversation's last prompt (() when forgotten)."""
        remembered = self._last.get(key)
        return () if remembered is None else remembered[2]

    def blocks(self, key: str, text: str, seed: int = 0) -> tuple[int, ...]:
        """``prefix_blocks(text, block_chars, seed)``; ``key`` names the conversation under that seed."""
        data = text.encode()
        if len(data) != len(text):
            return prefix_blocks(text, self.block_chars, seed)
        size, view, last = self.block_chars, memoryview(data), self._last
        remembered = last.pop(key, None)
        known: tuple[int, ...] = ()
        start = 0
        if remembered is not None:
            self._held -= len(remembered[2])
            if remembered[0] <= len(data) and digest(view[: remembered[0]]) == remembered[1]:
                start, known = remembered[0], remembered[2]
        hashes = known + tuple(_chain(_cut(data, start, size), known[-1] if known else seed))
        whole = len(data) // size
        last[key] = (whole * size, digest(view[: whole * size]), hashes[:whole])
        self._held += whole
        while self._held > self.max_blocks:  # the least recent first (a prompt over the whole budget: itself)
            self._held -= len(last.popitem(last=False)[1][2])
        return hashes

    def held(self) -> int:
        """Blocks remembered."""
        return self._held


def _cut(data: bytes, start: int, block_chars: int) -> list[bytes]:
    return [data[at : at + block_chars] for at in range(start, len(data), block_chars)]


def _chain(pieces: list[bytes], previous: int) -> list[int]:
    """The chained hashes of ``pieces``, after the hash ``previous``."""
    hashes = []
    for piece in pieces:
        previous = hash_bytes(piece, previous)
        hashes.append(previous)
    return hashes


def covered_tokens(prompt_tokens: int, blocks: int, matched: int) -> int:
    """The prompt tokens in ``matched`` of the prompt's ``blocks`` blocks (blocks taken as equal)."""
    return prompt_tokens * matched // blocks if blocks else 0
