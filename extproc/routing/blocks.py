"""Prefix blocks: a prompt as chained hashes of fixed-size blocks of its text.

The prompt text is cut into blocks of BLOCK_CHARS characters (the last one may be
shorter) and block i is hashed together with the hash of block i-1:

    h[0] = xxh64(block[0], seed=0)        h[i] = xxh64(block[i], seed=h[i-1])

so h[i] names the whole prefix up to block i: two prompts share h[0..k] exactly when
their first k+1 blocks are equal. 64 characters is about 16 tokens at 4 characters a
token: the block llm-d's approximate prefix scorer hashes (16-token blocks x 4
characters). The hash is the project's stable xxhash64, identical in every process.
Pure: the service renders the prompt text (``extproc.service.bodies``), the simulator
takes a trace's hash_ids, and the peer policies only compare these numbers.
"""

from __future__ import annotations

from extproc.routing.hashing import hash_bytes

BLOCK_CHARS = 64


def prefix_blocks(text: str, block_chars: int = BLOCK_CHARS) -> tuple[int, ...]:
    """Chained hashes of ``text``'s blocks, oldest first; () for an empty text."""
    data = text.encode()
    if len(data) == len(text):  # ASCII: a character is a byte, so the blocks are cut from one encoding
        pieces = [data[start : start + block_chars] for start in range(0, len(data), block_chars)]
    else:
        pieces = [text[start : start + block_chars].encode() for start in range(0, len(text), block_chars)]
    hashes = []
    previous = 0
    for piece in pieces:
        previous = hash_bytes(piece, previous)
        hashes.append(previous)
    return tuple(hashes)


def covered_tokens(prompt_tokens: int, blocks: int, matched: int) -> int:
    """The prompt tokens in ``matched`` of the prompt's ``blocks`` blocks (blocks taken as equal)."""
    return prompt_tokens * matched // blocks if blocks else 0
