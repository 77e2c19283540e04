"""The InferencePool data planes (extproc.service.dataplanes.picker_gateways): Envoy accepts
each one, each says what its gateway's sources say, and through real Envoy (with the stub picker
and stub upstreams) the ORIGINAL_DST pool connects to the address the picker put in the header."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from extproc.bench.stubs import start_stub_picker, start_stub_upstream
from extproc.envoy.contract import DESTINATION, SERVED
from extproc.service.dataplanes.picker_gateway_config import render_inference_gateway_config
from extproc.service.dataplanes.picker_gateways import (
    AI_GATEWAY,
    GATEWAYS,
    ISTIO,
    KGATEWAY,
    LB_NAMESPACE,
    PICKER_FILTER,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    UPSTREAM_HEADER,
    InferenceGateway,
)
from extproc.stack.processes import envoy_binary, free_port, start_inference_gateway_envoy

VARIANTS = [(gateway, mode) for gateway in GATEWAYS.values() for mode in gateway.body_modes]
IDS = [f"{gateway.name}-{mode}" for gateway, mode in VARIANTS]


def render(gateway: InferenceGateway, **options: Any) -> dict[str, Any]:
    text = render_inference_gateway_config(
        gateway, listen="127.0.0.1:18000", admin="127.0.0.1:18001", picker="127.0.0.1:9002",
        pool_endpoints=["127.0.0.1:8001", "127.0.0.1:8002"], **options,
    )
    return dict(json.loads(text))


def picker_filter(config: dict[str, Any]) -> dict[str, Any]:
    filters = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return dict(next(f for f in filters["http_filters"] if f["name"] == PICKER_FILTER)["typed_config"])


def clusters(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {cluster["name"]: cluster for cluster in config["static_resources"]["clusters"]}


def routes(config: dict[str, Any]) -> list[dict[str, Any]]:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return list(hcm["route_config"]["virtual_hosts"][0]["routes"])


@pytest.mark.parametrize("gateway, mode", VARIANTS, ids=IDS)
@pytest.mark.parametrize("extras", [{}, {"subset_hints": {"one": ["127.0.0.1:8001"], "none": []},
                                         "report_served": True, "show_upstream": True}], ids=["plain", "test-extras"])
def test_envoy_validates_each_data_plane(
    tmp_path: Path, gateway: InferenceGateway, mode: str, extras: dict[str, Any]
) -> None:
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(render(gateway, body_mode=mode, **extras)))
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("gateway, mode", VARIANTS, ids=IDS)
def test_every_phase_is_sent_to_a_picker_over_tls_and_http2(gateway: InferenceGateway, mode: str) -> None:
    config = render(gateway, body_mode=mode)
    (route,) = routes(config)
    override = route.get("typed_per_filter_config", {}).get(PICKER_FILTER, {}).get("overrides", {})
    processing = override.get("processing_mode") or picker_filter(config)["processing_mode"]
    body = {"duplex": "FULL_DUPLEX_STREAMED", "buffered": "BUFFERED"}[mode]
    assert processing == {
        "request_header_mode": "SEND", "request_body_mode": body, "request_trailer_mode": "SEND",
        "response_header_mode": "SEND", "response_body_mode": body, "response_trailer_mode": "SEND",
    }
    picker = clusters(config)["endpoint-picker"]
    assert picker["type"] == "STRICT_DNS" and picker["lb_policy"] == "LEAST_REQUEST"
    tls = picker["transport_socket"]["typed_config"]
    assert tls["common_tls_context"] == {"validation_context": {}}  # no certificate validation
    assert "http2_protocol_options" in picker["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
    # the safety addition: the client's own destination header is gone before the picker runs
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    first = hcm["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]
    assert {"remove": DESTINATION} in first


@pytest.mark.parametrize("gateway", [AI_GATEWAY, KGATEWAY], ids=["envoy-ai-gateway", "kgateway"])
def test_the_pool_is_an_original_dst_cluster_reading_the_header(gateway: InferenceGateway) -> None:
    pool = clusters(render(gateway))["inference-pool"]
    assert pool["type"] == "ORIGINAL_DST" and pool["lb_policy"] == "CLUSTER_PROVIDED"
    assert pool["original_dst_lb_config"] == {"use_http_header": True, "http_header_name": DESTINATION}


def test_envoy_ai_gateway_as_its_extension_server_writes_it() -> None:
    config = render(AI_GATEWAY)
    extproc = picker_filter(config)
    assert extproc["message_timeout"] == "300s" and extproc["failure_mode_allow"] is False
    assert extproc["allow_mode_override"] is False and "metadata_options" not in extproc
    assert picker_filter(render(AI_GATEWAY, allow_mode_override=True))["allow_mode_override"] is True
    (route,) = routes(config)
    assert route["route"]["timeout"] == "60s" and "retry_policy" not in route["route"]
    assert "typed_per_filter_config" not in route
    assert clusters(config)["inference-pool"]["connect_timeout"] == "10s"


def test_kgateway_as_its_endpoint_picker_plugin_writes_it() -> None:
    config = render(KGATEWAY)
    extproc = picker_filter(config)
    assert extproc["message_timeout"] == "5s" and extproc["failure_mode_allow"] is True  # listener level
    assert extproc["metadata_options"] == {
        "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]}, "receiving_namespaces": {"untyped": [LB_NAMESPACE]},
    }
    (route,) = routes(config)
    override = route["typed_per_filter_config"][PICKER_FILTER]["overrides"]
    assert override["failure_mode_allow"] is False and override["grpc_service"]["timeout"] == "10s"
    assert "timeout" not in route["route"] and "retry_policy" not in route["route"]
    assert route["route"]["metadata_match"]["filter_metadata"][SUBSET_NAMESPACE][SUBSET_KEY] == [
        "127.0.0.1:8001", "127.0.0.1:8002"]
    pool = clusters(config)["inference-pool"]
    assert pool["connect_timeout"] == "1000s" and pool["circuit_breakers"]["thresholds"][0]["max_requests"] == 40000
    with pytest.raises(ValueError, match="kgateway generates no 'buffered' body mode"):
        render(KGATEWAY, body_mode="buffered")


def test_istio_as_its_route_and_cluster_builders_write_it() -> None:
    config = render(ISTIO)
    extproc = picker_filter(config)
    assert extproc["processing_mode"] == {"request_header_mode": "SKIP", "response_header_mode": "SKIP"}
    assert extproc["message_timeout"] == "1000s" and extproc["grpc_service"]["timeout"] == "10s"
    assert extproc["failure_mode_allow"] is True
    assert extproc["metadata_options"] == {
        "forwarding_namespaces": {"untyped": [LB_NAMESPACE]}, "receiving_namespaces": {"untyped": [LB_NAMESPACE]},
    }
    (route,) = routes(config)
    override = route["typed_per_filter_config"][PICKER_FILTER]["overrides"]
    assert override["failure_mode_allow"] is False and "timeout" not in override["grpc_service"]
    assert route["route"]["timeout"] == "0s" and route["route"]["retry_policy"]["num_retries"] == 2
    policy = clusters(config)["inference-pool"]["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    override_host = policy["typed_config"]
    pick = {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}
    assert override_host["override_host_sources"] == [{"metadata": pick}]
    assert override_host["selected_host_key"] == {"key": LB_NAMESPACE, "path": [{"key": SERVED}]}


def test_test_extras_forward_the_subset_hint_and_the_served_endpoint() -> None:
    config = render(AI_GATEWAY, subset_hints={"one": ["127.0.0.1:8001"]}, report_served=True, show_upstream=True)
    assert picker_filter(config)["metadata_options"] == {
        "forwarding_namespaces": {"untyped": [LB_NAMESPACE, SUBSET_NAMESPACE]}}
    hinted, default = routes(config)
    assert hinted["typed_per_filter_config"] == {
        "subset-hint.one": {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}}
    added = {header["header"]["key"] for header in default["response_headers_to_add"]}
    assert added == {SERVED, UPSTREAM_HEADER}


# ------------------------------------------------------------------ through real Envoy


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """Two stub upstreams and a stub picker that always picks the second."""
    workdir = tmp_path_factory.mktemp("stubs")
    ports = [free_port(), free_port()]
    upstream = start_stub_upstream(ports, workdir)
    first, second = (f"127.0.0.1:{port}" for port in ports)
    picker = start_stub_picker(free_port(), second, workdir)
    try:
        yield first, second, picker.ext_proc
    finally:
        picker.stop()
        upstream.stop()


@pytest.mark.live
@pytest.mark.parametrize("gateway, mode", VARIANTS, ids=IDS)
def test_the_pool_connects_where_the_picker_said_whatever_the_client_sent(
    tmp_path: Path, stubs: tuple[str, str, str], gateway: InferenceGateway, mode: str
) -> None:
    first, second, picker = stubs
    envoy = start_inference_gateway_envoy(tmp_path, gateway, picker, [first, second], 1, body_mode=mode,
                                          show_upstream=True)
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for headers in ({}, {DESTINATION: first}):
            reply = httpx.post(f"http://{envoy.listen}/v1/chat/completions", json=body, headers=headers, timeout=10)
            assert reply.status_code == 200, reply.text
            assert reply.headers[UPSTREAM_HEADER] == second
            assert reply.json()["timings"]["cache_n"] == 3  # the stub upstream's answer, whole
    finally:
        envoy.stop()


@pytest.mark.live
@pytest.mark.parametrize("gateway", [AI_GATEWAY, KGATEWAY], ids=["envoy-ai-gateway", "kgateway"])
def test_a_request_the_picker_lets_pass_never_goes_where_the_client_said(
    tmp_path: Path, stubs: tuple[str, str, str], gateway: InferenceGateway
) -> None:
    """Without the strip filter this request reaches the client's address (checked: 200 from
    it); with it, the pool has no destination and Envoy answers 503."""
    first, _, _ = stubs
    silent = start_stub_picker(free_port(), "", tmp_path / "picker")  # answers every phase, picks nothing
    envoy = start_inference_gateway_envoy(tmp_path / "envoy", gateway, silent.ext_proc, [first], 1,
                                          show_upstream=True)
    try:
        reply = httpx.post(f"http://{envoy.listen}/v1/chat/completions", json={"messages": []},
                           headers={DESTINATION: first}, timeout=10)
        assert reply.status_code == 503 and UPSTREAM_HEADER not in reply.headers, reply.text
    finally:
        envoy.stop()
        silent.stop()
