"""Where an InferencePool gateway sends a request (picker_gateway_config.py renders the rest): how
it calls the picker (its gRPC service, the phases it sends), the pool's route with its per-route
overrides, and the pool's and the picker's clusters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from extproc.envoy.contract import DESTINATION, SERVED, socket_address, split_host_port
from extproc.service.dataplanes.picker_gateways import (
    LB_NAMESPACE,
    PICKER_CLUSTER,
    PICKER_FILTER,
    POOL_CLUSTER,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    TEST_SUBSET_HEADER,
    UPSTREAM_HEADER,
    BodyMode,
    InferenceGateway,
)

_T = "type.googleapis.com/"
_BODY_MODES = {"duplex": "FULL_DUPLEX_STREAMED", "buffered": "BUFFERED"}


def every_phase(mode: BodyMode) -> dict[str, str]:
    body = _BODY_MODES[mode]
    return {
        "request_header_mode": "SEND", "request_body_mode": body, "request_trailer_mode": "SEND",
        "response_header_mode": "SEND", "response_body_mode": body, "response_trailer_mode": "SEND",
    }


def picker_service(timeout_s: int | None) -> dict[str, Any]:
    return {
        "envoy_grpc": {"cluster_name": PICKER_CLUSTER, "authority": "endpoint-picker.llm-ring.svc"},
        **({"timeout": f"{timeout_s}s"} if timeout_s else {}),
    }


def route_config(
    gateway: InferenceGateway, mode: BodyMode, pool_endpoints: Sequence[str], hints: Mapping[str, Sequence[str]],
    report_served: bool, show_upstream: bool,
) -> dict[str, Any]:
    action: dict[str, Any] = {"cluster": POOL_CLUSTER, "auto_host_rewrite": False}
    if gateway.route_timeout_s is not None:
        action["timeout"] = f"{gateway.route_timeout_s}s"
    if gateway.route_retries:
        action["retry_policy"] = _istio_default_retries(gateway.route_retries)
    if gateway.route_subset_match:
        action["metadata_match"] = {"filter_metadata": {SUBSET_NAMESPACE: {SUBSET_KEY: list(pool_endpoints)}}}
    per_filter: dict[str, Any] = {}
    if gateway.route_fail_open is not None:
        overrides: dict[str, Any] = {
            "failure_mode_allow": gateway.route_fail_open,
            "grpc_service": picker_service(gateway.route_grpc_timeout_s),
            **({"processing_mode": every_phase(mode)} if gateway.route_processing_mode else {}),
        }
        per_filter[PICKER_FILTER] = {
            "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute", "overrides": overrides,
        }
    response_headers = [
        *([_add_header(SERVED, "%UPSTREAM_HOST%")] if report_served else []),
        *([_add_header(UPSTREAM_HEADER, "%UPSTREAM_HOST%")] if show_upstream else []),
    ]

    def route(match: dict[str, Any], extra_filters: Mapping[str, Any]) -> dict[str, Any]:
        filters = {**per_filter, **extra_filters}
        return {
            "match": match,
            "route": action,
            **({"typed_per_filter_config": filters} if filters else {}),
            **({"response_headers_to_add": response_headers} if response_headers else {}),
        }

    enabled = {"@type": _T + "envoy.config.route.v3.FilterConfig", "config": {}}
    routes = [
        route({"prefix": "/", "headers": [{"name": TEST_SUBSET_HEADER, "string_match": {"exact": name}}]},
              {f"subset-hint.{name}": enabled})
        for name in hints
    ]
    routes.append(route({"prefix": "/"}, {}))
    return {"name": "inference-pool", "virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": routes}]}


def _add_header(name: str, value: str) -> dict[str, Any]:
    return {"header": {"key": name, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}


def _istio_default_retries(retries: int) -> dict[str, Any]:
    """Istio's retry policy for a route that names none: other hosts, never the one that failed."""
    return {
        "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
        "num_retries": retries,
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {"@type": _T + "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"},
        }],
        "host_selection_retry_max_attempts": 5,
    }


def pool_cluster(gateway: InferenceGateway, pool_endpoints: Sequence[str]) -> dict[str, Any]:
    """ORIGINAL_DST: Envoy connects to the address in x-gateway-destination-endpoint;
    override_host: one of the pool's endpoints, the one named in envoy.lb metadata (Istio)."""
    cluster: dict[str, Any] = {"name": POOL_CLUSTER, "connect_timeout": f"{gateway.pool_connect_timeout_s}s"}
    if gateway.pool == "original_dst":
        cluster.update({
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
        })
    else:
        def lb_key(key: str) -> dict[str, Any]:
            return {"key": LB_NAMESPACE, "path": [{"key": key}]}

        round_robin = {"typed_extension_config": {
            "name": "envoy.load_balancing_policies.round_robin",
            "typed_config": {"@type": _T + "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"},
        }}
        cluster.update({
            "type": "STATIC",
            "load_assignment": {"cluster_name": POOL_CLUSTER, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": socket_address(*split_host_port(endpoint))}} for endpoint in pool_endpoints
            ]}]},
            "load_balancing_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.override_host",
                "typed_config": {
                    "@type": _T + "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                    "override_host_sources": [{"metadata": lb_key(DESTINATION)}],
                    "selected_host_key": lb_key(SERVED),
                    "fallback_policy": {"policies": [round_robin]},
                },
            }}]},
        })
    if gateway.pool_circuit_breaker is not None:
        limit = gateway.pool_circuit_breaker
        cluster["circuit_breakers"] = {
            "thresholds": [{"max_connections": limit, "max_pending_requests": limit, "max_requests": limit}]
        }
    return cluster


def picker_cluster(picker: str) -> dict[str, Any]:
    """STRICT_DNS, LEAST_REQUEST, HTTP/2 over TLS that accepts any certificate: the same in
    both gateways (the picker's Service name and port, here a loopback address)."""
    host, port = split_host_port(picker)
    return {
        "name": PICKER_CLUSTER,
        "type": "STRICT_DNS",
        "lb_policy": "LEAST_REQUEST",
        "connect_timeout": "10s",
        "load_assignment": {
            "cluster_name": PICKER_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"health_status": "HEALTHY",
                                             "endpoint": {"address": socket_address(host, port)}}]}],
        },
        "transport_socket": {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": _T + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"validation_context": {}},
            },
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
    }
