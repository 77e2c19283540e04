"""Several routers' shared state in Redis (store.url; docs/several-gateways.md).

Each router keeps its own in-flight ledger, the only writer of its own figures, and shares:
  - ``<prefix>:load:<router>``: its own load per replica, a hash {seq, load} rewritten after
    its load changes (at most once per batch of writes) and on a heartbeat every third of
    store.load_ttl_seconds, expiring after that TTL: a router killed without a goodbye stops
    counting on the others within it, so no load can leak. ``seq`` only grows: a write that
    was delayed on the network never overwrites a newer one (the publish script checks).
    ``<prefix>:routers`` is the set of router ids that published; an id whose load key has
    expired is dropped from it by the next read.
  - ``<prefix>:place:<conversation key>``: where the conversation was last served and its
    prompt tokens, written when a request completes, expiring after store.placement_ttl_seconds.
  - ``<prefix>:pending:<conversation key>``: the conversation's requests in flight (request
    id -> router, replica, charged tokens, prompt tokens, history hash), so that a router
    given the next turn can tell that another router's request was answered (peers.py).

Before a decision: ONE round trip, a Lua script returning the placement, the pending
requests and the other live routers' loads. The writes (pending, placement, own load) are
queued and sent by one writer in pipelined batches (what came in within WRITE_EVERY_S),
never waited for by a decision.

Failures: every call is bounded by store.timeout_ms. A failed or slow call marks the store
unusable: decisions go on with this router's own state (``read`` returns None at once),
writes are dropped, ``llm_ring_store_errors_total`` counts, ``llm_ring_store_in_use`` is 0.
After store.retry_seconds the heartbeat (never a decision) reconnects; on success the
router's own load and pending requests are published again. So a decision waits at most
store.timeout_ms for the store, however slow or dead it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import orjson
import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from extproc.envoy.contract import STREAM_IDLE_TIMEOUT_S
from extproc.routing.peers import PeerRequest, ReplicaLoads
from extproc.routing.placement import Placement
from extproc.service.metrics import Metrics
from extproc.settings import StoreSettings

log = structlog.get_logger("extproc.service")

FAILURES = (RedisError, OSError, TimeoutError)
MAX_CONNECTIONS = 32  # decisions beyond this wait for a connection (within the timeout)
MAX_QUEUED_WRITES = 20_000  # a store this far behind counts as failed
# the writer gathers what comes in this long into one batch: far fewer pipelines under load (the
# service's CPU per request), at the price of the others seeing this router's figures that much later
WRITE_EVERY_S = 0.01
PENDING_TTL_MS = 2 * STREAM_IDLE_TIMEOUT_S * 1000  # no request stays pending longer (gateway.LOST_AFTER_S)

# KEYS: placement, pending, routers set. ARGV: load key prefix, own router id.
# -> {placement or nil, pending as [field, value, ...], loads as [router, load, ...]}
READ_SCRIPT = """
local loads = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  if id ~= ARGV[2] then
    local load = redis.call('HGET', ARGV[1] .. id, 'load')
    if load then
      loads[#loads + 1] = id
      loads[#loads + 1] = load
    else
      redis.call('SREM', KEYS[3], id)
    end
  end
end
return {redis.call('GET', KEYS[1]), redis.call('HGETALL', KEYS[2]), loads}
"""

# KEYS: own load key, routers set. ARGV: seq, load, ttl ms, own router id.
PUBLISH_SCRIPT = """
local seq = tonumber(redis.call('HGET', KEYS[1], 'seq') or '-1')
if tonumber(ARGV[1]) > seq then
  redis.call('HSET', KEYS[1], 'seq', ARGV[1], 'load', ARGV[2])
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SADD', KEYS[2], ARGV[4])
return 1
"""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the store holds for one decision (peers.peer_view makes it a PeerView)."""

    placement: Placement | None
    pending: tuple[PeerRequest, ...]
    loads: dict[str, ReplicaLoads]  # other live routers -> replica -> (requests, tokens)


@dataclass(slots=True)
class Batch:
    """The writes gathered for one pipeline. A request decided and released within one batch is
    never written at all (most of them, when replicas answer within WRITE_EVERY_S), and a
    conversation's placement is written once per batch, the latest."""

    pending: dict[tuple[str, str], bytes | None] = field(default_factory=dict)  # (key, request id) -> entry; None: gone
    placements: dict[str, bytes] = field(default_factory=dict)  # key -> placement

    def __len__(self) -> int:
        return len(self.pending) + len(self.placements)


class SharedStore:
    def __init__(
        self,
        settings: StoreSettings,
        router_id: str,
        own_loads: Callable[[], Mapping[str, tuple[int, int]]],
        metrics: Metrics,
        on_recovered: Callable[[], None] = lambda: None,
    ) -> None:
        self.settings = settings
        self.router_id = router_id
        self.own_loads = own_loads  # read when publishing: always the latest figures
        self.metrics = metrics
        self.on_recovered = on_recovered  # re-queue this router's pending requests
        self.timeout = settings.timeout_ms / 1000
        prefix = settings.key_prefix
        self._routers_key = f"{prefix}:routers"
        self._load_prefix = f"{prefix}:load:"
        self._load_key = self._load_prefix + router_id
        self._place_prefix = f"{prefix}:place:"
        self._pending_prefix = f"{prefix}:pending:"
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.url, max_connections=MAX_CONNECTIONS, timeout=self.timeout,
            socket_timeout=self.timeout, socket_connect_timeout=self.timeout,
        )  # fmt: skip
        self.client = aioredis.Redis.from_pool(pool)
        self._read_sha = self._publish_sha = ""
        self._retry_at = 0.0  # monotonic: when the heartbeat may reconnect
        self._writes = Batch()
        self._load_dirty = False
        self._seq = 0
        self._wake = asyncio.Event()
        self._writing = False  # a batch is on its way
        self._closing = False
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def in_use(self) -> bool:
        return self.metrics.store_in_use

    async def start(self) -> None:
        """Connect (or not: then local state until a retry succeeds) and start the writer and heartbeat."""
        await self._connect()
        self._tasks = [asyncio.create_task(self._write_loop()), asyncio.create_task(self._heartbeat())]

    async def flushed(self) -> None:
        """Return once every write queued so far has been sent (or dropped: store not in use)."""
        while self._writes or self._load_dirty or self._writing:
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        """Stop: the writer sends what is queued, then the router says it leaves (its load key goes
        at once rather than by TTL). Bounded: each step by the timeout. The loops are told by a
        flag, not only cancelled: on Debian's Python 3.11.2 the tests saw the writer's cancellation
        lost (its task left waiting forever), which a flag cannot be."""
        self._closing = True
        self._wake.set()
        writer_and_heartbeat = self._tasks
        if writer_and_heartbeat:
            writer_and_heartbeat[1].cancel()
            await asyncio.wait(writer_and_heartbeat, timeout=3 * self.timeout)
        for task in writer_and_heartbeat:
            task.cancel()
        if self.in_use:
            with contextlib.suppress(*FAILURES):
                async with asyncio.timeout(self.timeout):
                    pipe = self.client.pipeline(transaction=False)
                    pipe.delete(self._load_key)
                    pipe.srem(self._routers_key, self.router_id)
                    await pipe.execute()
        await self.client.aclose()

    # ------------------------------------------------------------------ before a decision

    async def read(self, conversation_key: int) -> Snapshot | None:
        """The shared picture for one decision; None (at once, or after at most the timeout)
        when the store is not in use."""
        if not self.in_use:
            return None
        suffix = f"{conversation_key:016x}"
        try:
            async with asyncio.timeout(self.timeout):
                reply = await self.client.execute_command(
                    "EVALSHA", self._read_sha, 3, self._place_prefix + suffix, self._pending_prefix + suffix,
                    self._routers_key, self._load_prefix, self.router_id,
                )  # fmt: skip
            placement, pending, loads = reply
            return Snapshot(_placement(placement), tuple(_pending(pending)), dict(_loads(loads)))
        except (*FAILURES, ValueError, TypeError) as exc:  # the latter: an entry not written by this code
            self._failed("read", exc)
            return None

    # ------------------------------------------------------------------ after one (queued)

    def routed(self, conversation_key: int, request_id: str, request: PeerRequest) -> None:
        """This router decided ``request``: its load changed; a chat request (history != 0) is
        pending until it completes or a later turn shows it answered."""
        if not self.in_use:
            return
        if request.history:
            pending_key = f"{self._pending_prefix}{conversation_key:016x}"
            self._writes.pending[pending_key, request_id] = orjson.dumps(tuple(request))
        self.load_changed()

    def completed(self, conversation_key: int, request_id: str, placement: Placement | None) -> None:
        """A request of this router is over (placement: where its cache now is, if it succeeded)."""
        if not self.in_use:
            return
        suffix = f"{conversation_key:016x}"
        pending = self._writes.pending
        entry = (self._pending_prefix + suffix, request_id)
        if pending.get(entry) is not None:
            del pending[entry]  # not sent yet: nothing to take back
        else:
            pending[entry] = None
        if placement is not None:
            self._writes.placements[self._place_prefix + suffix] = orjson.dumps(tuple(placement))
        self.load_changed()

    def load_changed(self) -> None:
        self._load_dirty = True
        self._wake.set()

    # ------------------------------------------------------------------ the background

    async def _write_loop(self) -> None:
        """One writer: batches go out in order, each a pipeline, the own load last (latest figures)."""
        while not self._closing or self._writes:
            await self._wake.wait()
            if not self._closing:
                await asyncio.sleep(WRITE_EVERY_S)
            self._wake.clear()
            writes, self._writes = self._writes, Batch()
            if not self.in_use:
                self._load_dirty = False
                continue
            if len(writes) > MAX_QUEUED_WRITES:
                self._failed("write", OverflowError(f"{len(writes)} writes queued"))
                continue
            pipe = self.client.pipeline(transaction=False)
            refreshed = set()
            for (key, request_id), entry in writes.pending.items():
                if entry is None:
                    pipe.hdel(key, request_id)
                else:
                    pipe.hset(key, mapping={request_id: entry})
                    refreshed.add(key)
            for key in refreshed:
                pipe.pexpire(key, PENDING_TTL_MS)
            for key, placement in writes.placements.items():
                pipe.set(key, placement, px=self.settings.placement_ttl_seconds * 1000)
            if self._load_dirty:
                self._load_dirty = False
                self._seq += 1
                load = orjson.dumps(dict(self.own_loads()))
                ttl_ms = int(self.settings.load_ttl_seconds * 1000)
                pipe.execute_command("EVALSHA", self._publish_sha, 2, self._load_key, self._routers_key, self._seq,
                                     load, ttl_ms, self.router_id)
            self._writing = True
            try:
                async with asyncio.timeout(self.timeout):
                    await pipe.execute()
            except FAILURES as exc:
                self._failed("write", exc)
            finally:
                self._writing = False

    async def _heartbeat(self) -> None:
        """Keep the own load key alive; once retry_seconds have passed after a failure, reconnect."""
        while not self._closing:
            await asyncio.sleep(self.settings.load_ttl_seconds / 3)
            if self.in_use:
                self.load_changed()
            elif time.monotonic() >= self._retry_at:
                await self._connect()

    async def _connect(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                self._read_sha = await self.client.script_load(READ_SCRIPT)
                self._publish_sha = await self.client.script_load(PUBLISH_SCRIPT)
        except FAILURES as exc:
            self._failed("connect", exc)
            return
        self.metrics.store_in_use = True
        log.info("store_in_use", url=_without_password(self.settings.url), router=self.router_id)
        self._writes = Batch()  # from before the failure: republished below as they are now
        self.on_recovered()
        self.load_changed()

    def _failed(self, call: str, exc: BaseException) -> None:
        self.metrics.store_errors[call] += 1
        self._retry_at = time.monotonic() + self.settings.retry_seconds
        if self.metrics.store_in_use or (call == "connect" and self.metrics.store_errors[call] == 1):
            log.warning("store_unavailable", call=call, error=type(exc).__name__, detail=str(exc)[:200],
                        local_state_for_s=self.settings.retry_seconds)
        self.metrics.store_in_use = False
        self._writes = Batch()
        self._load_dirty = False


def _placement(raw: bytes | None) -> Placement | None:
    if raw is None:
        return None
    replica, tokens = orjson.loads(raw)
    return Placement(replica, tokens)


def _pending(flat: list[bytes]) -> Iterable[PeerRequest]:
    for value in flat[1::2]:
        yield PeerRequest(*orjson.loads(value))


def _loads(flat: list[bytes]) -> Iterable[tuple[str, ReplicaLoads]]:
    for router, load in zip(flat[::2], flat[1::2], strict=True):
        by_replica = orjson.loads(load)
        yield router.decode(), {replica: (requests, tokens) for replica, (requests, tokens) in by_replica.items()}


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if "@" in rest else url
