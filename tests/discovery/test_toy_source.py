"""A discovery source added from outside: tests/discovery/toy_source.py and one register line,
then chosen by the settings and followed by the service into the router's replica set."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from grpc_health.v1.health import aio as health_aio

from extproc.discovery.plugin import make_discovery, register, unregister
from extproc.routing import Router, RouteRequest
from extproc.service.gateway import Gateway
from extproc.service.http_probes import Readiness
from extproc.service.main import follow_discovery
from extproc.service.metrics import Metrics
from extproc.settings import Settings, SettingsError, parse_settings, read_toml
from extproc.stack.processes import ROUTER_REFERENCE
from tests.discovery import toy_source

WAVES = [["toy-a"], ["toy-a", "toy-b"], ["toy-b"]]


@pytest.fixture
def toy() -> Iterator[None]:
    register("toy", "tests.discovery.toy_source")  # the one registry line
    yield
    unregister("toy")


def toy_settings(**section: Any) -> Settings:
    """The reference settings with the toy chosen and its section given."""
    raw = read_toml(ROUTER_REFERENCE)
    raw["service"]["envoy_endpoints_file"] = ""
    raw["discovery"] |= {"source": "toy", "toy": {"waves": WAVES, "first_port": 9000} | section}
    return parse_settings(raw, "router.toml")


class SeenSets:
    """The service's replica askers, told after each snapshot applied: what the router held then."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.seen: list[tuple[str, ...]] = []

    def replicas_changed(self) -> None:
        self.seen.append(self.gateway.router.replicas)


def test_the_service_follows_it_into_the_router_s_replica_set(toy: None) -> None:
    settings = toy_settings()
    gateway = Gateway(Router(settings.routing), settings.service, Metrics())
    askers, readiness = SeenSets(gateway), Readiness()

    async def scenario() -> None:
        following = asyncio.create_task(
            follow_discovery(settings, gateway, askers, health_aio.HealthServicer(), readiness))  # type: ignore[arg-type]
        while len(askers.seen) < len(WAVES):
            await asyncio.sleep(0.01)
        following.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert askers.seen == [("toy-a",), ("toy-a", "toy-b"), ("toy-b",)]
    assert gateway.fleet.endpoints == {"toy-b": "127.0.0.1:9001"}
    assert readiness.replicas_known
    decision = gateway.router.route(RouteRequest("r1", "conversation", 10, 10)).decision
    assert decision is not None and decision.replica == "toy-b"


def test_its_section_is_checked_like_any_source_s(toy: None) -> None:
    assert isinstance(make_discovery(toy_settings().discovery), toy_source.ToyDiscovery)
    with pytest.raises(SettingsError, match=r"^router\.toml: discovery\.toy\.first_port: Input should be greater "
                                            r"than 0 \(got 0\)$"):
        toy_settings(first_port=0)
    with pytest.raises(SettingsError, match=r"discovery\.toy\.port: unknown setting \(valid: waves, first_port\)"):
        toy_settings(port=9000)


def test_unregistered_it_is_an_unknown_source() -> None:
    with pytest.raises(SettingsError, match=r"discovery\.source: Input should be 'static', 'file', 'kubernetes' or "
                                            r"'inference-pool' \(got 'toy'\)"):
        toy_settings()
