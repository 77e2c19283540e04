"""Real gateways (Envoy + `llm-ring serve` each) sharing one real redis-server, in front of
stub upstreams: a conversation's next turn through the other gateway goes where the first
gateway's answer left its cache; a forged session id (each source of service.session_ids)
learns and moves nothing; a flood of new ids keeps the store in use and every placement
written; a store killed and restarted empty gets its placements back; forged or broken entries
in the store are skipped."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from extproc.bench.stubs import start_stub_upstream
from extproc.routing import Router
from extproc.stack.processes import Running, free_port, static_discovery
from extproc.stack.redis_server import ADMIN, password_file, redis_server_binary, start_redis, user_url
from tests.service.gateway_support import Gateway, chat, gateway, post
from tests.service.test_gateway_lifecycle import SETTINGS

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server: `make setup` installs it"),
]
URL = "/v1/chat/completions"
RING = Router(SETTINGS.routing, ["llm-0", "llm-1", "llm-2"])


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Running]:
    running = start_redis(tmp_path / "redis")
    yield running
    running.stop()


def admin(server: Running) -> redis.Redis:
    password = password_file(server.log_path.parent, ADMIN).read_text().strip()
    return redis.Redis.from_url(f"redis://{ADMIN}@{server.address}/0", password=password)


def share(monkeypatch: pytest.MonkeyPatch, server: Running, **store: str) -> None:
    monkeypatch.setenv("LLM_RING__STORE__URL", f'"{user_url(server.address)}"')
    monkeypatch.setenv("LLM_RING__STORE__PASSWORD_FILE", f'"{password_file(server.log_path.parent)}"')
    for key, value in store.items():
        monkeypatch.setenv(f"LLM_RING__STORE__{key.upper()}", value)


def placed_key(conversation: str) -> str:
    return f"llm-ring:place:{RING.conversation_key(conversation):016x}"


def homed_on(replica: str, count: int = 1, ring: Router = RING) -> list[str]:
    names = (f"conv-{i}" for i in range(100_000))
    return [name for name in names if ring.ring.home(ring.conversation_key(name)) == replica][:count]


def wait_for(condition: object, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def in_use(metrics_url: str, client: httpx.Client | None = None) -> bool:
    text = (client or httpx).get(metrics_url, timeout=5).text
    return "\nllm_ring_store_in_use 1.0" in text


def metric(metrics_url: str, name: str) -> float:
    lines = httpx.get(metrics_url, timeout=5).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


@pytest.fixture
def stubs(tmp_path: Path) -> Iterator[dict[str, str]]:
    ports = [free_port(), free_port()]
    running = start_stub_upstream(ports, tmp_path / "stubs")
    # llm-2 refuses connections: its conversations fail over to llm-0 (the next name), a
    # placement no router could guess from the ring
    yield {"llm-0": f"127.0.0.1:{ports[0]}", "llm-1": f"127.0.0.1:{ports[1]}", "llm-2": f"127.0.0.1:{free_port()}"}
    running.stop()


def two_gateways(stack: ExitStack, tmp_path: Path, replicas: dict[str, str]) -> tuple[Gateway, Gateway, list[str]]:
    """Two gateways and their /metrics URLs."""
    gateways, metrics = [], []
    for index in range(2):  # each port taken just before its service binds it
        metrics.append(f"127.0.0.1:{free_port()}")
        gateways.append(stack.enter_context(gateway(tmp_path / f"gw-{index}", static_discovery(replicas),
                                                    metrics_listen=f'"{metrics[-1]}"')))
    return gateways[0], gateways[1], [f"http://{address}/metrics" for address in metrics]


TURN_2 = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
          {"role": "user", "content": "more"}]


def test_the_next_turn_through_the_other_gateway_follows_the_shared_placement(
    redis_server: Running, stubs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conversation = homed_on("llm-2")[0]
    headers = {"x-conversation-id": conversation}
    share(monkeypatch, redis_server, timeout_ms="500")  # a busy machine; the bound is not tested here
    store = admin(redis_server)
    with ExitStack() as stack:
        first, second, _ = two_gateways(stack, tmp_path, stubs)
        reply = post(first.url + URL, chat("hello"), headers)
        assert reply.status_code == 200 and reply.headers["x-routed-to"] == "llm-2"
        assert reply.headers["x-gateway-destination-endpoint-served"] == stubs["llm-0"]
        wait_for(lambda: store.exists(placed_key(conversation)), "the placement never reached the store")
        reply = post(second.url + URL, chat("", messages=TURN_2), headers)  # a gateway that never routed it
        assert reply.status_code == 200 and reply.headers["x-routed-to"] == "llm-0"
        assert reply.headers["x-route-reason"] != "home"
        assert first.wait_idle()["in_flight_requests"] == 0 and second.wait_idle()["in_flight_requests"] == 0


def carrying(source: str, session: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(body, headers) of a request naming ``session`` by ``source`` (an entry of service.session_ids)."""
    kind, _, name = source.partition(":")
    return ({**body, name: session}, {}) if kind == "body" else (body, {name: session})


# each source of router.toml's service.session_ids, alone and through two gateways sharing the store
@pytest.mark.parametrize(("routers", "source"), [
    (1, "header:x-conversation-id"), (2, "header:x-conversation-id"), (1, "header:session_id"),
    (2, "header:x-claude-code-session-id"), (2, "header:x-session-affinity"), (1, "body:prompt_cache_key"),
])
def test_a_forged_session_id_learns_nothing_and_moves_nothing(
    routers: int, source: str, redis_server: Running, stubs: dict[str, str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert source in SETTINGS.service.session_ids
    victim = homed_on("llm-2")[0]  # its cache ends on llm-0 (llm-2 refuses): not its ring home
    with ExitStack() as stack:
        if routers == 2:
            share(monkeypatch, redis_server, timeout_ms="500")
            first, second, _ = two_gateways(stack, tmp_path, stubs)
        else:
            first = second = stack.enter_context(gateway(tmp_path / "gw", static_discovery(stubs)))
        reply = post(first.url + URL, *carrying(source, victim, chat("hello")))
        assert reply.headers["x-gateway-destination-endpoint-served"] == stubs["llm-0"]
        first.wait_idle()
        store = admin(redis_server)
        if routers == 2:
            wait_for(lambda: store.exists(placed_key(victim)), "the placement never reached the store")
        stored = store.get(placed_key(victim))
        for attempt in range(3):  # every turn, as a forger may, with bodies unrelated to the victim's history
            forged = post(second.url + URL, *carrying(source, victim, chat(f"{attempt} " + "x" * 2000)))
            assert forged.status_code == 200
            assert forged.headers.get("x-route-predicted-cached-tokens", "0") == "0"  # nothing of its length
            assert forged.headers["x-route-reason"] not in ("placement", "long_sticky")
            second.wait_idle()
        if routers == 2:
            time.sleep(0.1)  # the writer's batch
            assert store.get(placed_key(victim)) == stored  # not overwritten
        reply = post(first.url + URL, *carrying(source, victim, chat("", messages=TURN_2)))  # the victim's next turn
        assert reply.headers["x-routed-to"] == "llm-0"  # where its cache is (llm-2 refuses: not the ring's pick)
        assert int(reply.headers["x-route-predicted-cached-tokens"]) > 0


def test_a_flood_of_new_ids_keeps_the_store_in_use_and_every_placement_written(
    redis_server: Running, stubs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    share(monkeypatch, redis_server)  # router.toml's timeout_ms (50)
    stubs = {name: address for name, address in stubs.items() if name != "llm-2"}
    store = admin(redis_server)
    flood = 2000
    with ExitStack() as stack:
        first, second, metrics = two_gateways(stack, tmp_path, stubs)
        samples: list[bool] = []
        done = threading.Event()

        def sample() -> None:
            with httpx.Client() as client:
                while not done.is_set():
                    samples.extend(in_use(url, client) for url in metrics)

        sampler = threading.Thread(target=sample)
        sampler.start()
        clients = [httpx.Client(timeout=30), httpx.Client(timeout=30)]

        def one(index: int) -> int:
            target = (first, second)[index % 2]
            reply = clients[index % 2].post(target.url + URL, json=chat(f"one-shot {index}"),
                                            headers={"x-conversation-id": f"flood-{index}"})
            return reply.status_code

        try:
            with ThreadPoolExecutor(16) as pool:
                statuses = list(pool.map(one, range(flood)))
        finally:
            done.set()
            sampler.join()
            for client in clients:
                client.close()
        assert statuses.count(200) == flood
        first.wait_idle()
        second.wait_idle()
        share_in_use = sum(samples) / len(samples)
        assert len(samples) > 40 and share_in_use >= 0.99, f"store in use {share_in_use:.1%} of {len(samples)} samples"
        # and per decision: at most 1 % of them went without the shared view (a read that failed or was slow)
        assert sum(metric(url, 'llm_ring_store_errors_total{call="read"}') for url in metrics) <= flood / 100
        wait_for(lambda: sum(1 for _ in store.scan_iter("llm-ring:place:*", count=1000)) == flood,
                 "not every placement reached the store")
        assert sum(metric(url, "llm_ring_store_writes_dropped_total") for url in metrics) == 0


def test_a_store_killed_and_restarted_empty_gets_the_placements_back(
    redis_server: Running, stubs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conversation = homed_on("llm-2")[0]
    headers = {"x-conversation-id": conversation}
    share(monkeypatch, redis_server, timeout_ms="500")
    folder, port = redis_server.log_path.parent, int(redis_server.address.rsplit(":", 1)[1])
    with ExitStack() as stack:
        first, second, metrics = two_gateways(stack, tmp_path, stubs)
        reply = post(first.url + URL, chat("hello"), headers)
        assert reply.headers["x-gateway-destination-endpoint-served"] == stubs["llm-0"]
        wait_for(lambda: admin(redis_server).exists(placed_key(conversation)), "the placement never reached the store")
        republished = sum(metric(url, "llm_ring_store_republished_total") for url in metrics)
        redis_server.process.kill()  # SIGKILL: nothing kept (no snapshots)
        redis_server.process.wait()
        restarted = start_redis(folder, port)
        stack.callback(restarted.stop)
        # it starts empty (SIGKILL, no snapshots), and the routers may refill it before a check
        # here could see that: what is checked is that they published their state again
        wait_for(lambda: all(in_use(url) for url in metrics), "the routers did not come back", timeout=5.0)
        wait_for(lambda: sum(metric(url, "llm_ring_store_republished_total") for url in metrics) > republished,
                 "no router republished its state", timeout=5.0)
        wait_for(lambda: admin(restarted).exists(placed_key(conversation)), "the placement was not republished",
                 timeout=5.0)
        reply = post(second.url + URL, chat("", messages=TURN_2), headers)  # the follow-up after recovery
        assert reply.headers["x-routed-to"] == "llm-0" and int(reply.headers["x-route-predicted-cached-tokens"]) > 0


def test_forged_and_broken_entries_in_the_store_are_skipped(
    redis_server: Running, stubs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    share(monkeypatch, redis_server, timeout_ms="500")
    stubs = {name: address for name, address in stubs.items() if name != "llm-2"}
    store = admin(redis_server)
    store.hset("llm-ring:load:evil", "load", '{"llm-0":[1000,10000000]}')  # more than any router holds
    store.hset("llm-ring:load:broken", "load", "not-json")
    store.sadd("llm-ring:routers", "evil", "broken")
    conversations = homed_on("llm-0", 12, Router(SETTINGS.routing, stubs))
    with ExitStack() as stack:
        first, _, metrics = two_gateways(stack, tmp_path, stubs)
        routed = [post(first.url + URL, chat(f"new {c}"), {"x-conversation-id": c}).headers["x-routed-to"]
                  for c in conversations]
        assert routed.count("llm-0") == len(conversations)  # the forged load sent none away
        assert in_use(metrics[0])
        assert metric(metrics[0], 'llm_ring_store_invalid_entries_total{entry="load"}') >= 2


def test_the_store_refuses_a_connection_without_credentials(redis_server: Running) -> None:
    host, port = redis_server.address.rsplit(":", 1)
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host=host, port=int(port)).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(user_url(redis_server.address), password="guessed").ping()
    router_user = redis.Redis.from_url(user_url(redis_server.address),
                                       password=password_file(redis_server.log_path.parent).read_text().strip())
    router_user.set("llm-ring:place:0", "x", px=1000)  # what the routers do
    for forbidden in (lambda: router_user.flushall(), lambda: router_user.config_set("maxmemory", "1"),
                      lambda: router_user.set("other:key", "x"), lambda: router_user.keys("*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()
