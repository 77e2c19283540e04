"""llm-aware's prefix index across routers, through the store (docs/shared-state.md#the-prefix-index).

Each router keeps its own index (extproc/routing/prefix_index.py: block hashes -> replicas,
capacity and eviction); what it changes there (an ``IndexChange``: a prompt sent, used or
failed, a capacity moved) goes into its own stream ``<prefix>:index:<router>``, and every
other router makes those changes in its own index, in their order. Evictions are not sent:
each index derives them from the same changes. The store holds no index, only the latest
changes: each router's stream keeps about ``INDEX_KEPT`` entries (XADD MAXLEN ~), each
``INDEX_ENTRY_BYTES`` of blocks at most (one prompt's more, alone), so the index's bytes
in the store are bounded per router whatever the number of conversations.

An entry is one batch of writes' changes: ``n``, the router's own sequence number (from 1
at each start: a router's id is new at each start), ``changes`` [[kind, replica, tokens,
floor, blocks], ...] and ``blocks``, every change's blocks as little-endian 64-bit ints.
A reader applies an entry once (a batch sent again after a timeout may be in the stream
twice; a reconnection reads the kept entries again) and counts the entries it finds missing
(trimmed before it read them). Every entry read is checked as the rest of the store's: what
does not parse or claims more than a router could send is skipped and counted.

Pure: encoding and decoding, where each stream was read up to; the commands are store.py's.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import orjson

from extproc.routing.prefix_index import CHANGE_KINDS, RESIZED, USED, IndexChange

INDEX_KEPT = 512  # entries each router's stream keeps (about): a reader within ~5 s of a busy writer reads all
INDEX_ENTRY_BYTES = 16_384  # blocks per entry at most (2,048), unless one prompt alone has more
INDEX_READ = 64  # entries read of each stream per read
MAX_CHANGES_PER_ENTRY = 4_096
FIRST = b"0-0"  # a stream read from its oldest kept entry

# one entry: its sequence number, its changes' headers (JSON), its blocks (packed)
Entry = tuple[int, bytes, bytes]


def encode(changes: Iterable[IndexChange], first_seq: int) -> list[Entry]:
    """``changes`` as stream entries, numbered from ``first_seq``, each at most INDEX_ENTRY_BYTES of blocks."""
    entries: list[Entry] = []
    heads: list[tuple[int, str, int, int, int]] = []
    blocks: list[int] = []
    for kind, replica, blocks_of, tokens, floor in changes:
        if heads and 8 * (len(blocks) + len(blocks_of)) > INDEX_ENTRY_BYTES:
            entries.append(_entry(first_seq + len(entries), heads, blocks))
            heads, blocks = [], []
        heads.append((kind, replica, tokens, floor, len(blocks_of)))
        blocks += blocks_of
    if heads:
        entries.append(_entry(first_seq + len(entries), heads, blocks))
    return entries


def _entry(seq: int, heads: list[tuple[int, str, int, int, int]], blocks: list[int]) -> Entry:
    return seq, orjson.dumps(heads), struct.pack(f"<{len(blocks)}Q", *blocks)


def entry_fields(entry: Entry) -> dict[str, bytes | int]:
    """An entry as the stream's fields."""
    seq, heads, blocks = entry
    return {"n": seq, "changes": heads, "blocks": blocks}


@dataclass(frozen=True, slots=True)
class Limits:
    """The most a real router sends: beyond it an entry is forged or corrupt."""

    max_tokens: int  # a block's weight, a failed prompt's blocks, a capacity's move or floor: one request's tokens
    max_name_chars: int


def decode(raw: Mapping[bytes, bytes], limits: Limits) -> tuple[int, list[IndexChange]]:
    """(sequence number, changes) of one entry; ValueError, TypeError or KeyError when it does
    not parse or is out of bounds."""
    seq = int(raw[b"n"])
    heads = orjson.loads(raw[b"changes"])
    packed = raw[b"blocks"]
    if seq < 1 or not isinstance(heads, list) or len(heads) > MAX_CHANGES_PER_ENTRY or len(packed) % 8:
        raise ValueError("not an entry of changes")
    blocks = struct.unpack(f"<{len(packed) // 8}Q", packed)
    changes, at = [], 0
    for kind, replica, tokens, floor, count in heads:
        if type(count) is not int or count < 0 or at + count > len(blocks):
            raise ValueError("blocks missing")
        changes.append(_change(kind, replica, tokens, floor, blocks[at:at + count], limits))
        at += count
    if at != len(blocks):
        raise ValueError("blocks left over")
    return seq, changes


def _change(kind: object, replica: object, tokens: object, floor: object, blocks: tuple[int, ...],
            limits: Limits) -> IndexChange:
    if type(kind) is not int or not 0 <= kind < CHANGE_KINDS:
        raise ValueError("not a kind of change")
    if not isinstance(replica, str) or not 0 < len(replica) <= limits.max_name_chars:
        raise ValueError("not a replica's name")
    if type(tokens) is not int or type(floor) is not int or not 0 <= floor <= limits.max_tokens:
        raise ValueError("not a count")
    low = -limits.max_tokens if kind == RESIZED else 0
    if not low <= tokens <= limits.max_tokens or (kind == USED and len(blocks) != 1) or (kind == RESIZED and blocks):
        raise ValueError("out of bounds")
    return IndexChange(kind, replica, blocks, tokens, floor)


@dataclass(slots=True)
class IndexReader:
    """Where this router read each other router's stream up to, and which of its entries it applied."""

    limits: Limits
    read_to: dict[bytes, bytes] = field(default_factory=dict)  # router id -> the last stream id read
    applied: dict[bytes, int] = field(default_factory=dict)  # router id -> the last sequence number applied

    def streams(self, prefix: bytes, routers: Iterable[bytes]) -> dict[bytes, bytes]:
        """{stream key: the id to read after} for the streams of ``routers``."""
        return {prefix + router: self.read_to.get(router, FIRST) for router in routers}

    def restart(self) -> None:
        """Read every stream again from its oldest kept entry (a reconnection: the store may have
        been emptied and started again); what was applied is skipped by its sequence number."""
        self.read_to.clear()

    def take(self, prefix: bytes, reply: object) -> tuple[list[IndexChange], int, int]:
        """(the changes of the entries not applied yet, in order; entries skipped as invalid;
        entries missing: trimmed before this router read them) from an XREAD reply."""
        if reply is None:
            return [], 0, 0
        if not isinstance(reply, list):
            return [], 1, 0
        changes: list[IndexChange] = []
        invalid = missed = 0
        for stream in reply:
            try:
                key, entries = stream
                router = bytes(key)[len(prefix):]
            except (TypeError, ValueError):
                invalid += 1
                continue
            for entry_id, raw in entries:
                self.read_to[router] = entry_id
                try:
                    seq, found = decode(raw, self.limits)
                except (ValueError, TypeError, KeyError, struct.error, orjson.JSONDecodeError):
                    invalid += 1
                    continue
                last = self.applied.get(router, 0)
                if seq <= last:
                    continue  # applied already (sent twice, or read again after a reconnection)
                if last:
                    missed += seq - last - 1
                self.applied[router] = seq
                changes += found
        return changes, invalid, missed
