"""The local stack with two gateways, as real processes: 2 xllamacpp replicas of SmolLM2-135M,
two gateway pairs (Envoy + routing service, llm-aware), the front Envoy that spreads
connections over them at random, and the store's redis-server. Turns sent back to back on a
new connection each meet both gateways; a SIGKILLed gateway stops getting connections and
gets them again once restarted; a SIGKILLed store leaves each router on its own state until
it is back."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from extproc.experiments.run import settled
from extproc.stack import models
from extproc.stack.gateways import STORE
from extproc.stack.lab import LocalLab
from extproc.stack.ports import HOST, port_of
from extproc.stack.redis_server import ADMIN, password_file, redis_answers
from extproc.stack.settings import load_stack_settings
from extproc.stack.store import CONVERSATION_KEYS
from tests.service.gateway_support import assert_each_turn_reused_the_whole_previous_prompt, back_to_back

pytestmark = pytest.mark.live
FREE_PORTS = {"gateway": 0, "envoy_admin": 0, "router": 0, "metrics": 0, "replica_base": 0, "gateway_base": 0,
              "store": 0}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalLab]:
    settings = load_stack_settings(overrides={
        "replicas": {"count": 2, "model": "smollm2", "ctx_size": 8192, "parallel": 2, "cache_ram_mib": 0},
        "gateways": {"count": 2},
        "ports": FREE_PORTS,
        "router": {"policy": "llm-aware"},
        "check": {"profile": "quick"},
    })
    models.prepare("smollm2", models.data_dir(), progress=lambda _: None)
    with LocalLab.start(settings, run=tmp_path_factory.mktemp("stack"), progress=lambda _: None) as running:
        yield running


def test_status_lists_every_gateway_the_front_and_the_store(lab: LocalLab) -> None:
    status = lab.stack.status()
    assert [g["name"] for g in status["gateways"]] == ["gw-0", "gw-1"]
    assert all(g[kind]["ready"] for g in status["gateways"] for kind in ("router", "envoy"))
    assert status["front"]["ready"] and status["store"]["ready"]
    assert redis_answers(int(status["store"]["url"].rsplit(":", 1)[1].split("/")[0]))
    assert status["router"] == status["gateways"][0]["router"]  # one-gateway readers see the first
    front = json.loads((Path(lab.stack.state.run_dir) / "front" / "envoy.yaml").read_text())
    endpoints = front["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    listening = {f"{e['endpoint']['address']['socket_address']['address']}:"
                 f"{e['endpoint']['address']['socket_address']['port_value']}" for e in endpoints}
    assert listening == {g["listen"] for g in status["gateways"]}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_back_to_back_turns_on_new_connections_meet_both_gateways_and_stay_on_their_replica(
    lab: LocalLab, stream: bool
) -> None:
    before = lab.router_states()
    for conversation in range(8):
        turns = back_to_back(lab.gateway_url, conversation, stream, with_header=True, new_connections=True)
        assert_each_turn_reused_the_whole_previous_prompt(turns)
    after = settled(lab)
    routed = {name: after[name]["decisions"] - before[name]["decisions"] for name in after}
    assert sum(routed.values()) == 8 * 4 and min(routed.values()) > 0, routed  # both gateways routed turns
    assert all(s["in_flight_requests"] == 0 and s["in_flight_tokens"] == 0 for s in after.values()), after


def test_a_killed_gateway_stops_getting_connections_and_gets_them_again_once_restarted(lab: LocalLab) -> None:
    lab.kill_part("gw-1")
    try:
        # at once, before the front's health check can know: a connection to the dead one is
        # refused, tried again on another gateway, and the refusal ejects it
        during = [_ask(lab, f"during-{i}") for i in range(12)]
        time.sleep(2.0)  # two supervisor rounds: a gateway held down is not restarted by it
        assert not any(lab.stack.status()["gateways"][1][kind]["alive"] for kind in ("router", "envoy"))
    finally:
        lab.restart_part("gw-1")
    assert during == [200] * 12
    before = lab.router_states()["gw-1"]["decisions"]
    deadline = time.monotonic() + 60
    while lab.router_states()["gw-1"]["decisions"] == before:  # the health check lets it back in
        assert time.monotonic() < deadline, "gw-1 got no request after its restart"
        assert _ask(lab, "after") == 200
    assert all(s["in_flight_requests"] == 0 for s in settled(lab).values())


def test_a_killed_store_leaves_each_router_on_its_own_state_until_the_store_is_back(lab: LocalLab) -> None:
    metrics = [g["metrics_url"] for g in lab.stack.status()["gateways"]]
    assert all(_store_in_use(url) == 1 for url in metrics)
    lab.kill_part("store")
    try:
        during = [_ask(lab, f"store-down-{i}") for i in range(8)]
        assert not lab.stack.status()["store"]["alive"]
        _wait_until(lambda: all(_store_in_use(url) == 0 for url in metrics), "a router still uses the dead store")
    finally:
        lab.restart_part("store")
    assert during == [200] * 8  # routing went on
    # each router's heartbeat reconnects store.retry_seconds after the failure
    _wait_until(lambda: all(_store_in_use(url) == 1 for url in metrics), "a router did not take the store back")
    assert all(s["in_flight_requests"] == 0 and s["in_flight_tokens"] == 0 for s in settled(lab).values())


def _store_in_use(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("llm_ring_store_in_use "))


def _wait_until(condition: Callable[[], bool], failure: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.5)


def _ask(lab: LocalLab, conversation: str) -> int:
    with httpx.Client(timeout=60) as client:  # a new connection: the front draws a gateway for it
        reply = client.post(lab.gateway_url + "/v1/chat/completions", headers={"x-conversation-id": conversation},
                            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    return reply.status_code


def test_a_reset_forgets_the_conversations_in_the_store_and_keeps_the_routers_registered(lab: LocalLab) -> None:
    """Between experiment runs: the next run's conversations, sent under the same ids, are new."""
    assert _ask(lab, "before-the-reset") == 200
    with _store_admin(lab) as admin:
        _wait_until(lambda: bool(list(admin.scan_iter(match="*:place:*"))), "no placement was published")
        registered = sorted(admin.scan_iter(match="*:routers"))
        lab.reset()
        assert [key for pattern in CONVERSATION_KEYS for key in admin.scan_iter(match=pattern)] == []
        assert sorted(admin.scan_iter(match="*:routers")) == registered
    assert _ask(lab, "before-the-reset") == 200


def _store_admin(lab: LocalLab) -> redis.Redis:
    state = lab.stack.state
    password = password_file(Path(state.run_dir) / STORE, ADMIN).read_text().strip()
    return redis.Redis(host=HOST, port=port_of(state.store_url), username=ADMIN, password=password)


def test_down_stops_every_gateway_the_front_and_the_store(lab: LocalLab) -> None:
    """Last in the file: it stops the module's stack."""
    processes = lab.stack.processes()
    assert {"router-0", "envoy-0", "router-1", "envoy-1", "front", "store", "llm-0", "llm-1"} <= set(processes)
    lab.stack.down()
    assert [name for name, daemon in processes.items() if daemon.alive()] == []
