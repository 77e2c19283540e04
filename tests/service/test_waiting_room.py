"""The waiting room in one process: a request that need not wait goes the gateway's usual way,
its flow read from its header values (test_flow_control_live.py runs the waits through Envoy)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from extproc.routing import Router
from extproc.routing.flows import Flow, flow_of
from extproc.service.bounds import BOUNDED_CHARS, bounded
from extproc.service.dataplanes.own_envoy import OWN_ENVOY
from extproc.service.gateway import Gateway
from extproc.service.metrics import Metrics
from extproc.service.waiting_room import FLOWS_KEPT, HeldReads, WaitingRoom
from extproc.settings import load_settings
from tests.routing.flow_support import flow_settings

SETTINGS = load_settings(Path(__file__).parents[2] / "extproc" / "service" / "router.toml")
ENDPOINTS = {"llm-0": "127.0.0.1:9000", "llm-1": "127.0.0.1:9001"}


def make_room() -> WaitingRoom:
    gateway = Gateway(Router(SETTINGS.routing), SETTINGS.service, Metrics())
    gateway.set_replicas(ENDPOINTS)
    return WaitingRoom(gateway, flow_settings(objectives={"interactive": 10}, anonymous_max_priority=0))


def test_a_request_with_room_is_routed_at_once_charged_to_its_flow_and_released_with_its_end() -> None:
    room = make_room()
    body = orjson.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})

    async def route() -> tuple[bytes, str | None]:
        return await room.route(HeldReads(None), shape=OWN_ENVOY, path="/v1/chat/completions",
                                content_type="application/json",
                                session_headers={}, turn="1", request_id="envoy-1", body=body, tenant="acme",
                                objective="interactive")

    answer, routed_id = asyncio.run(route())
    assert answer and routed_id in room.gateway.requests.pending and room.waiting() == 0
    assert room.metrics.outcomes == {(10, "at_once"): 1}
    assert room.control.queue.in_flight == {Flow(10, "acme"): 1}
    room.gateway.requests.access_logged(routed_id, 200, ENDPOINTS["llm-0"], False, None)
    assert room.control.queue.in_flight == {} and not room.gateway.requests.pending


def test_a_flow_is_kept_by_its_header_values_and_what_is_kept_stays_bounded() -> None:
    room = make_room()
    assert room._flow("acme", "interactive") == Flow(10, "acme") == room._flow("acme", "interactive")
    assert room._flow("", "interactive") == Flow(0, "default")  # no tenant: capped, as flow_of says
    long_tenant = "t" * (BOUNDED_CHARS + 1)
    assert room._flow(long_tenant, "") == flow_of(room.settings, bounded(long_tenant), "")
    assert (long_tenant, "") not in room._flows  # a long value is bounded each time, never kept
    for index in range(FLOWS_KEPT + 5):
        assert room._flow(f"tenant-{index}", "") == Flow(0, f"tenant-{index}")
    assert len(room._flows) <= FLOWS_KEPT
