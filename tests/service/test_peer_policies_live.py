"""The peer policies in the live service (real Envoy, real `llm-ring serve`, stub upstreams):
switched on at run time, they route a growing conversation on the prefix blocks of its body."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from extproc.bench.stubs import start_stub_upstream
from extproc.routing import reasons
from extproc.service.admin_client import AdminClient
from extproc.stack.processes import free_port, static_discovery
from tests.service.gateway_support import Gateway, gateway, post

pytestmark = pytest.mark.live
URL = "/v1/chat/completions"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    ports = [free_port() for _ in range(3)]
    stubs = start_stub_upstream(ports, tmp_path_factory.mktemp("stubs"))
    replicas = {f"llm-{i}": f"127.0.0.1:{port}" for i, port in enumerate(ports)}
    try:
        with gateway(tmp_path_factory.mktemp("gw"), static_discovery(replicas)) as running:
            yield running
    finally:
        stubs.stop()


def logged(gw: Gateway, request_id: str, timeout: float = 3.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not (found := [r for r in gw.decisions() if r["request_id"] == request_id]):
        assert time.monotonic() < deadline, f"no route_decision for {request_id}"
        time.sleep(0.05)
    return found[0]


@pytest.mark.parametrize("policy", ["prefix-affinity", "radix-balance", "chwbl", "kv-cost"])
def test_a_peer_policy_routes_a_conversation_on_its_prefix_blocks(gw: Gateway, policy: str) -> None:
    with AdminClient(gw.admin) as admin:
        assert admin.set_routing({"policy": policy})["routing"]["policy"] == policy
    messages = [{"role": "system", "content": f"{policy}: you are terse. " * 30}]
    picks, traces = [], []
    for turn in range(3):
        messages.append({"role": "user", "content": f"question {turn} " * 20})
        reply = post(gw.url + URL, {"messages": messages, "max_tokens": 4}, {"x-conversation-id": policy})
        assert reply.status_code == 200 and reply.headers["x-route-reason"] in reasons()
        picks.append(reply.headers["x-routed-to"])
        traces.append(logged(gw, reply.headers["x-request-id"])["trace"])
        messages.append({"role": "assistant", "content": "noted. " * 10})
    assert all(trace["policy"] == policy and trace["prompt_blocks"] > 10 for trace in traces)
    assert len(set(picks)) == 1  # one client at a time: every peer keeps the conversation in place
    if policy != "chwbl":  # KubeAI keeps no view of what it sent, so it predicts no cache
        assert 0 < traces[2]["cached_tokens"] < traces[2]["prompt_tokens"]
