"""The shared store's one writer (store.py): the queued writes go out in pipelined batches, in
order, each with this router's latest load, and the batches read what the other routers
published (store_peers.py). A batch that fails is kept and sent again."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping

import orjson
import structlog
from redis.asyncio.client import Pipeline

from extproc.routing.prefix_index import IndexChange
from extproc.service.metrics import Metrics
from extproc.service.store_index import INDEX_KEPT, entry_fields
from extproc.service.store_layout import PENDING_TTL_MS, Keys
from extproc.service.store_link import FAILURES, StoreLink
from extproc.service.store_peers import Peers
from extproc.service.store_queue import Batch, WriteQueue
from extproc.settings import StoreSettings

log = structlog.get_logger("extproc.service")

# the writer gathers what comes in this long into one batch: far fewer pipelines under load (the
# service's CPU per request), at the price of the others seeing this router's figures that much later
WRITE_EVERY_S = 0.01
WRITE_RETRY_S = 0.05  # a failed batch is sent again this much later (with whatever came in since)
# a batch reads the routers' ids, the others' answers and their changes to the index at most this often
# (not each of a busy router's batches): a router that joined counts this much later at most
READ_EVERY_S = 0.1
ANSWERS_KEPT = 1000  # batches of answers' timings the stream keeps (about MAXLEN; a new router learns them)


class StoreWriter:
    def __init__(
        self,
        settings: StoreSettings,
        router_id: str,
        own_loads: Callable[[], Mapping[str, tuple[int, int]]],
        keys: Keys,
        link: StoreLink,
        queue: WriteQueue,
        peers: Peers,
        metrics: Metrics,
        view_changes: Callable[[], list[IndexChange]],
        on_emptied: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.router_id = router_id
        self.own_loads = own_loads  # read when publishing: always the latest figures
        self.keys = keys
        self.link = link
        self.queue = queue
        self.peers = peers
        self.metrics = metrics
        self.view_changes = view_changes  # this router's changes to its prefix index, for the others
        self.on_emptied = on_emptied  # the store lost this router's state: publish it again
        self._own_load_key = keys.load(router_id.encode())
        self._own_index_key = keys.index_prefix + router_id.encode()
        self.wake = asyncio.Event()
        self.writing = False  # a batch is on its way
        self._seq = 0
        self._published = False  # the own load key was written since the last (re)connection
        self._announced_at = -math.inf  # when this router's id and presence were last queued (_publish)
        self._read_at = -math.inf  # when a batch last read the routers, answers and index changes

    def restart(self) -> None:
        """A (re)connection: the next batch publishes everything and reads the others at once."""
        self._published = False
        self._read_at = -math.inf

    async def run(self) -> None:
        """One writer: batches go out in order, each a pipeline, the own load last (latest figures).
        A batch that fails is kept, under what came in since."""
        link = self.link
        while not link.closing or (self.queue.batch and link.in_use):
            await self.wake.wait()
            if not link.closing:
                await asyncio.sleep(WRITE_EVERY_S)
            self.queue.queue_index(self.view_changes())
            if not link.in_use:  # kept: the reconnection wakes the writer
                self.wake.clear()
                if link.closing:
                    return
                continue
            self.wake.clear()
            writes, load_dirty = self.queue.take()
            self.writing = True
            try:
                await self._send(writes, load_dirty)
            except FAILURES as exc:
                self.queue.keep(writes, load_dirty)
                link.failed("write", exc)
                if not link.closing:
                    await asyncio.sleep(WRITE_RETRY_S)
                self.wake.set()
            finally:
                self.writing = False

    async def leave(self) -> None:
        """Say this router leaves: its load key goes at once rather than by TTL."""
        pipe = self.link.client.pipeline(transaction=False)
        pipe.delete(self._own_load_key)
        pipe.srem(self.keys.routers, self.router_id)
        pipe.hdel(self.keys.present, self.router_id)
        await pipe.execute()

    async def _send(self, writes: Batch, load_dirty: bool) -> None:
        pipe = self.link.client.pipeline(transaction=False)
        now, peers = time.monotonic(), self.peers.ids
        reads = now - self._read_at >= READ_EVERY_S
        if reads:  # first: what came before ours
            self._read_at = now
            self.peers.queue_reads(pipe, peers)
        self._queue_writes(pipe, writes)
        present = self._publish(pipe, now) if load_dirty else None
        async with asyncio.timeout(self.link.budget() + self.link.timeout * len(writes) / 1000):
            results = await pipe.execute()
        if reads:
            self.peers.take_reads(results, peers)
        if present is not None and results[present] == 1 and self._published:  # the store lost its state
            log.warning("store_emptied", router=self.router_id)
            self.on_emptied()
        self._published = self._published or load_dirty

    def _queue_writes(self, pipe: Pipeline, writes: Batch) -> None:
        """The batch's commands: changes to the index, answers, pending requests, placements."""
        index_key, index_ttl_ms = self._own_index_key, int(self.settings.first_placement_ttl_seconds * 1000)
        entries = self.queue.index_entries(writes)
        for numbered in entries:
            pipe.xadd(index_key, entry_fields(numbered), maxlen=INDEX_KEPT, approximate=True)  # type: ignore[arg-type]
        if entries:
            pipe.pexpire(index_key, index_ttl_ms)
        if writes.answers:
            answers = orjson.dumps([(replica, *timings) for replica, timings in writes.answers])
            pipe.xadd(self.keys.answers, {"router": self.router_id, "answers": answers}, maxlen=ANSWERS_KEPT,
                      approximate=True)
            pipe.pexpire(self.keys.answers, int(self.settings.placement_ttl_seconds * 1000))
        refreshed = set()
        for (key, request_id), entry in writes.pending.items():
            if entry is None:
                pipe.hdel(key, request_id)
            else:
                pipe.hset(key, mapping={request_id: orjson.dumps(tuple(entry))})
                refreshed.add(key)
        for key in refreshed:
            pipe.pexpire(key, PENDING_TTL_MS)
        for key, (placement, ttl_ms) in writes.placements.items():
            pipe.set(key, placement, px=ttl_ms)

    def _publish(self, pipe: Pipeline, now: float) -> int | None:
        """Queue this router's load, and with the first publish after a connection and then once
        a heartbeat (not each of a busy router's batches), its id among the routers' and its
        presence; the index of the presence's reply (None: not queued): 1 when the store did not
        know this router (first publish, or the store lost its state: restarted empty, flushed).
        The presence hash (router -> 1) lives as long as a placement, so eviction (volatile-ttl)
        takes it last."""
        self._seq += 1
        key, ttl_ms = self._own_load_key, int(self.settings.load_ttl_seconds * 1000)
        pipe.zadd(key, {orjson.dumps(dict(self.own_loads())): self._seq}, gt=True)
        pipe.zremrangebyrank(key, 0, -2)  # the highest seq alone stays, whatever order writes land in
        pipe.pexpire(key, ttl_ms)
        if self._published and now - self._announced_at < self.settings.load_ttl_seconds / 3:
            return None
        self._announced_at = now
        pipe.sadd(self.keys.routers, self.router_id)  # after the load: a reader finding the id finds it
        pipe.pexpire(self.keys.routers, 10 * ttl_ms)
        present = len(pipe)
        pipe.hsetnx(self.keys.present, self.router_id, "1")
        pipe.pexpire(self.keys.present, self.settings.placement_ttl_seconds * 1000)
        return present
