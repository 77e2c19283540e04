"""Two real gateways (Envoy + `llm-ring serve` each) sharing one real redis-server, in front of
stub upstreams: a conversation's next turn through the other gateway goes where the first
gateway's answer left its cache, not to its ring home."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from extproc.bench.stubs import start_stub_upstream
from extproc.routing import Router
from extproc.stack.processes import Running, free_port, static_discovery
from extproc.stack.redis_server import redis_server_binary, start_redis
from tests.service.gateway_support import chat, gateway, post
from tests.service.test_gateway_lifecycle import SETTINGS

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server: `make setup` installs it"),
]
URL = "/v1/chat/completions"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Running]:
    running = start_redis(tmp_path / "redis")
    yield running
    running.stop()


def test_the_next_turn_through_the_other_gateway_follows_the_shared_placement(
    redis_server: Running, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = [free_port(), free_port()]
    stubs = start_stub_upstream(ports, tmp_path / "stubs")
    # llm-2 refuses connections: its conversations fail over to llm-0 (the next name), whose
    # cache the next turn must find, whichever gateway it reaches
    replicas = {"llm-0": f"127.0.0.1:{ports[0]}", "llm-1": f"127.0.0.1:{ports[1]}", "llm-2": f"127.0.0.1:{free_port()}"}
    ring = Router(SETTINGS.routing, replicas)
    homes = {f"conv-{i}": ring.ring.home(ring.conversation_key(f"conv-{i}")) for i in range(200)}
    conversation = next(name for name, home in homes.items() if home == "llm-2")
    headers = {"x-conversation-id": conversation}
    placed = f"llm-ring:place:{ring.conversation_key(conversation):016x}"
    monkeypatch.setenv("LLM_RING__STORE__URL", f'"redis://{redis_server.address}/0"')
    monkeypatch.setenv("LLM_RING__STORE__TIMEOUT_MS", "500")  # a busy machine; the bound is not tested here
    store = redis.Redis.from_url(f"redis://{redis_server.address}/0")
    try:
        with gateway(tmp_path / "gw-a", static_discovery(replicas)) as first, \
                gateway(tmp_path / "gw-b", static_discovery(replicas)) as second:  # fmt: skip
            reply = post(first.url + URL, chat("hello"), headers)
            assert reply.status_code == 200 and reply.headers["x-routed-to"] == "llm-2"
            assert reply.headers["x-gateway-destination-endpoint-served"] == replicas["llm-0"]
            deadline = time.monotonic() + 10
            while not store.exists(placed):  # the first gateway's access log entry, then its write
                assert time.monotonic() < deadline, "the placement never reached the store"
                time.sleep(0.02)
            turn_2 = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                      {"role": "user", "content": "more"}]
            reply = post(second.url + URL, chat("", messages=turn_2), headers)  # a gateway that never routed it
            assert reply.status_code == 200 and reply.headers["x-routed-to"] == "llm-0"
            assert reply.headers["x-route-reason"] != "home"
            assert first.wait_idle()["in_flight_requests"] == 0 and second.wait_idle()["in_flight_requests"] == 0
    finally:
        stubs.stop()
