"""The migration port's bearer token, on a real `llm-ring serve`: the calls a slot sidecar
makes pass with service.migration_token_file's token and are refused (UNAUTHENTICATED,
counted) without it or with another; the Admin port asks for none."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.service.admin_client import AdminClient
from extproc.stack.processes import Running, free_port, service_env, start_service, static_discovery

TOKEN = "0123456789abcdef0123456789abcdef"
REFUSED = "migration_unauthenticated"


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[Running, str, str]]:
    """A running service with a migration port and a token file: (it, the migration port, /metrics)."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")  # as `kubectl create secret --from-file` may leave it
    migration, metrics = (f"127.0.0.1:{free_port()}" for _ in range(2))
    env = service_env(f"127.0.0.1:{free_port()}", tmp_path / "replicas.json",
                      static_discovery({"llm-0": "127.0.0.1:9"}), migration_listen=f'"{migration}"',
                      migration_token_file=f'"{token_file}"', metrics_listen=f'"{metrics}"')
    running = start_service(tmp_path / "service", env)
    try:
        yield running, migration, f"http://{metrics}/metrics"
    finally:
        running.stop()


def refusals(metrics_url: str) -> float:
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=5).text):
        for sample in family.samples:
            if sample.name == "llm_ring_errors_total" and sample.labels["kind"] == REFUSED:
                return sample.value
    raise AssertionError(f"no llm_ring_errors_total{{kind={REFUSED!r}}} in the scrape")


def sidecar_calls(admin: AdminClient) -> list[Callable[[], Any]]:
    """Each method a drain calls on the migration port."""
    return [admin.state, lambda: admin.placements("llm-0"), lambda: admin.migrated([], 0, 0, 0, 0.0)]


def test_the_migration_port_answers_the_token(service: tuple[Running, str, str]) -> None:
    _, migration, metrics = service
    with AdminClient(migration, token=TOKEN) as admin:
        assert admin.state()["routing"]["virtual_nodes"] > 0
        assert admin.placements("llm-0") == []
        assert admin.migrated([], 0, 0, 0, 0.0) == 0
    assert refusals(metrics) == 0


@pytest.mark.parametrize("token", [None, "", TOKEN[:-1], TOKEN + "0", "not-the-token"])
def test_the_migration_port_refuses_a_call_without_the_token_and_counts_it(service: tuple[Running, str, str],
                                                                           token: str | None) -> None:
    _, migration, metrics = service
    with AdminClient(migration, token=token) as admin:
        calls = sidecar_calls(admin)
        for call in calls:
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert refusals(metrics) == len(calls)


def test_the_admin_port_wants_no_token_and_the_migration_port_serves_no_more_with_one(
        service: tuple[Running, str, str]) -> None:
    running, migration, metrics = service
    with AdminClient(running.address) as admin:
        assert admin.set_routing({"epsilon": 0.5})["routing"]["epsilon"] == 0.5
        assert admin.state()["routing"]["epsilon"] == 0.5
    with AdminClient(migration, token=TOKEN) as admin, pytest.raises(grpc.RpcError) as refused:
        admin.set_routing({"policy": "round-robin"})
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert refusals(metrics) == 0
