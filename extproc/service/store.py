"""Several routers' shared state in Redis (store.url; docs/several-gateways.md).

Each router keeps its own in-flight ledger, the only writer of its own figures, and shares:
  - ``<prefix>:load:<router>``: its own load per replica, rewritten after its load changes (at
    most once per batch of writes) and on a heartbeat every third of store.load_ttl_seconds,
    expiring after that TTL: a router killed without a goodbye stops counting on the others
    within it, so no load can leak. It is a sorted set holding the latest figures alone, their
    score a ``seq`` that only grows: each write adds its figures (ZADD GT: a late copy of the
    same figures does not lower their seq) and keeps the highest seq (ZREMRANGEBYRANK), so a
    write that was delayed on the network never overwrites a newer one, whatever order they
    land in, with nothing to check. ``<prefix>:routers`` is the set of router ids that
    published, each added after its load; an id whose load key has gone (expired, evicted) is
    dropped from it by the read that finds it so, unless it publishes again meanwhile (WATCH).
  - ``<prefix>:place:<conversation key>``: where the conversation was last served, its prompt
    tokens and the history digest of that request (continuation.py: only a body that continues
    it may use it), written when a request completes. A conversation's first placement expires
    after store.first_placement_ttl_seconds, one that came back after store.placement_ttl_seconds:
    one-shot ids go first, by their TTL and by eviction (volatile-ttl, docs/several-gateways.md).
  - ``<prefix>:pending:<conversation key>``: the conversation's requests in flight (request
    id -> router, replica, charged tokens, prompt tokens, history hash), so that a router
    given the next turn can tell that another router's request was answered (peers.py).
  - ``<prefix>:answers``: a stream of the answers' timings each router learnt replica speeds
    from (routing/speeds.py), one entry per batch of writes {router, [[replica, prompt_n,
    prompt_ms, predicted_n, predicted_ms, cache_n], ...]}, the latest ANSWERS_KEPT entries.
    Every router learns the others' answers too, so all learn from every answer, as one router
    would (the order differs by at most a batch). No round trip of its own: each batch of
    writes reads what came since the last (XREAD), so the others' answers arrive within
    WRITE_EVERY_S of a change and within the heartbeat when idle; a new router starts by
    learning the kept entries.
  - ``<prefix>:index:<router>``: the changes this router made to llm-aware's prefix index, a
    stream the others read and make the same changes from (store_index.py), about INDEX_KEPT
    entries of at most INDEX_ENTRY_BYTES of blocks each.
Every key has a TTL, so a store under maxmemory can always evict to take a router's write.

The store runs no script for the routers (their user may not: a script's memory escapes
maxmemory and a long one blocks the store; docs/shared-state.md#trust-model): plain
commands only.

Before a decision: ONE round trip, a pipeline returning the placement, the pending requests,
and the latest load and new changes to the prefix index of each other router. Which routers
there are is read by each batch of writes (SRANDMEMBER), not by each decision: a router that
joined counts from this router's next batch (within WRITE_EVERY_S under load, the heartbeat
when idle). Each batch of writes reads the new changes to the index too, so an idle router
keeps up. No MULTI: the writes are pipelines, not transactions, so a transaction around the
read would promise an instant the writes do not keep; each entry is checked on its own. A
router found gone (its load key expired) is removed from ``<prefix>:routers`` under WATCH
(WATCH, EXISTS, MULTI/SREM/EXEC: three round trips, by the read that finds it, once). A router's publish (load,
routers set, presence) is commands in the writer's pipeline, not one step: none needs
another's result (the load's layout needs no check) and the id is added after the load, so a
reader that finds the id finds the load, and one in between sees the router as before its
publish. Every value read is checked (``_snapshot``): an entry that does not parse, or claims
more than a router could publish, or is a load key of another type, is skipped and counted
(``llm_ring_store_invalid_entries_total``), the rest used. The writes (pending, placement, own
load) are queued and sent by one writer in pipelined batches (what came in within
WRITE_EVERY_S), never waited for by a decision.

Failures cost as little as they can:
  - a read slower than store.timeout_ms (plus the event loop's own recent lag: a busy router
    is not a slow store) costs that one decision its shared view; nothing else changes;
  - a batch of writes that fails or is slow is kept and sent again (every write is idempotent:
    SET, HSET, HDEL, PEXPIRE, and the load under its growing ``seq``); newer writes of the same
    key replace it; its answers alone are not sent again (an XADD is not idempotent). At most
    MAX_QUEUED_WRITES are kept; beyond, the oldest are dropped and counted
    (``llm_ring_store_writes_dropped_total``): only a long outage gets there;
  - a lost link (refused, reset, auth refused) puts the router on its own state
    (``llm_ring_store_in_use`` 0, reads return None at once) and it reconnects every
    store.retry_seconds;
  - after a reconnection, or when the store is found emptied (this router missing from
    ``<prefix>:present``: a restart without persistence, a FLUSHALL), the router publishes again its load, its
    pending requests and the placements it wrote that have not expired (at most REPUBLISHED).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import orjson
import redis.asyncio as aioredis
import structlog
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as LinkError
from redis.exceptions import RedisError, WatchError
from redis.typing import KeyT, StreamIdT

from extproc.envoy.contract import STREAM_IDLE_TIMEOUT_S
from extproc.routing.peers import PeerRequest, ReplicaLoads
from extproc.routing.placement import Placement
from extproc.routing.prefix_index import IndexChange
from extproc.routing.speeds import AnswerTimings
from extproc.service.metrics import Metrics
from extproc.service.store_index import INDEX_KEPT, INDEX_READ, Entry, IndexReader, Limits, encode, entry_fields
from extproc.settings import StoreSettings, read_secret_file

log = structlog.get_logger("extproc.service")

FAILURES = (RedisError, OSError, TimeoutError)
MAX_CONNECTIONS = 32  # decisions beyond this wait for a connection (within the timeout)
MAX_QUEUED_WRITES = 100_000  # kept through an outage (about 200 bytes each); the oldest beyond are dropped
REPUBLISHED = 100_000  # the latest placements this router wrote, kept to publish again after an outage
# the writer gathers what comes in this long into one batch: far fewer pipelines under load (the
# service's CPU per request), at the price of the others seeing this router's figures that much later
WRITE_EVERY_S = 0.01
WRITE_RETRY_S = 0.05  # a failed batch is sent again this much later (with whatever came in since)
# a batch reads the routers' ids, the others' answers and their changes to the index at most this often
# (not each of a busy router's batches): a router that joined counts this much later at most
READ_EVERY_S = 0.1
PENDING_TTL_MS = 2 * STREAM_IDLE_TIMEOUT_S * 1000  # no request stays pending longer (lifecycle.LOST_AFTER_S)
MAX_ROUTERS = 64  # peers read per decision: a set flooded with ids cannot make a read unbounded
MAX_PENDING = 256  # a conversation's pending requests read per decision
MAX_NAME_CHARS = 253  # a replica name (a DNS name at most) or a router id
ANSWERS_KEPT = 1000  # batches of answers' timings the stream keeps (about MAXLEN; a new router learns them)
ANSWERS_READ = 100  # stream entries read per batch of writes (a new router catches up over a few)
MAX_ANSWERS_PER_ENTRY = 4096  # answers read of one entry
MAX_ANSWER_MS = PENDING_TTL_MS  # no answer takes longer (the pending TTL)
LAG_EVERY_S = 0.02  # the event loop's lag is sampled this often
LAG_DECAY = 0.9  # ... and remembered as a maximum that decays by this per sample

@dataclass(frozen=True, slots=True)
class EntryBounds:
    """The most a real router can publish: beyond it an entry read from the store is forged or
    corrupt, and skipped."""

    max_peer_requests: int  # store.max_peer_requests: one router's requests in flight on one replica
    max_request_tokens: int  # one request's charged tokens: the largest prompt plus the largest output


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the store holds for one decision (peers.peer_view makes it a PeerView)."""

    placement: Placement | None
    digest: int  # the history digest of the request that left ``placement`` (0: none)
    pending: tuple[PeerRequest, ...]
    loads: dict[str, ReplicaLoads]  # other live routers -> replica -> (requests, tokens)


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


class SharedStore:
    def __init__(
        self,
        settings: StoreSettings,
        router_id: str,
        own_loads: Callable[[], Mapping[str, tuple[int, int]]],
        metrics: Metrics,
        bounds: EntryBounds,
        on_recovered: Callable[[], None] = lambda: None,
        on_answer: Callable[[str, AnswerTimings], None] = lambda replica, timings: None,
        view_changes: Callable[[], list[IndexChange]] = list,
        on_index: Callable[[list[IndexChange]], None] = lambda changes: None,
    ) -> None:
        self.settings = settings
        self.router_id = router_id
        self.own_loads = own_loads  # read when publishing: always the latest figures
        self.metrics = metrics
        self.bounds = bounds
        self.on_recovered = on_recovered  # re-queue this router's pending requests
        self.on_answer = on_answer  # another router's answer: learn the replica's speed from it
        self.view_changes = view_changes  # this router's changes to its prefix index, for the others
        self.on_index = on_index  # another router's changes to the index: make them here
        self.timeout = settings.timeout_ms / 1000
        prefix = settings.key_prefix
        self._routers_key = f"{prefix}:routers"
        self._present_key = f"{prefix}:present"
        self._load_prefix = f"{prefix}:load:".encode()
        self._own = router_id.encode()
        self._peers: tuple[bytes, ...] = ()  # the other routers' ids the last read found
        self._place_prefix = f"{prefix}:place:"
        self._pending_prefix = f"{prefix}:pending:"
        self._answers_key = f"{prefix}:answers"
        self._answers_seen = b"0-0"  # the last stream entry read: from the oldest kept at the start
        self._index_prefix = f"{prefix}:index:".encode()
        self._index = IndexReader(Limits(bounds.max_request_tokens, MAX_NAME_CHARS))
        self._index_seq = 0  # the last sequence number of this router's entries
        password = read_secret_file("store.password_file", settings.password_file)
        # each call's bound is asyncio's (the timeout plus the loop's lag), which also closes a
        # connection it cuts short (redis-py disconnects on a cancelled read); no socket timeout
        # besides: its timer around every reply cost a decision ~40 µs of CPU
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.url, max_connections=MAX_CONNECTIONS, timeout=None, password=password,
            socket_timeout=None, socket_connect_timeout=10 * self.timeout,
        )  # fmt: skip
        self.client = aioredis.Redis.from_pool(pool)
        self._writes = Batch()
        self._placed: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # key -> (placement, expires monotonic)
        self._load_dirty = False
        self._seq = 0
        self._published = False  # the own load key was written since the last (re)connection
        self._announced_at = -math.inf  # when this router's id and presence were last queued (_publish)
        self._read_at = -math.inf  # when a batch last read the routers, answers and index changes
        self._lag = 0.0  # the event loop's recent lag, seconds (a decaying maximum)
        self._wake = asyncio.Event()
        self._lost = asyncio.Event()
        self._writing = False  # a batch is on its way
        self._closing = False
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def in_use(self) -> bool:
        return self.metrics.store_in_use

    async def start(self) -> None:
        """Connect (or not: then local state until a retry succeeds) and start the writer, the
        heartbeat and the lag gauge."""
        await self._connect()
        self._tasks = [asyncio.create_task(self._write_loop()), asyncio.create_task(self._keep_connected()),
                       asyncio.create_task(self._watch_lag())]

    async def flushed(self) -> None:
        """Return once every write queued so far has been sent (or the store is not in use)."""
        while self.in_use and (self._writes or self._load_dirty or self._writing):
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        """Stop: the writer sends what is queued, then the router says it leaves (its load key goes
        at once rather than by TTL). Bounded: each step by the timeout. The loops are told by a
        flag, not only cancelled: on Debian's Python 3.11.2 the tests saw the writer's cancellation
        lost (its task left waiting forever), which a flag cannot be."""
        self._closing = True
        self._wake.set()
        if self._tasks:
            for task in self._tasks[1:]:
                task.cancel()
            await asyncio.wait(self._tasks, timeout=3 * self.timeout)
        for task in self._tasks:
            task.cancel()
        if self.in_use:
            with contextlib.suppress(*FAILURES):
                async with asyncio.timeout(self.timeout):
                    pipe = self.client.pipeline(transaction=False)
                    pipe.delete(self._load_key(self._own))
                    pipe.srem(self._routers_key, self.router_id)
                    pipe.hdel(self._present_key, self.router_id)
                    await pipe.execute()
        await self.client.aclose()

    # ------------------------------------------------------------------ before a decision

    async def read(self, conversation_key: int) -> Snapshot | None:
        """The shared picture for one decision; None (at once, or after at most the timeout and
        the loop's lag) when the store is not in use or does not answer in time."""
        if not self.in_use:
            return None
        deadline = asyncio.get_running_loop().time() + self._budget()
        try:
            async with asyncio.timeout_at(deadline):
                placement, pending, loads = await self._read_view(f"{conversation_key:016x}")
        except FAILURES as exc:
            self._failed("read", exc)
            return None
        if gone := [router for router, latest in loads.items() if latest == []]:
            self._peers = tuple(router for router in self._peers if router not in gone)  # until a batch meets it
            with contextlib.suppress(*FAILURES):  # left for the next batch's SRANDMEMBER to find again
                async with asyncio.timeout_at(deadline):
                    await self._forget(gone)
        return self._snapshot(placement, pending, loads)

    async def _read_view(self, suffix: str) -> tuple[bytes | None, dict[bytes, bytes], dict[bytes, object]]:
        """The conversation's placement and pending requests, and the other routers' latest loads
        (router id -> [load] or [] when its key is gone) and new changes to the prefix index, in one
        pipeline. The other routers are those this router's last batch of writes found (or its
        connection): a router that joined counts from the batch after, within WRITE_EVERY_S under
        load, the heartbeat when idle."""
        peers = self._peers
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self._place_prefix + suffix)
        pipe.hgetall(self._pending_prefix + suffix)
        for router in peers:
            pipe.zrange(self._load_key(router), -1, -1)  # the highest seq
        self._read_index(pipe, peers)
        # a load key of another type (forged, or an earlier release's hash) comes back as its error:
        # skipped and counted like any bad entry
        placement, pending, *latest = await pipe.execute(raise_on_error=False)
        for reply in (placement, pending):
            if isinstance(reply, Exception):
                raise reply
        if peers:
            self._take_index(latest.pop())
        return placement, pending, dict(zip(peers, latest, strict=True))

    def _read_index(self, pipe: Pipeline, routers: tuple[bytes, ...]) -> None:
        """Queue the read of ``routers``' new changes to the prefix index (none: nothing queued)."""
        if routers:
            streams: dict[KeyT, StreamIdT] = dict(self._index.streams(self._index_prefix, routers).items())
            pipe.xread(streams, count=INDEX_READ)

    def _take_index(self, reply: object) -> None:
        """The other routers' changes read, each entry checked, made in this router's index."""
        changes, invalid, missed = self._index.take(self._index_prefix, reply)
        self.metrics.store_invalid["index"] += invalid
        self.metrics.store_index_missed += missed
        if changes:
            self.metrics.store_index_applied += len(changes)
            self.on_index(changes)

    def _queue_index(self) -> None:
        """This router's changes to its index since the last batch join the queue (kept while the
        store is out of use: the latest MAX_QUEUED_WRITES)."""
        queue = self._writes.changes
        queue += self.view_changes()
        if len(queue) > MAX_QUEUED_WRITES:
            self.metrics.store_writes_dropped += len(queue) - MAX_QUEUED_WRITES
            del queue[:-MAX_QUEUED_WRITES]

    def _index_entries(self, writes: Batch) -> list[Entry]:
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

    async def _forget(self, routers: list[bytes]) -> None:
        """Routers whose load key is gone (killed without a goodbye, or evicted) leave the routers
        set, each unless it publishes again meanwhile: under WATCH, a write of its load key
        between the check and the removal cancels the removal."""
        for router in routers:
            key = self._load_key(router)
            async with self.client.pipeline(transaction=True) as pipe:
                await pipe.watch(key)
                if await pipe.exists(key):
                    continue
                pipe.multi()
                pipe.srem(self._routers_key, router)
                with contextlib.suppress(WatchError):
                    await pipe.execute()

    def _load_key(self, router: bytes) -> bytes:
        return self._load_prefix + router

    # ------------------------------------------------------------------ after one (queued)

    def routed(self, conversation_key: int, request_id: str, request: PeerRequest) -> None:
        """This router decided ``request``: its load changed; a chat request (history != 0) is
        pending until it completes or a later turn shows it answered."""
        if request.history:
            pending_key = f"{self._pending_prefix}{conversation_key:016x}"
            self._writes.pending[pending_key, request_id] = request  # serialized when sent, if still pending
        self.load_changed()

    def completed(
        self, conversation_key: int, request_id: str, placement: Placement | None, digest: int, returning: bool
    ) -> None:
        """A request of this router is over (placement: where its cache now is, if it succeeded;
        digest: its history digest; returning: its conversation came back, it lives long)."""
        suffix = f"{conversation_key:016x}"
        pending = self._writes.pending
        entry = (self._pending_prefix + suffix, request_id)
        if pending.get(entry) is not None:
            del pending[entry]  # not sent yet: nothing to take back
        else:
            pending[entry] = None
        if placement is not None:
            ttl_s = self.settings.placement_ttl_seconds if returning else self.settings.first_placement_ttl_seconds
            self._place(suffix, placement, digest, ttl_s)
        self.load_changed()

    def answered(self, replica: str, timings: AnswerTimings) -> None:
        """This router learnt ``replica``'s speed from an answer: the others learn it too (not while
        the store is out of use: then each router learns from its own answers alone)."""
        if self.in_use:
            self._writes.answers.append((replica, timings))
            self._wake.set()

    def moved(self, conversation_key: int, placement: Placement, digest: int) -> None:
        """The conversation's cache was moved (a migration): its next turn belongs on
        ``placement``, for every router reading the store (a returning conversation's lifetime)."""
        self._place(f"{conversation_key:016x}", placement, digest, self.settings.placement_ttl_seconds)
        self._wake.set()

    def _place(self, suffix: str, placement: Placement, digest: int, ttl_s: int) -> None:
        key, value = self._place_prefix + suffix, orjson.dumps((*placement, digest))
        self._writes.placements[key] = (value, ttl_s * 1000)
        self._placed.pop(key, None)
        self._placed[key] = (value, time.monotonic() + ttl_s)
        if len(self._placed) > REPUBLISHED:
            self._placed.popitem(last=False)

    def load_changed(self) -> None:
        self._load_dirty = True
        self._wake.set()

    # ------------------------------------------------------------------ the background

    async def _write_loop(self) -> None:
        """One writer: batches go out in order, each a pipeline, the own load last (latest figures).
        A batch that fails is kept, under what came in since."""
        while not self._closing or (self._writes and self.in_use):
            await self._wake.wait()
            if not self._closing:
                await asyncio.sleep(WRITE_EVERY_S)
            self._queue_index()
            if not self.in_use:  # kept: the reconnection wakes the writer
                self._wake.clear()
                if self._closing:
                    return
                continue
            self._wake.clear()
            writes, self._writes = self._writes, Batch()
            load_dirty, self._load_dirty = self._load_dirty, False
            self._writing = True
            try:
                await self._send(writes, load_dirty)
            except FAILURES as exc:
                self._keep(writes, load_dirty)
                self._failed("write", exc)
                if not self._closing:
                    await asyncio.sleep(WRITE_RETRY_S)
                self._wake.set()
            finally:
                self._writing = False

    async def _send(self, writes: Batch, load_dirty: bool) -> None:
        pipe = self.client.pipeline(transaction=False)
        now, peers = time.monotonic(), self._peers
        reads = now - self._read_at >= READ_EVERY_S
        if reads:  # first: what came before ours
            self._read_at = now
            pipe.xread({self._answers_key: self._answers_seen}, count=ANSWERS_READ)
            pipe.srandmember(self._routers_key, MAX_ROUTERS)  # the decisions read the loads of these
            self._read_index(pipe, peers)  # an idle router keeps up too
        index_key, index_ttl_ms = self._index_prefix + self._own, int(self.settings.first_placement_ttl_seconds * 1000)
        entries = self._index_entries(writes)
        for numbered in entries:
            pipe.xadd(index_key, entry_fields(numbered), maxlen=INDEX_KEPT, approximate=True)  # type: ignore[arg-type]
        if entries:
            pipe.pexpire(index_key, index_ttl_ms)
        if writes.answers:
            answers = orjson.dumps([(replica, *timings) for replica, timings in writes.answers])
            pipe.xadd(self._answers_key, {"router": self.router_id, "answers": answers}, maxlen=ANSWERS_KEPT,
                      approximate=True)
            pipe.pexpire(self._answers_key, int(self.settings.placement_ttl_seconds * 1000))
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
        present = self._publish(pipe, now) if load_dirty else None
        async with asyncio.timeout(self._budget() + self.timeout * len(writes) / 1000):
            results = await pipe.execute()
        if reads:
            self._learn(results[0])
            self._peers = tuple(router for router in results[1] if router != self._own)
            if peers:
                self._take_index(results[2])
        if present is not None and results[present] == 1 and self._published:  # the store lost its state
            log.warning("store_emptied", router=self.router_id)
            self._republish()
        self._published = self._published or load_dirty

    def _publish(self, pipe: Pipeline, now: float) -> int | None:
        """Queue this router's load, and with the first publish after a connection and then once
        a heartbeat (not each of a busy router's batches), its id among the routers' and its
        presence; the index of the presence's reply (None: not queued): 1 when the store did not
        know this router (first publish, or the store lost its state: restarted empty, flushed).
        The presence hash (router -> 1) lives as long as a placement, so eviction (volatile-ttl)
        takes it last."""
        self._seq += 1
        key, ttl_ms = self._load_key(self._own), int(self.settings.load_ttl_seconds * 1000)
        pipe.zadd(key, {orjson.dumps(dict(self.own_loads())): self._seq}, gt=True)
        pipe.zremrangebyrank(key, 0, -2)  # the highest seq alone stays, whatever order writes land in
        pipe.pexpire(key, ttl_ms)
        if self._published and now - self._announced_at < self.settings.load_ttl_seconds / 3:
            return None
        self._announced_at = now
        pipe.sadd(self._routers_key, self.router_id)  # after the load: a reader finding the id finds it
        pipe.pexpire(self._routers_key, 10 * ttl_ms)
        present = len(pipe)
        pipe.hsetnx(self._present_key, self.router_id, "1")
        pipe.pexpire(self._present_key, self.settings.placement_ttl_seconds * 1000)
        return present

    def _keep(self, writes: Batch, load_dirty: bool) -> None:
        """A batch that was not written goes back in front of the queue (at most MAX_QUEUED_WRITES)."""
        queue = writes.under(self._writes)
        over = len(queue) - MAX_QUEUED_WRITES
        for oldest_first in (queue.placements, queue.pending):
            gone = list(itertools.islice(oldest_first, max(0, over)))
            for key in gone:
                del oldest_first[key]  # type: ignore[arg-type]
            over -= len(gone)
            self.metrics.store_writes_dropped += len(gone)
        self._writes = queue
        self._load_dirty = self._load_dirty or load_dirty

    def _republish(self) -> None:
        """Queue again what this router has published and is still true: its pending requests (the
        gateway's), its placements not expired, its load."""
        now = time.monotonic()
        while self._placed and next(iter(self._placed.values()))[1] <= now:
            self._placed.popitem(last=False)
        again = {key: (value, int((expires - now) * 1000) + 1) for key, (value, expires) in self._placed.items()}
        self._writes.placements = {**again, **self._writes.placements}
        self.on_recovered()
        self.metrics.store_republished += 1
        self.load_changed()

    async def _keep_connected(self) -> None:
        """The heartbeat keeps the own load key alive; a lost link is reconnected every retry_seconds."""
        while not self._closing:
            if self.in_use:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._lost.wait(), self.settings.load_ttl_seconds / 3)
                if self.in_use:
                    self.load_changed()
            else:
                await asyncio.sleep(self.settings.retry_seconds)
                await self._connect()

    async def _connect(self) -> None:
        await self.client.connection_pool.disconnect()  # connections to a store that went away are dead
        try:
            async with asyncio.timeout(self._budget()):
                members = await self.client.execute_command("SRANDMEMBER", self._routers_key, MAX_ROUTERS)
        except FAILURES as exc:
            self._failed("connect", exc)
            return
        self._peers = tuple(router for router in members if router != self._own)  # the first read's
        self._index.restart()
        self._lost.clear()
        self._published = False
        self._read_at = -math.inf
        self.metrics.store_in_use = True
        log.info("store_in_use", url=_without_password(self.settings.url), router=self.router_id)
        self._republish()

    async def _watch_lag(self) -> None:
        """How late the event loop runs what is due: a call that took long on a busy loop may have
        been answered in time, so each call's bound is the timeout plus this."""
        loop = asyncio.get_running_loop()
        while not self._closing:
            due = loop.time() + LAG_EVERY_S
            await asyncio.sleep(LAG_EVERY_S)
            self._lag = max(loop.time() - due, self._lag * LAG_DECAY)

    def _budget(self) -> float:
        return self.timeout + min(self._lag, 2 * self.timeout)

    def _failed(self, call: str, exc: BaseException) -> None:
        """A call failed: a slow or refused one costs only itself; a lost link puts the router on
        its own state until a reconnection."""
        self.metrics.store_errors[call] += 1
        if not _link_lost(exc) and call != "connect":
            return
        if self.metrics.store_in_use or (call == "connect" and self.metrics.store_errors[call] == 1):
            log.warning("store_unavailable", call=call, error=type(exc).__name__, detail=str(exc)[:200],
                        retry_every_s=self.settings.retry_seconds)
        self.metrics.store_in_use = False
        self._lost.set()

    # ------------------------------------------------------------------ what was read

    def _snapshot(
        self, raw_placement: bytes | None, raw_pending: dict[bytes, bytes], raw_loads: dict[bytes, object]
    ) -> Snapshot:
        """What was read, every entry checked: what does not parse or is out of bounds is skipped
        and counted, never fatal."""
        placement, digest, pending, loads = None, 0, [], {}
        if raw_placement is not None:
            try:
                placement, digest = self._placement(raw_placement)
            except (ValueError, TypeError):
                self.metrics.store_invalid["placement"] += 1
        for value in itertools.islice(raw_pending.values(), MAX_PENDING):
            try:
                pending.append(self._pending(value))
            except (ValueError, TypeError):
                self.metrics.store_invalid["pending"] += 1
        for router, latest in raw_loads.items():
            if latest == []:
                continue  # its load key is gone: it left
            try:  # an error reply (a key of another type) is no list: TypeError
                loads[_name(router)] = self._loads(latest[0])  # type: ignore[index]
            except (ValueError, TypeError, UnicodeDecodeError):
                self.metrics.store_invalid["load"] += 1
        return Snapshot(placement, digest, tuple(pending), loads)

    def _learn(self, reply: object) -> None:
        """The other routers' answers read from the stream, each checked: an entry that does not
        parse or is out of bounds is skipped and counted, the rest learnt in order."""
        entries = reply[0][1] if isinstance(reply, list) and reply and isinstance(reply[0], list | tuple) else []
        for entry_id, fields in entries:
            self._answers_seen = entry_id
            try:
                router = _name(fields[b"router"])
                answers = [] if router == self.router_id else self._answers(fields[b"answers"])
            except (ValueError, TypeError, KeyError, UnicodeDecodeError):
                self.metrics.store_invalid["answers"] += 1
                continue
            for replica, timings in answers:
                self.on_answer(replica, timings)
            self.metrics.store_answers_learnt += len(answers)

    def _answers(self, raw: bytes) -> list[tuple[str, AnswerTimings]]:
        answers = orjson.loads(raw)
        if not isinstance(answers, list) or len(answers) > MAX_ANSWERS_PER_ENTRY:
            raise TypeError("answers are a list")
        limit = self.bounds.max_request_tokens
        return [(_name(replica), AnswerTimings(self._tokens(prompt_n, limit), _ms(prompt_ms),
                                               self._tokens(predicted_n, limit), _ms(predicted_ms),
                                               self._tokens(cache_n, limit)))
                for replica, prompt_n, prompt_ms, predicted_n, predicted_ms, cache_n in answers]

    def _placement(self, raw: bytes) -> tuple[Placement, int]:
        replica, tokens, digest = orjson.loads(raw)
        return Placement(_name(replica), self._tokens(tokens, self.bounds.max_request_tokens)), _digest(digest)

    def _pending(self, raw: bytes) -> PeerRequest:
        router, replica, charged, prompt, history = orjson.loads(raw)
        limit = self.bounds.max_request_tokens
        return PeerRequest(_name(router), _name(replica), self._tokens(charged, limit), self._tokens(prompt, limit),
                           _digest(history))

    def _loads(self, raw: bytes) -> ReplicaLoads:
        by_replica = orjson.loads(raw)
        if not isinstance(by_replica, dict):
            raise TypeError("a load is an object")
        loads = {}
        for replica, (requests, tokens) in by_replica.items():
            requests = self._tokens(requests, self.bounds.max_peer_requests)
            loads[_name(replica)] = (requests, self._tokens(tokens, requests * self.bounds.max_request_tokens))
        return loads

    @staticmethod
    def _tokens(value: object, limit: int) -> int:
        if type(value) is not int or not 0 <= value <= limit:
            raise ValueError(f"{value!r} is not a count within 0..{limit}")
        return value


def _name(value: object) -> str:
    text = value.decode() if isinstance(value, bytes) else value
    if not isinstance(text, str) or not 0 < len(text) <= MAX_NAME_CHARS:
        raise ValueError("not a name")
    return text


def _ms(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_ANSWER_MS:
        raise ValueError(f"{value!r} is not a duration within 0..{MAX_ANSWER_MS} ms")
    return float(value)


def _digest(value: object) -> int:
    if type(value) is not int or not 0 <= value < 1 << 64:
        raise ValueError("not a 64-bit digest")
    return value


def _link_lost(exc: BaseException) -> bool:
    """The connection is gone (refused, reset, closed, auth refused); not a slow call, which
    costs only itself."""
    if isinstance(exc, ConnectionRefusedError | ConnectionResetError | BrokenPipeError):
        return True
    return isinstance(exc, LinkError) and not isinstance(exc, TimeoutError)


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if "@" in rest else url
