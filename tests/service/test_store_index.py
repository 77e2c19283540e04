"""llm-aware's prefix index across routers through a real redis-server (store_index.py): a prompt
one router sent is cached for every router, within the read before a decision; forged entries are
skipped and counted; changes made while the store was down reach the others once it is back; each
router's stream stays bounded."""

from __future__ import annotations

import struct
from pathlib import Path

import orjson
import pytest

from extproc.routing import Router
from extproc.routing.prefix_index import FAILED, RESIZED, SENT, USED, IndexChange, PrefixIndex
from extproc.service.gateway import Gateway
from extproc.service.metrics import Metrics
from extproc.service.store_index import (
    INDEX_ENTRY_BYTES,
    INDEX_KEPT,
    Entry,
    IndexReader,
    Limits,
    decode,
    encode,
    entry_fields,
)
from extproc.settings import parse_routing
from extproc.stack.processes import Running
from extproc.stack.redis_server import password_file, redis_server_binary, start_redis
from tests.service.test_gateway_lifecycle import ENDPOINTS, SETTINGS, samples
from tests.service.test_store import OPEN, admin, answered, ask, eventually, folder, meet, run_closing, server, url

__all__ = ["server"]  # the fixture
needs_redis = pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server on this machine: "
                                 "`make setup` installs Debian's package (as root, apt reachable)")
LIMITS = Limits(max_tokens=10_000, max_name_chars=253)
PREFIX = b"llm-ring:index:"
SYSTEM = {"role": "system", "content": "You answer questions about the shared handbook. " * 30}  # ~6 blocks


def raw_entry(seq: int, changes: list[IndexChange]) -> dict[bytes, bytes]:
    """One entry as XREAD returns its fields."""
    [entry] = encode(changes, seq)
    return as_read(entry)


def as_read(entry: Entry) -> dict[bytes, bytes]:
    return {key.encode(): value if isinstance(value, bytes) else str(value).encode()
            for key, value in entry_fields(entry).items()}


def test_changes_come_back_as_they_were_sent_in_entries_of_bounded_size() -> None:
    big = tuple(range(1, 1500))
    changes = [IndexChange(SENT, "llm-0", big, 64, 0), IndexChange(USED, "llm-0", (big[-1],), 0, 0),
               IndexChange(FAILED, "llm-1", big[:700], 3, 0), IndexChange(RESIZED, "llm-2", (), -128, 900),
               IndexChange(SENT, "llm-1", (2**64 - 1,), 10_000, 0)]
    entries = encode(changes, 7)
    assert [seq for seq, _, _ in entries] == [7, 8]  # the second prompt would overflow the first entry
    assert all(len(blocks) <= INDEX_ENTRY_BYTES for _, _, blocks in entries)
    decoded = [decode(as_read(entry), LIMITS) for entry in entries]
    assert [seq for seq, _ in decoded] == [7, 8] and [c for _, found in decoded for c in found] == changes


@pytest.mark.parametrize("forged", [
    {b"n": b"0"}, {b"n": b"x"},
    {b"changes": b"not-json"}, {b"changes": orjson.dumps([[9, "llm-0", 1, 0, 0]])},  # no such kind
    {b"changes": orjson.dumps([[SENT, "", 1, 0, 0]])}, {b"changes": orjson.dumps([[SENT, "x" * 254, 1, 0, 0]])},
    {b"changes": orjson.dumps([[SENT, "llm-0", 10**6, 0, 1]])},  # a weight no request has
    {b"changes": orjson.dumps([[RESIZED, "llm-0", 5, 0, 1]])},  # a resize names no block
    {b"changes": orjson.dumps([[USED, "llm-0", 0, 0, 0]])},  # a use names its last block
    {b"changes": orjson.dumps([[SENT, "llm-0", 1, 0, 2]])},  # blocks missing
    {b"blocks": b"\x00" * 7},
])
def test_an_entry_that_does_not_parse_or_claims_too_much_is_refused(forged: dict[bytes, bytes]) -> None:
    good = raw_entry(1, [IndexChange(SENT, "llm-0", (5,), 10, 0)])
    assert decode(good, LIMITS)[1] == [IndexChange(SENT, "llm-0", (5,), 10, 0)]
    with pytest.raises((ValueError, TypeError, KeyError, struct.error)):
        decode({**good, **forged}, LIMITS)


def test_a_reader_applies_each_entry_once_and_counts_what_was_trimmed_before_it_read() -> None:
    reader = IndexReader(LIMITS)
    one, two, five = ([IndexChange(SENT, "llm-0", (n,), 10, 0)] for n in (1, 2, 5))
    reply = [[PREFIX + b"r-b", [(b"1-0", raw_entry(1, one)), (b"2-0", raw_entry(2, two))]]]
    assert reader.take(PREFIX, reply) == (one + two, 0, 0)
    assert reader.streams(PREFIX, [b"r-b", b"r-c"]) == {PREFIX + b"r-b": b"2-0", PREFIX + b"r-c": b"0-0"}
    reader.restart()  # a reconnection reads the kept entries again: applied ones are skipped
    again = [[PREFIX + b"r-b", [(b"1-0", raw_entry(1, one)), (b"2-0", raw_entry(2, two)), (b"9-0", raw_entry(5, five)),
                                (b"9-1", {b"n": b"6"})]]]
    assert reader.take(PREFIX, again) == (five, 1, 2)  # 3 and 4 were trimmed before it read them
    assert reader.take(PREFIX, None) == ([], 0, 0) and reader.take(PREFIX, ValueError("WRONGTYPE")) == ([], 1, 0)


async def indexed(router_id: str, server: Running, **store: object) -> Gateway:
    return await sharing_index(url(server), password_file(folder(server)), router_id, **store)


async def sharing_index(address: str, password: Path, router_id: str, **store: object) -> Gateway:
    """A gateway with llm-aware's prefix index on, sharing state through ``address``."""
    routing = parse_routing({**SETTINGS.routing.table(), "llm-aware": {
        **SETTINGS.routing.params["llm-aware"]._asdict(), "prefix_index": True}})
    gateway = Gateway(Router(routing), SETTINGS.service, Metrics())
    gateway.set_replicas(ENDPOINTS)
    gateway.metrics.watch(gateway.replica_states)
    settings = SETTINGS.store.model_copy(update={"url": address, "password_file": str(password), "timeout_ms": 500,
                                                 "retry_seconds": 0.2, "load_ttl_seconds": 0.6, **store})
    await gateway.publishing.share_state(settings, router_id)
    OPEN.append(gateway)
    return gateway


def held_by(gateway: Gateway, replica: str, blocks: tuple[int, ...]) -> int:
    """How many of ``blocks`` ``gateway``'s index holds on ``replica``."""
    index = gateway.router.policy.index  # type: ignore[attr-defined]
    assert isinstance(index, PrefixIndex)
    return index.held_prefix(replica, blocks)


@needs_redis
def test_a_prompt_one_router_sent_is_cached_for_every_router(server: Running) -> None:
    async def run() -> None:
        a, b = await indexed("r-a", server), await indexed("r-b", server)
        first = await ask(a, [SYSTEM, {"role": "user", "content": "alice asks"}], conversation="alice")
        replica, sent = a.requests.pending[first].decision.replica, a.requests.pending[first].request.prefix_blocks
        answered(a, first)
        await a.store.flushed()  # type: ignore[union-attr]
        await meet(b.store)  # type: ignore[arg-type]  # b meets r-a: its next read reads r-a's changes
        second = await ask(b, [SYSTEM, {"role": "user", "content": "bob asks something else"}], conversation="bob")
        decision = b.requests.pending[second].decision
        assert decision.replica == replica and decision.predicted_cached_tokens > 0  # a new conversation
        assert held_by(b, replica, sent) == len(sent) > 3
        assert samples(b)["llm_ring_store_index_changes_applied_total", ()] == b.metrics.store_index_applied == 2
        alone = await indexed("r-alone", server)  # the control: a router that read nothing yet
        alone.router.apply_view_changes([])
        assert held_by(alone, replica, sent) == 0

    run_closing(run)


@needs_redis
def test_forged_changes_are_skipped_and_counted_and_the_rest_applied(server: Running) -> None:
    async def run() -> None:
        a = await indexed("r-a", server)
        raw = admin(server)
        raw.sadd("llm-ring:routers", "r-forger")
        await meet(a.store)  # type: ignore[arg-type]
        good = IndexChange(SENT, "llm-1", (11, 12, 13), 64, 0)
        for entry in ({b"n": b"1", b"changes": b"[[1,2]]", b"blocks": b""}, raw_entry(2, [good]),
                      {b"n": b"3", b"changes": orjson.dumps([[SENT, "llm-1", 64, 0, 1]]), b"blocks": b"\x01"}):
            raw.xadd("llm-ring:index:r-forger", entry)  # type: ignore[arg-type]
        await meet(a.store)  # type: ignore[arg-type]  # the next batch of writes reads them
        assert a.metrics.store_invalid["index"] == 2 and a.metrics.store_index_applied == 1
        assert held_by(a, "llm-1", (11, 12, 13)) == 3

    run_closing(run)


@needs_redis
def test_changes_made_while_the_store_was_down_reach_the_others_once_it_is_back(server: Running) -> None:
    port = int(server.address.rsplit(":", 1)[1])
    restarted: list[Running] = []

    async def run() -> None:
        a = await indexed("r-a", server, timeout_ms=200)
        server.process.kill()
        server.process.wait()
        during = await ask(a, [SYSTEM, {"role": "user", "content": "asked while the store was down"}], "down")
        replica, sent = a.requests.pending[during].decision.replica, a.requests.pending[during].request.prefix_blocks
        answered(a, during)
        assert not a.store.in_use  # type: ignore[union-attr]
        restarted.append(start_redis(folder(server), port))  # empty: it kept nothing
        b = await indexed("r-b", server)

        async def learnt() -> bool:
            await meet(b.store)  # type: ignore[arg-type]
            return held_by(b, replica, sent) > 0

        await eventually(learnt)
        assert held_by(b, replica, sent) == len(sent) > 3

    try:
        run_closing(run)
    finally:
        for running in restarted:
            running.stop()


@needs_redis
def test_each_routers_stream_of_changes_stays_bounded(server: Running) -> None:
    async def run() -> None:
        a = await indexed("r-a", server)
        store = a.store
        assert store is not None
        many = [IndexChange(SENT, "llm-0", tuple(range(n, n + 1000)), 64, 0) for n in range(40)]  # 20 entries
        store.view_changes = lambda: list(many)  # as busy a router as can be: every batch full
        for _ in range(3 * INDEX_KEPT // 20):
            store.load_changed()
            await store.flushed()
        raw = admin(server)
        length = raw.xlen("llm-ring:index:r-a")
        assert INDEX_KEPT <= length <= INDEX_KEPT + 100  # MAXLEN ~ trims whole nodes (100 entries each)
        assert raw.memory_usage("llm-ring:index:r-a") <= (INDEX_KEPT + 100) * (INDEX_ENTRY_BYTES + 1024)
        assert 0 < raw.pttl("llm-ring:index:r-a") <= store.settings.first_placement_ttl_seconds * 1000

    run_closing(run)
