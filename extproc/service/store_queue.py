"""The shared store's writes waiting for the writer (store.py, store_writer.py): gathered into one
batch between pipelines, kept through a failure or an outage (bounded), and what this router
wrote that is still true, to publish again after one. Pure bookkeeping: no I/O."""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import orjson

from extproc.routing.peers import PeerRequest
from extproc.routing.placement import Placement
from extproc.routing.prefix_index import IndexChange
from extproc.routing.speeds import AnswerTimings
from extproc.service.metrics import Metrics
from extproc.service.store_index import INDEX_KEPT, Entry, encode
from extproc.service.store_layout import Keys

MAX_QUEUED_WRITES = 100_000  # kept through an outage (about 200 bytes each); the oldest beyond are dropped
REPUBLISHED = 100_000  # the latest placements this router wrote, kept to publish again after an outage


@dataclass(slots=True)
class Batch:
    """The writes gathered for one pipeline. A request decided and released within one batch is
    never written at all (most of them, when replicas answer within WRITE_EVERY_S), and a
    conversation's placement is written once per batch, the latest."""

    pending: dict[tuple[str, str], PeerRequest | None] = field(default_factory=dict)  # (key, id) -> it; None: gone
    placements: dict[str, tuple[bytes, int]] = field(default_factory=dict)  # key -> (placement, ttl ms)
    answers: list[tuple[str, AnswerTimings]] = field(default_factory=list)  # (replica, timings), oldest first
    changes: list[IndexChange] = field(default_factory=list)  # to the prefix index, oldest first ...
    index: list[Entry] = field(default_factory=list)  # ... and as entries once sent (numbered: sent again alike)

    def __len__(self) -> int:
        return len(self.pending) + len(self.placements) + len(self.answers) + len(self.changes) + len(self.index)

    def under(self, newer: Batch) -> Batch:
        """This batch (not written) followed by ``newer``: a key's newer write replaces the older.
        Its answers are dropped: sent again they might be learnt twice (XADD is not idempotent),
        and each router has learnt its own already. Its changes to the index are sent again: a
        reader applies an entry once (its sequence number)."""
        return Batch({**self.pending, **newer.pending}, {**self.placements, **newer.placements}, newer.answers,
                     self.changes + newer.changes, self.index + newer.index)


class WriteQueue:
    def __init__(self, keys: Keys, metrics: Metrics) -> None:
        self.keys = keys
        self.metrics = metrics
        self.batch = Batch()
        self.load_dirty = False  # this router's load changed since it was last queued for the writer
        self._placed: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # key -> (placement, expires monotonic)
        self._index_seq = 0  # the last sequence number of this router's entries

    def pend(self, suffix: str, request_id: str, request: PeerRequest) -> None:
        self.batch.pending[self.keys.pending(suffix), request_id] = request  # serialized when sent, if still pending

    def release(self, suffix: str, request_id: str) -> None:
        pending = self.batch.pending
        entry = (self.keys.pending(suffix), request_id)
        if pending.get(entry) is not None:
            del pending[entry]  # not sent yet: nothing to take back
        else:
            pending[entry] = None

    def place(self, suffix: str, placement: Placement, digest: int, ttl_s: int) -> None:
        key, value = self.keys.place(suffix), orjson.dumps((*placement, digest))
        self.batch.placements[key] = (value, ttl_s * 1000)
        self._placed.pop(key, None)
        self._placed[key] = (value, time.monotonic() + ttl_s)
        if len(self._placed) > REPUBLISHED:
            self._placed.popitem(last=False)

    def take(self) -> tuple[Batch, bool]:
        """The batch to send and whether the load is in it; the queue starts empty again."""
        writes, self.batch = self.batch, Batch()
        load_dirty, self.load_dirty = self.load_dirty, False
        return writes, load_dirty

    def keep(self, writes: Batch, load_dirty: bool) -> None:
        """A batch that was not written goes back in front of the queue (at most MAX_QUEUED_WRITES)."""
        queue = writes.under(self.batch)
        over = len(queue) - MAX_QUEUED_WRITES
        for oldest_first in (queue.placements, queue.pending):
            gone = list(itertools.islice(oldest_first, max(0, over)))
            for key in gone:
                del oldest_first[key]  # type: ignore[arg-type]
            over -= len(gone)
            self.metrics.store_writes_dropped += len(gone)
        self.batch = queue
        self.load_dirty = self.load_dirty or load_dirty

    def place_again(self) -> None:
        """Queue again the placements this router wrote that have not expired (newer writes win)."""
        now = time.monotonic()
        while self._placed and next(iter(self._placed.values()))[1] <= now:
            self._placed.popitem(last=False)
        again = {key: (value, int((expires - now) * 1000) + 1) for key, (value, expires) in self._placed.items()}
        self.batch.placements = {**again, **self.batch.placements}

    def queue_index(self, changes: list[IndexChange]) -> None:
        """This router's changes to its index since the last batch join the queue (kept while the
        store is out of use: the latest MAX_QUEUED_WRITES)."""
        queue = self.batch.changes
        queue += changes
        if len(queue) > MAX_QUEUED_WRITES:
            self.metrics.store_writes_dropped += len(queue) - MAX_QUEUED_WRITES
            del queue[:-MAX_QUEUED_WRITES]

    def index_entries(self, writes: Batch) -> list[Entry]:
        """The batch's changes as entries (numbered now, and kept in the batch: sent again, they keep
        their numbers), after any sent before; the latest INDEX_KEPT: the store would trim the older."""
        if writes.changes:
            writes.index += encode(writes.changes, self._index_seq + 1)
            self._index_seq = writes.index[-1][0]
            writes.changes = []
        if len(writes.index) > INDEX_KEPT:
            self.metrics.store_writes_dropped += len(writes.index) - INDEX_KEPT
            del writes.index[:-INDEX_KEPT]
        return writes.index
