"""Several gateways agreeing through a real redis-server (started here on a free port): turns
that alternate between routers stay on their replica, a back-to-back turn through another
router is not charged the answered request, a new router starts warm; the store down, slow,
or a router killed: routing goes on, the bound holds, no load leaks."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from extproc.routing.peers import PeerRequest
from extproc.routing.placement import Placement
from extproc.service.bodies import Timings
from extproc.service.dataplanes.own_envoy import OWN_ENVOY
from extproc.service.gateway import Gateway
from extproc.service.metrics import Metrics
from extproc.service.store import READ_EVERY_S, SharedStore
from extproc.stack.processes import Running
from extproc.stack.redis_server import (
    ADMIN,
    ROUTER_COMMANDS,
    password_file,
    redis_server_binary,
    start_redis,
    user_url,
)
from tests.service.test_gateway_lifecycle import ENDPOINTS, SETTINGS, make_gateway, samples

pytestmark = pytest.mark.skipif(
    redis_server_binary() is None,
    reason="no redis-server on this machine: `make setup` installs Debian's package (as root, apt reachable)",
)
CHAT = "/v1/chat/completions"
USER1 = {"role": "user", "content": "first question"}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Running]:
    running = start_redis(tmp_path / "redis")
    yield running
    running.stop()


def url(server: Running) -> str:
    return user_url(server.address)


def folder(server: Running) -> Path:
    return server.log_path.parent


def admin(server: Running) -> redis.Redis:
    """A client that may read and write anything (the routers' user may not)."""
    password = password_file(folder(server), ADMIN).read_text().strip()
    return redis.Redis.from_url(f"redis://{ADMIN}@{server.address}/0", password=password)


async def sharing(server: Running, router_id: str, address: str = "", **store: Any) -> Gateway:
    """A gateway on router.toml's settings sharing state through ``server`` (or ``address``, a
    proxy in front of it): see sharing_at."""
    return await sharing_at(address or url(server), password_file(folder(server)), router_id, **store)


async def sharing_at(address: str, password: Path, router_id: str, **store: Any) -> Gateway:
    """A gateway on router.toml's settings sharing state through ``address`` (generous timeout:
    these machines are busy; the fault tests set their own)."""
    gateway = make_gateway()
    gateway.metrics.watch(gateway.replica_states)
    settings = SETTINGS.store.model_copy(update={"url": address, "password_file": str(password), "timeout_ms": 500,
                                                 "retry_seconds": 0.2, "load_ttl_seconds": 0.6, **store})
    await gateway.publishing.share_state(settings, router_id)
    OPEN.append(gateway)
    # registered among the store's routers before the next one connects: a router connecting
    # the same instant would count this one only from its next batch of writes (store.py)
    await gateway.store.flushed()  # type: ignore[union-attr]
    return gateway


OPEN: list[Gateway] = []


def run_closing(main: Callable[[], Awaitable[None]]) -> None:
    """asyncio.run(main()), every store of ``sharing`` closed at the end, even when main fails."""

    async def closing() -> None:
        try:
            await main()
        finally:
            while OPEN:
                await OPEN.pop().store.close()  # type: ignore[union-attr]

    asyncio.run(closing())


async def ask(gateway: Gateway, messages: list[dict[str, str]], conversation: str = "c-1") -> str:
    """One chat request decided through the store; the service's own id for it."""
    _, routed = await gateway.route_shared(
        shape=OWN_ENVOY,
        path=CHAT, content_type="application/json", session_headers={"x-conversation-id": conversation}, turn="",
        request_id="envoy-id", body=orjson.dumps({"messages": messages, "max_tokens": 8}),
    )
    assert routed
    return next(reversed(gateway.requests.pending))


def answered(gateway: Gateway, request_id: str, served: str = "") -> None:
    """Envoy's access log entry: a whole 200 answer (from ``served``, a replica name, if not the pick:
    the pick refused and is avoided until its probe answers, here at once)."""
    pick = gateway.requests.pending[request_id].decision.replica
    gateway.requests.access_logged(request_id, 200, ENDPOINTS[served or pick], cut_off=False, timings=None)
    gateway.mark_healthy(pick)


def published_load(raw: redis.Redis, router: str) -> Any:
    """The latest load ``router`` published (the highest seq of its load key); None: none."""
    latest = raw.zrange(f"llm-ring:load:{router}", -1, -1)
    return orjson.loads(latest[0]) if latest else None


def follow_up(messages: list[dict[str, str]], answer: str, question: str) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": question}]


async def meet(store: SharedStore) -> None:
    """``store``'s next batch of writes reads which routers there are (a decision reads the loads
    of the routers its last such batch found)."""
    await asyncio.sleep(READ_EVERY_S)
    store.load_changed()
    await store.flushed()


async def eventually(condition: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_turns_that_alternate_between_routers_stay_on_their_replica(server: Running) -> None:
    async def run() -> None:
        routers = [await sharing(server, "r-a"), await sharing(server, "r-b")]
        for index in range(4):
            conversation = f"conv-{index}"
            messages = [{"role": "user", "content": f"question {index}"}]
            first = await ask(routers[0], messages, conversation)
            home = routers[0].requests.pending[first].decision.replica
            elsewhere = next(name for name in sorted(ENDPOINTS) if name != home)
            answered(routers[0], first, served=elsewhere)  # the pick refused: a fallback holds the cache now
            await routers[0].store.flushed()  # type: ignore[union-attr]
            for turn in range(1, 4):
                messages = follow_up(messages, f"answer {turn}", f"more {turn}")
                gateway = routers[turn % 2]
                request_id = await ask(gateway, messages, conversation)
                assert gateway.requests.pending[request_id].decision.replica == elsewhere, (conversation, turn)
                answered(gateway, request_id)
                await gateway.store.flushed()  # type: ignore[union-attr]
            alone = make_gateway()  # the control: a router that shares nothing goes to the ring home
            _, routed = alone.route_request(shape=OWN_ENVOY, path=CHAT, content_type="application/json",
                                            session_headers={"x-conversation-id": conversation}, turn="",
                                            request_id="x", body=orjson.dumps({"messages": messages}))
            assert routed and next(reversed(alone.requests.pending.values())).decision.replica == home
        assert all(gateway.router.ledger.total_requests() == 0 for gateway in routers)

    run_closing(run)


def test_a_decision_reads_in_one_pipeline_and_a_busy_router_asks_who_else_there_is_once_in_a_while(
        server: Running) -> None:
    """No transaction around the read, nothing the decision does not use: the placement, the pending
    requests, each other router's load and its changes to the prefix index; the routers' ids are
    read by batches of writes, at most every READ_EVERY_S."""
    raw = admin(server)

    async def run() -> None:
        a, _ = await sharing(server, "r-a"), await sharing(server, "r-b")
        await meet(a.store)  # type: ignore[arg-type]  # a knows b
        raw.config_resetstat()
        started = time.monotonic()
        for number in range(60):
            answered(a, await ask(a, [{"role": "user", "content": f"chat {number}"}], f"c{number}"))
        await a.store.flushed()  # type: ignore[union-attr]
        elapsed = time.monotonic() - started
        calls = {name.removeprefix("cmdstat_"): stats["calls"] for name, stats in raw.info("commandstats").items()}
        assert "multi" not in calls and "exec" not in calls
        assert calls["get"] == calls["hgetall"] == 60 and calls["zrange"] >= 60  # b's load, each decision
        assert calls["xread"] >= 60  # b's changes to the index, each decision (and the batches' reads)
        # the routers' ids: a's batches at most every READ_EVERY_S, b's heartbeats (a third of 0.6 s)
        assert calls.get("srandmember", 0) <= 2 * (elapsed / READ_EVERY_S + 1) + elapsed / 0.2 + 2


def test_a_chat_another_router_served_is_no_branch_of_an_equal_history_served_here(server: Running) -> None:
    """Router b served conversation "old" (a branch point: its history on replica X). The same
    messages as conversation "new", served through router a on Y, then a turn through b: b knows
    "new" only from the store, where it continues, so it follows its placement to Y and does not
    branch to X, where an equal history of another conversation was served."""
    async def run() -> None:
        a, b = await sharing(server, "r-a"), await sharing(server, "r-b")
        first = [USER1]
        second = follow_up(first, "answer 1", "more 1")
        old = await ask(b, first, "old")
        x = b.requests.pending[old].decision.replica
        answered(b, old)
        answered(b, await ask(b, second, "old"))
        assert b.requests.pending == {} and x
        new = await ask(a, first, "new")
        y = next(name for name in sorted(ENDPOINTS) if name not in (x, a.requests.pending[new].decision.replica))
        answered(a, new, served=y)
        answered(a, await ask(a, second, "new"))
        await a.store.flushed()  # type: ignore[union-attr]
        third = await ask(b, follow_up(second, "answer 2", "more 2"), "new")
        assert b.requests.pending[third].decision.replica == y, (x, y)
        assert b.metrics.branches == 0

    run_closing(run)


def test_a_back_to_back_turn_another_router_still_serves_is_no_branch_either(server: Running) -> None:
    """As above, but the next turn comes through b the instant a's answer is in: the store holds
    a's request as pending, no placement yet. b's body answers it, so b follows it to its
    replica and does not branch to X."""
    async def run() -> None:
        a, b = await sharing(server, "r-a"), await sharing(server, "r-b")
        first = [USER1]
        old = await ask(b, first, "old")
        x = b.requests.pending[old].decision.replica
        answered(b, old)
        for attempt in range(20):  # a conversation a places away from X
            new = await ask(a, first, f"new-{attempt}")
            if (y := a.requests.pending[new].decision.replica) != x:
                break
            answered(a, new)
        await a.store.flushed()  # type: ignore[union-attr]
        turn = await ask(b, follow_up(first, "answer 1", "more 1"), f"new-{attempt}")
        assert b.requests.pending[turn].decision.replica == y, (x, y)
        assert b.metrics.branches == 0

    run_closing(run)


def test_a_back_to_back_turn_through_another_router_is_not_charged_the_answered_request(server: Running) -> None:
    async def run() -> None:
        a, b = await sharing(server, "r-a"), await sharing(server, "r-b")
        t1 = await ask(a, [USER1])
        still_running = await ask(a, [{"role": "user", "content": "another chat"}], conversation="c-2")
        await a.store.flushed()  # type: ignore[union-attr]
        first, other = a.requests.pending[t1].decision, a.requests.pending[still_running].decision
        # the answer reached the client; Envoy's access log entry has not reached router a yet
        t2 = await ask(b, follow_up([USER1], "an answer", "and then?"))
        second = b.requests.pending[t2].decision
        assert second.replica == first.replica
        assert second.predicted_cached_tokens == a.requests.pending[t1].request.prompt_tokens
        assert b.router.ledger.elsewhere() == {other.replica: (1, other.charged_tokens)}  # t1 left out, c-2 not
        answered(a, t1)  # late: router a releases its own request itself
        answered(a, still_running)
        answered(b, t2)
        await a.store.flushed()  # type: ignore[union-attr]
        await ask(b, [{"role": "user", "content": "a third chat"}], conversation="c-3")
        assert b.router.ledger.elsewhere() == {}  # nothing of router a's is left counted anywhere

    run_closing(run)


def test_a_new_router_starts_warm(server: Running) -> None:
    async def run() -> None:
        a = await sharing(server, "r-a")
        t1 = await ask(a, [USER1])
        home = a.requests.pending[t1].decision.replica
        moved_to = next(name for name in sorted(ENDPOINTS) if name != home)
        answered(a, t1, served=moved_to)
        await a.store.flushed()  # type: ignore[union-attr]
        late = await sharing(server, "r-new")  # started after: an empty memory of its own
        t2 = await ask(late, follow_up([USER1], "an answer", "more"))
        assert late.requests.pending[t2].decision.replica == moved_to != home

    run_closing(run)


def test_a_stranger_through_a_router_that_knows_its_prefix_from_elsewhere_moves_nothing_there(server: Running) -> None:
    """Router b served an id-less chat with the victim's opening, on another replica (a branch point
    of that opening). A stranger with the victim's id and opening through b: the store says it
    does not continue the victim's chat, so its branch lands under a key of its own; b holds no
    placement under the victim's key, and the victim's next turn through b goes to its replica."""
    async def run() -> None:
        a, b = await sharing(server, "r-a"), await sharing(server, "r-b")
        opening = [{"role": "system", "content": "a shared system prompt"}, USER1]
        messages = list(opening)
        for turn in range(4):
            request_id = await ask(a, messages, "victim")
            victim = a.requests.pending[request_id].decision.replica
            answered(a, request_id)
            messages = follow_up(messages, f"answer {turn}", f"question {turn}")
        await a.store.flushed()  # type: ignore[union-attr]
        elsewhere = next(name for name in sorted(ENDPOINTS) if name != victim)
        answered(b, await ask(b, opening, ""), served=elsewhere)
        stranger = await ask(b, follow_up(opening, "a guessed answer", "?"), "victim")
        routed = b.requests.pending[stranger]
        assert routed.request.conversation != "victim" and not routed.continued
        assert routed.decision.replica == elsewhere  # where b saw the opening served: what the body proves
        answered(b, stranger)
        assert b.router.memory.get(b.router.conversation_key("victim")) is None
        next_turn = await ask(b, messages, "victim")
        assert b.requests.pending[next_turn].decision.replica == victim

    run_closing(run)


SLOW = Timings(cache_n=0, prompt_n=2000, prompt_ms=8000.0, predicted_n=8, predicted_ms=800.0)


def test_every_router_learns_the_replica_speeds_from_every_answer(server: Running) -> None:
    async def run() -> None:
        a, b = await sharing(server, "r-a"), await sharing(server, "r-b")
        prior = a.router.speeds.prior
        trusted = a.router.speeds.trust_answers  # a replica's own speed counts from this many answers
        served = set()
        for _ in range(trusted):
            request_id = await ask(a, [USER1])
            slow = a.requests.pending[request_id].decision.replica
            served.add(slow)
            a.requests.access_logged(request_id, 200, ENDPOINTS[slow], cut_off=False, timings=SLOW)
        learnt = a.router.speeds.speed(slow)
        assert served == {slow} and learnt != prior and a.router.speeds.answers[slow] == trusted
        await a.store.flushed()  # type: ignore[union-attr]

        async def learnt_by(gateway: Gateway) -> bool:
            return gateway.router.speeds.answers[slow] == trusted

        await eventually(lambda: learnt_by(b))  # within b's next batch of writes (its heartbeat here)
        assert b.router.speeds.speed(slow) == learnt and b.router.speeds.fastest == slow
        assert samples(b)["llm_ring_store_answers_learnt_total", ()] == trusted
        late = await sharing(server, "r-new")  # started after: learns the answers the store keeps
        await eventually(lambda: learnt_by(late))
        assert late.router.speeds.speed(slow) == learnt
        assert a.metrics.store_answers_learnt == 0  # its own answer, read back, is not learnt twice
        alone = make_gateway()  # the control: a router that shares nothing learnt nothing
        assert alone.router.speeds.answers[slow] == 0 and alone.router.speeds.speed(slow) == prior

    run_closing(run)


@pytest.mark.parametrize("answered_after_the_move", [False, True])
def test_a_migration_told_to_one_router_sends_the_next_turn_through_another_to_the_receiver(
        server: Running, answered_after_the_move: bool) -> None:
    """Told of the move before or after the moved turn's answer ended (a roll moves an idle slot
    while Envoy may not have closed its request yet): its end does not place it back."""
    from extproc.service import admin_pb2
    from extproc.service.admin import AdminService

    async def run() -> None:
        a, b = await sharing(server, "r-a"), await sharing(server, "r-b")
        t1 = await ask(a, [USER1])
        home = a.requests.pending[t1].decision.replica
        tokens = a.requests.pending[t1].request.prompt_tokens
        if not answered_after_the_move:
            answered(a, t1)
        await a.store.flushed()  # type: ignore[union-attr]
        receiver = next(name for name in sorted(ENDPOINTS) if name != home)
        move = admin_pb2.Move(key=a.router.conversation_key("c-1"), replica=receiver, tokens=tokens + 8)
        reply = await AdminService(a).Migrated(admin_pb2.MigratedRequest(moves=[move], attempted=1), None)  # type: ignore[arg-type]
        assert reply.applied == 1
        if answered_after_the_move:
            answered(a, t1)
        await a.store.flushed()  # type: ignore[union-attr]
        t2 = await ask(b, follow_up([USER1], "an answer", "more"))  # b was not told: it reads the store
        assert b.requests.pending[t2].decision.replica == receiver != home
        assert "migrated" not in b.requests.pending[t2].decision.reason  # b reads a placement, not a move
        t2_on_a = await ask(a, follow_up([USER1], "an answer", "more"))
        assert a.requests.pending[t2_on_a].decision.replica == receiver

    run_closing(run)


def test_the_store_down_leaves_routing_on_local_state_and_it_recovers_without_leaks(
    server: Running, tmp_path: Path
) -> None:
    port = int(server.address.rsplit(":", 1)[1])
    raw = admin(server)

    restarted: list[Running] = []

    async def run() -> None:
        a = await sharing(server, "r-a", timeout_ms=200)
        store = a.store
        assert store is not None and store.in_use
        server.process.kill()  # the store dies
        server.process.wait()
        during = [await ask(a, [{"role": "user", "content": f"chat {i}"}], conversation=f"c{i}") for i in range(3)]
        assert not store.in_use and sum(a.metrics.store_errors.values()) >= 1
        found = samples(a)
        assert found["llm_ring_store_in_use", ()] == 0 and sum(
            value for (name, _), value in found.items() if name == "llm_ring_store_errors_total") >= 1
        reads_failed = a.metrics.store_errors["read"]
        await ask(a, [{"role": "user", "content": "no store call now"}], conversation="c-x")
        assert a.metrics.store_errors["read"] == reads_failed  # local state: no decision asks the store now
        answered(a, await ask(a, [{"role": "user", "content": "served during the outage"}], conversation="c-out"))
        restarted.append(start_redis(folder(server), port))

        async def back() -> bool:
            return store.in_use

        await eventually(back)
        await store.flushed()
        own = published_load(raw, "r-a") or {}
        assert sum(requests for requests, _ in own.values()) == a.router.ledger.total_requests() == 4
        pending = raw.hgetall("llm-ring:pending:" + f"{a.router.conversation_key('c0'):016x}")
        assert list(pending) == [during[0].encode()]  # republished: it is still waiting for its answer
        assert raw.exists(f"llm-ring:place:{a.router.conversation_key('c-out'):016x}")  # kept until written
        for request_id in list(a.requests.pending):
            answered(a, request_id)
        await store.flushed()
        assert published_load(raw, "r-a") == {}
        assert not raw.keys("llm-ring:pending:*")

    try:
        run_closing(run)
    finally:
        for running in restarted:
            running.stop()


class DelayProxy:
    """TCP in front of redis, each chunk towards it held ``delay`` seconds (changeable)."""

    def __init__(self, target: str) -> None:
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.delay = 0.0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return user_url(f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}")

    async def _connection(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(self.host, self.port)

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delayed: bool) -> None:
            try:
                while chunk := await reader.read(65536):
                    if delayed and self.delay:
                        await asyncio.sleep(self.delay)
                    writer.write(chunk)
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        await asyncio.gather(pipe(client_reader, upstream_writer, True), pipe(upstream_reader, client_writer, False))


def test_a_slow_store_costs_a_decision_at_most_the_timeout(server: Running) -> None:
    async def run() -> None:
        proxy = DelayProxy(server.address)
        address = await proxy.start()
        a = await sharing(server, "r-a", address, timeout_ms=300, retry_seconds=0.3)
        store = a.store
        assert store is not None and store.in_use
        proxy.delay = 0.05  # within the timeout: waited for, the store stays in use
        started = time.monotonic()
        await ask(a, [USER1])
        assert time.monotonic() - started >= 0.05 and store.in_use
        proxy.delay = 5.0  # far over it: the decision gives up after timeout_ms and goes on locally
        started = time.monotonic()
        request_id = await ask(a, [{"role": "user", "content": "b"}], conversation="c-2")
        assert time.monotonic() - started < 2.5  # the bound is 0.3 s; the slack is for a busy machine
        assert a.metrics.store_errors["read"] >= 1 and request_id in a.requests.pending
        assert store.in_use  # one slow call costs that decision, not the next ones
        proxy.delay = 0.0
        reads_failed = a.metrics.store_errors["read"]
        await ask(a, [{"role": "user", "content": "c"}], conversation="c-3")
        assert a.metrics.store_errors["read"] == reads_failed
        answered(a, request_id)
        await store.flushed()  # the writes queued meanwhile reach the store
        pending_key = f"llm-ring:pending:{a.router.conversation_key('c-2'):016x}"
        assert not admin(server).hgetall(pending_key)

    run_closing(run)


def test_a_publish_delayed_on_the_network_never_overwrites_a_newer_one(server: Running) -> None:
    """A batch of writes held on its way past the timeout is sent again with the newer figures;
    the held one lands after them, with its older seq: the store keeps the newer figures."""
    raw = admin(server)

    def publishes() -> int:
        return int(raw.info("commandstats").get("cmdstat_zadd", {}).get("calls", 0))

    async def run() -> None:
        proxy = DelayProxy(server.address)
        address = await proxy.start()
        b = await sharing(server, "r-b")
        assert b.store is not None
        figures = {"llm-0": (1, 100)}
        settings = b.store.settings.model_copy(update={"url": address, "timeout_ms": 100, "load_ttl_seconds": 30})
        late = SharedStore(settings, "r-late", lambda: dict(figures), Metrics(), b.store.bounds)
        await late.start()
        await late.flushed()
        assert published_load(raw, "r-late") == {"llm-0": [1, 100]}
        proxy.delay = 1.5  # what is sent now is held this long on its way
        figures["llm-0"] = (2, 200)
        late.load_changed()

        async def timed_out() -> bool:
            return late.metrics.store_errors["write"] >= 1

        await eventually(timed_out)
        proxy.delay = 0.0  # the batch is sent again on a new connection, at once
        figures["llm-0"] = (3, 300)
        await late.flushed()
        assert published_load(raw, "r-late") == {"llm-0": [3, 300]}
        before_the_held_one = publishes()
        await asyncio.sleep(2.0)  # the held write lands
        assert publishes() > before_the_held_one
        assert published_load(raw, "r-late") == {"llm-0": [3, 300]}  # not overwritten by the older figures
        snapshot = await b.store.read(b.router.conversation_key("c-1"))
        assert snapshot is not None and snapshot.loads == {"r-late": {"llm-0": (3, 300)}}
        await late.close()

    run_closing(run)


DOOMED_ROUTER = """
import asyncio, sys
from pathlib import Path
from tests.service.test_store import ask, sharing_at

async def main():
    gateway = await sharing_at(sys.argv[1], Path(sys.argv[2]), "r-doomed")
    await ask(gateway, [{"role": "user", "content": "in flight when killed"}], conversation="c-9")
    await gateway.store.flushed()
    print("published", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_router_killed_with_sigkill_stops_counting_within_its_ttl(server: Running) -> None:
    command = [sys.executable, "-c", DOOMED_ROUTER, url(server), str(password_file(folder(server)))]
    doomed = subprocess.Popen(command, stdout=subprocess.PIPE, cwd=Path(__file__).parents[2])
    try:
        assert doomed.stdout is not None
        assert b"published\n" in iter(doomed.stdout.readline, b"")  # after its log lines

        async def run() -> None:
            b = await sharing(server, "r-b")
            await ask(b, [USER1])
            assert sum(requests for requests, _ in b.router.ledger.elsewhere().values()) == 1
            doomed.kill()  # no heartbeat, no goodbye

            async def forgotten() -> bool:
                snapshot = await b.store.read(b.router.conversation_key("c-1"))  # type: ignore[union-attr]
                return snapshot is not None and "r-doomed" not in snapshot.loads

            await eventually(forgotten)
            assert admin(server).smembers("llm-ring:routers") == {b"r-b"}

        run_closing(run)
    finally:
        doomed.kill()
        doomed.wait()


def test_pending_requests_of_a_router_that_is_gone_are_ignored(server: Running) -> None:
    async def run() -> None:
        b = await sharing(server, "r-b")
        assert b.store is not None
        ghost = SharedStore(b.store.settings, "r-ghost", lambda: {"llm-0": (5, 500)}, Metrics(), b.store.bounds)
        await ghost.start()

        async def connected() -> bool:  # a first connect slower than store.timeout_ms (a loaded
            return ghost.in_use  # machine) is retried: until then nothing would be written

        await eventually(connected)
        ghost.routed(b.router.conversation_key("c-1"), "g-1", PeerRequest("r-ghost", "llm-0", 500, 100, 1))
        await ghost.flushed()
        await ghost.close()  # left: its load key is gone at once, its pending entry stays until its TTL
        snapshot = await b.store.read(b.router.conversation_key("c-1"))
        assert snapshot is not None and snapshot.loads == {} and len(snapshot.pending) == 1
        await ask(b, [USER1])
        assert b.router.ledger.elsewhere() == {}

    run_closing(run)


def test_a_flood_of_one_shot_ids_does_not_evict_returning_conversations(tmp_path: Path) -> None:
    """At maxmemory, eviction (volatile-ttl) takes one-shot placements (short TTL) first: the
    returning conversations stay, and no write of the routers is refused."""
    small = start_redis(tmp_path / "small", max_memory="3mb")
    try:
        async def run() -> None:
            a = await sharing(small, "r-a")
            store = a.store
            assert store is not None
            returning = [f"user-{i}" for i in range(8)]
            for conversation in returning:  # two turns each: the second continues the first
                messages = [{"role": "user", "content": f"{conversation} asks"}]
                answered(a, await ask(a, messages, conversation))
                answered(a, await ask(a, follow_up(messages, "an answer", "and more"), conversation))
            await store.flushed()
            for index in range(40_000):  # far more one-shots than 3 MB holds
                key = a.router.conversation_key(f"one-shot-{index}")
                store.completed(key, f"o-{index}", Placement("llm-0", 1000), index + 1, returning=False)
                if index % 2000 == 0:
                    await store.flushed()
            await store.flushed()
            raw = admin(small)
            assert raw.info("stats")["evicted_keys"] > 0  # the limit was reached
            kept = [raw.exists(f"llm-ring:place:{a.router.conversation_key(c):016x}") for c in returning]
            assert all(kept), kept
            assert a.metrics.store_errors["write"] == 0 and store.in_use

        run_closing(run)
    finally:
        small.stop()


def test_entries_that_do_not_parse_or_are_out_of_bounds_are_skipped_and_counted(server: Running) -> None:
    async def run() -> None:
        a = await sharing(server, "r-a")
        store = a.store
        assert store is not None
        suffix = f"{a.router.conversation_key('c-1'):016x}"
        raw = admin(server)
        raw.set(f"llm-ring:place:{suffix}", "not-json", px=60_000)
        raw.hset(f"llm-ring:pending:{suffix}", mapping={"x": "[1, 2]", "y": orjson.dumps(["r-b", "llm-0", -5, 1, 1]),
                                                        "ok": orjson.dumps(["r-b", "llm-0", 10, 5, 7])})
        for router, load in {"huge": {"llm-0": [10**6, 1]}, "list": [1, 2], "ok": {"llm-1": [2, 20]}}.items():
            raw.zadd(f"llm-ring:load:{router}", {orjson.dumps(load): 1})
            raw.sadd("llm-ring:routers", router)
        await meet(store)
        snapshot = await store.read(a.router.conversation_key("c-1"))
        assert snapshot is not None and store.in_use
        assert snapshot.placement is None and snapshot.pending == (PeerRequest("r-b", "llm-0", 10, 5, 7),)
        assert snapshot.loads == {"ok": {"llm-1": (2, 20)}}
        for fields in ({"router": "r-b", "answers": "not-json"}, {"answers": "[]"},  # no router
                       {"router": "r-b", "answers": orjson.dumps([["llm-0", -1, 1.0, 1, 1.0, 0]])},
                       {"router": "r-b", "answers": orjson.dumps([["llm-0", 100, 1e12, 1, 1.0, 0]])},
                       {"router": "r-b", "answers": orjson.dumps([["llm-0", 100, 50.0, 4, 40.0, 0]])}):
            raw.xadd("llm-ring:answers", fields)  # type: ignore[arg-type]
        await meet(store)  # the next batch of writes reads them
        assert a.metrics.store_invalid == {"placement": 1, "pending": 2, "load": 2, "answers": 4, "index": 0}
        assert samples(a)["llm_ring_store_invalid_entries_total", (("entry", "load"),)] == 2
        assert a.router.speeds.answers["llm-0"] == a.metrics.store_answers_learnt == 1  # the valid one

    run_closing(run)


def test_the_routers_user_runs_no_script_nor_function(server: Running) -> None:
    """A script's memory escapes maxmemory and a long one blocks every other client (BUSY): the
    routers' user may load, run or call none, not even one the admin loaded, nor queue one in a
    transaction; its grant holds no command of Redis' own scripting category."""
    raw = admin(server)
    sha = raw.script_load("return 1")
    raw.function_load("#!lua name=lib\nredis.register_function('one', function() return 1 end)")
    assert raw.evalsha(sha, 0) == 1 and raw.fcall("one", 0) == 1  # the control: they exist and run
    routers = redis.Redis.from_url(url(server), password=password_file(folder(server)).read_text().strip())
    library = "#!lua name=other\nredis.register_function('two', function() return 2 end)"
    for command in (("SCRIPT", "LOAD", "return 1"), ("EVAL", "return 1", 0), ("EVAL_RO", "return 1", 0),
                    ("EVALSHA", sha, 0), ("EVALSHA_RO", sha, 0), ("FCALL", "one", 0), ("FCALL_RO", "one", 0),
                    ("FUNCTION", "LOAD", library), ("FUNCTION", "DELETE", "lib"), ("FUNCTION", "FLUSH"),
                    ("SCRIPT", "FLUSH"), ("SCRIPT", "KILL"), ("FUNCTION", "KILL")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            routers.execute_command(*command)
    transaction = routers.pipeline(transaction=True)
    transaction.get("llm-ring:place:0").execute_command("EVAL", "return 1", 0)
    with pytest.raises(redis.exceptions.NoPermissionError):
        transaction.execute()
    scripting = set(raw.acl_cat("scripting"))
    assert {"eval", "evalsha", "fcall", "script|load", "function|load"} <= scripting
    assert not scripting & {*ROUTER_COMMANDS, *(command.split("|")[0] for command in ROUTER_COMMANDS)}
    assert raw.function_list(library="other") == [] and raw.evalsha(sha, 0) == 1  # nothing loaded, nothing flushed
