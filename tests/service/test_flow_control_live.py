"""Flow control through both data planes, real Envoy and real llama.cpp replicas: a request
that finds every slot taken waits in the router and goes when a slot frees; a waiting request
whose client leaves is gone, with no load left behind; one that waits past the TTL gets 429
with its reason. Our own Envoy, and Envoy AI Gateway's full-duplex TLS InferencePool plane."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest

from extproc.stack.processes import static_discovery
from tests.service.gateway_support import (
    Gateway,
    LlamaReplicas,
    chat,
    error_message,
    gateway,
    inference_pool_gateway,
    llama_replicas,
    post,
)

pytestmark = pytest.mark.live
URL = "/v1/chat/completions"
TTL_S = 6.0
# one slot a replica (the replicas have 2: the second is never used), no headroom
FLOW = {"slots": "1", "reserved_slots": "0", "ttl_seconds": str(TTL_S)}
TENANT = "x-gateway-inference-fairness-id"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaReplicas]:
    with llama_replicas(tmp_path_factory.mktemp("llama")) as started:
        yield started


def own_envoy(workdir: Path, replicas: LlamaReplicas) -> AbstractContextManager[Gateway]:
    return gateway(workdir, static_discovery(replicas.addresses), replica_key_file=replicas.key_file, flow=FLOW)


def inference_pool(workdir: Path, replicas: LlamaReplicas) -> AbstractContextManager[Gateway]:
    return inference_pool_gateway(workdir, replicas.addresses, flow=FLOW,
                                  replica_api_key_file=f'"{replicas.key_file}"')


PLANES = [pytest.param(own_envoy, id="own-envoy"), pytest.param(inference_pool, id="inference-pool")]


def tokens_per_second(gw: Gateway) -> float:
    """How fast a replica generates now (llama.cpp's timings of one answer): the fillers are sized
    in seconds, as this machine's speed varies with its load."""
    reply = post(gw.url + URL, chat("warm up", max_tokens=32, ignore_eos=True), {TENANT: "filler"}, 60.0)
    assert reply.status_code == 200, reply.text
    return float(reply.json()["timings"]["predicted_per_second"])


def fill(gw: Gateway, seconds: float, speed: float) -> list[threading.Thread]:
    """Both slots taken by a generation of about ``seconds`` each (threads, joined by the caller)."""
    tokens = max(16, round(seconds * speed))
    threads = [threading.Thread(target=post, args=(gw.url + URL, chat(f"count {index}", max_tokens=tokens,
                                                                      ignore_eos=True), {TENANT: "filler"}, 120.0))
               for index in range(2)]
    for thread in threads:
        thread.start()
    _until(lambda: gw.state()["in_flight_requests"] == 2)
    return threads


@pytest.mark.parametrize("plane", PLANES)
def test_a_request_waits_for_a_free_slot_and_its_client_may_leave_or_its_ttl_expire(
        plane: Callable[[Path, LlamaReplicas], AbstractContextManager[Gateway]], replicas: LlamaReplicas,
        tmp_path: Path) -> None:
    with plane(tmp_path, replicas) as gw:
        speed = tokens_per_second(gw)
        fillers = fill(gw, 1.5, speed)  # the quiet request meets both slots taken, and waits well below the TTL
        started = time.monotonic()
        reply = post(gw.url + URL, chat("hello", max_tokens=2), {TENANT: "quiet"}, 60.0)
        waited = time.monotonic() - started
        assert reply.status_code == 200, reply.text
        for thread in fillers:
            thread.join()
        [line] = [line for line in gw.decisions() if line["trace"].get("queue", {}).get("tenant") == "quiet"]
        assert line["queue_wait_ms"] > 200 and line["trace"]["queue"]["kind"] in ("local", "new", "fair")
        assert line["queue_wait_ms"] / 1000 <= waited
        if not gw.replica_of:  # our own Envoy carries the routing headers to the client
            assert int(reply.headers["x-route-queue-wait-ms"]) == round(line["queue_wait_ms"])
        assert gw.wait_idle()["in_flight_requests"] == 0

        fillers = fill(gw, 2 * TTL_S + 4, speed)  # longer than the TTL and the two waits below
        with pytest.raises(httpx.ReadTimeout):  # a client that gives up while its request waits
            post(gw.url + URL, chat("gone", max_tokens=2), {TENANT: "leaver"}, 1.0)
        _until(lambda: gw.metric("llm_ring_flow_requests_total", band="0", outcome="cancelled") == 1)
        assert gw.metric("llm_ring_flow_waiting", band="0", tenant="leaver") == 0
        assert gw.state()["in_flight_requests"] == 2  # the fillers' alone: nothing charged for it

        started = time.monotonic()
        expired = post(gw.url + URL, chat("late", max_tokens=2), {TENANT: "late"}, 60.0)
        assert expired.status_code == 429 and expired.headers["x-llm-ring-dropped-reason"] == "ttl-expired"
        assert "flow.ttl_seconds" in error_message(expired.json())
        assert TTL_S <= time.monotonic() - started < TTL_S + 3
        assert gw.state()["in_flight_requests"] == 2
        for thread in fillers:
            thread.join()
        assert gw.wait_idle()["in_flight_requests"] == 0
        served = [line["trace"].get("queue", {}).get("tenant") for line in gw.decisions()]
        assert "leaver" not in served and "late" not in served  # neither reached a replica
        assert gw.metric("llm_ring_flow_requests_total", band="0", outcome="expired") == 1


def _until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)
