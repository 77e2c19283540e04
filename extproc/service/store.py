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
publish. Every value read is checked (store_layout.py): an entry that does not parse, or claims
more than a router could publish, or is a load key of another type, is skipped and counted
(``llm_ring_store_invalid_entries_total``), the rest used. The writes (pending, placement, own
load) are queued (store_queue.py) and sent by one writer in pipelined batches (what came in within
WRITE_EVERY_S, store_writer.py), never waited for by a decision.

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

The parts, one job each: store_layout.py (the keys, each entry read checked), store_link.py (the
connection, each call's budget, failures), store_queue.py (the writes waiting), store_writer.py
(the writer's batches), store_peers.py (the other routers' ids, answers and index changes). This
module composes them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping

from redis.exceptions import WatchError

from extproc.routing.peers import PeerRequest
from extproc.routing.placement import Placement
from extproc.routing.prefix_index import IndexChange
from extproc.routing.speeds import AnswerTimings
from extproc.service.metrics import Metrics
from extproc.service.store_layout import EntryBounds, EntryChecks, Keys, Snapshot
from extproc.service.store_link import FAILURES, StoreLink
from extproc.service.store_peers import Peers
from extproc.service.store_queue import WriteQueue
from extproc.service.store_writer import READ_EVERY_S, StoreWriter
from extproc.settings import StoreSettings

__all__ = ["READ_EVERY_S", "EntryBounds", "SharedStore", "Snapshot"]


class SharedStore:
    """This router's side of the store: the read before a decision, the writes after one (queued
    for the writer), and the link kept up (a heartbeat, reconnections, publishing again)."""

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
        self.metrics = metrics
        self.bounds = bounds
        self.on_recovered = on_recovered  # re-queue this router's pending requests
        self.view_changes = view_changes  # this router's changes to its prefix index, for the others (each batch)
        self.keys = Keys.under(settings.key_prefix)
        self.link = StoreLink(settings, router_id, metrics)
        self.checks = EntryChecks(bounds, metrics)
        self.peers = Peers(self.keys, router_id, self.checks, metrics, on_answer, on_index)
        self.queue = WriteQueue(self.keys, metrics)
        self.writer = StoreWriter(settings, router_id, own_loads, self.keys, self.link, self.queue, self.peers,
                                  metrics, view_changes=lambda: self.view_changes(), on_emptied=self._republish)
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def in_use(self) -> bool:
        return self.metrics.store_in_use

    async def start(self) -> None:
        """Connect (or not: then local state until a retry succeeds) and start the writer, the
        heartbeat and the lag gauge."""
        await self._connect()
        self._tasks = [asyncio.create_task(self.writer.run()), asyncio.create_task(self._keep_connected()),
                       asyncio.create_task(self.link.watch_lag())]

    async def flushed(self) -> None:
        """Return once every write queued so far has been sent (or the store is not in use)."""
        while self.in_use and (self.queue.batch or self.queue.load_dirty or self.writer.writing):
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        """Stop: the writer sends what is queued, then the router says it leaves (its load key goes
        at once rather than by TTL). Bounded: each step by the timeout. The loops are told by a
        flag, not only cancelled: on Debian's Python 3.11.2 the tests saw the writer's cancellation
        lost (its task left waiting forever), which a flag cannot be."""
        timeout = self.link.timeout
        self.link.closing = True
        self.writer.wake.set()
        if self._tasks:
            for task in self._tasks[1:]:
                task.cancel()
            await asyncio.wait(self._tasks, timeout=3 * timeout)
        for task in self._tasks:
            task.cancel()
        if self.in_use:
            with contextlib.suppress(*FAILURES):
                async with asyncio.timeout(timeout):
                    await self.writer.leave()
        await self.link.client.aclose()

    # ------------------------------------------------------------------ before a decision

    async def read(self, conversation_key: int) -> Snapshot | None:
        """The shared picture for one decision; None (at once, or after at most the timeout and
        the loop's lag) when the store is not in use or does not answer in time."""
        if not self.in_use:
            return None
        deadline = asyncio.get_running_loop().time() + self.link.budget()
        try:
            async with asyncio.timeout_at(deadline):
                placement, pending, loads = await self._read_view(f"{conversation_key:016x}")
        except FAILURES as exc:
            self.link.failed("read", exc)
            return None
        if gone := [router for router, latest in loads.items() if latest == []]:
            self.peers.gone(gone)
            with contextlib.suppress(*FAILURES):  # left for the next batch's SRANDMEMBER to find again
                async with asyncio.timeout_at(deadline):
                    await self._forget(gone)
        return self.checks.snapshot(placement, pending, loads)

    async def _read_view(self, suffix: str) -> tuple[bytes | None, dict[bytes, bytes], dict[bytes, object]]:
        """The conversation's placement and pending requests, and the other routers' latest loads
        (router id -> [load] or [] when its key is gone) and new changes to the prefix index, in one
        pipeline. The other routers are those this router's last batch of writes found (or its
        connection): a router that joined counts from the batch after, within WRITE_EVERY_S under
        load, the heartbeat when idle."""
        peers = self.peers.ids
        pipe = self.link.client.pipeline(transaction=False)
        pipe.get(self.keys.place(suffix))
        pipe.hgetall(self.keys.pending(suffix))
        for router in peers:
            pipe.zrange(self.keys.load(router), -1, -1)  # the highest seq
        self.peers.queue_index_read(pipe, peers)
        # a load key of another type (forged, or an earlier release's hash) comes back as its error:
        # skipped and counted like any bad entry
        placement, pending, *latest = await pipe.execute(raise_on_error=False)
        for reply in (placement, pending):
            if isinstance(reply, Exception):
                raise reply
        if peers:
            self.peers.take_index(latest.pop())
        return placement, pending, dict(zip(peers, latest, strict=True))

    async def _forget(self, routers: list[bytes]) -> None:
        """Routers whose load key is gone (killed without a goodbye, or evicted) leave the routers
        set, each unless it publishes again meanwhile: under WATCH, a write of its load key
        between the check and the removal cancels the removal."""
        for router in routers:
            key = self.keys.load(router)
            async with self.link.client.pipeline(transaction=True) as pipe:
                await pipe.watch(key)
                if await pipe.exists(key):
                    continue
                pipe.multi()
                pipe.srem(self.keys.routers, router)
                with contextlib.suppress(WatchError):
                    await pipe.execute()

    # ------------------------------------------------------------------ after one (queued)

    def routed(self, conversation_key: int, request_id: str, request: PeerRequest) -> None:
        """This router decided ``request``: its load changed; a chat request (history != 0) is
        pending until it completes or a later turn shows it answered."""
        if request.history:
            self.queue.pend(f"{conversation_key:016x}", request_id, request)
        self.load_changed()

    def completed(
        self, conversation_key: int, request_id: str, placement: Placement | None, digest: int, returning: bool
    ) -> None:
        """A request of this router is over (placement: where its cache now is, if it succeeded;
        digest: its history digest; returning: its conversation came back, it lives long)."""
        suffix = f"{conversation_key:016x}"
        self.queue.release(suffix, request_id)
        if placement is not None:
            ttl_s = self.settings.placement_ttl_seconds if returning else self.settings.first_placement_ttl_seconds
            self.queue.place(suffix, placement, digest, ttl_s)
        self.load_changed()

    def answered(self, replica: str, timings: AnswerTimings) -> None:
        """This router learnt ``replica``'s speed from an answer: the others learn it too (not while
        the store is out of use: then each router learns from its own answers alone)."""
        if self.in_use:
            self.queue.batch.answers.append((replica, timings))
            self.writer.wake.set()

    def moved(self, conversation_key: int, placement: Placement, digest: int) -> None:
        """The conversation's cache was moved (a migration): its next turn belongs on
        ``placement``, for every router reading the store (a returning conversation's lifetime)."""
        self.queue.place(f"{conversation_key:016x}", placement, digest, self.settings.placement_ttl_seconds)
        self.writer.wake.set()

    def load_changed(self) -> None:
        self.queue.load_dirty = True
        self.writer.wake.set()

    # ------------------------------------------------------------------ the link kept up

    async def _keep_connected(self) -> None:
        """The heartbeat keeps the own load key alive; a lost link is reconnected every retry_seconds."""
        while not self.link.closing:
            if self.in_use:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.link.lost.wait(), self.settings.load_ttl_seconds / 3)
                if self.in_use:
                    self.load_changed()
            else:
                await asyncio.sleep(self.settings.retry_seconds)
                await self._connect()

    async def _connect(self) -> None:
        members = await self.link.connect(self.peers.read_ids)
        if members is None:
            return
        self.peers.restart(members)  # the first read's
        self.writer.restart()
        self._republish()

    def _republish(self) -> None:
        """Queue again what this router has published and is still true: its pending requests (the
        gateway's), its placements not expired, its load."""
        self.queue.place_again()
        self.on_recovered()
        self.metrics.store_republished += 1
        self.load_changed()
