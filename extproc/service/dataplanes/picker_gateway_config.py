"""The Envoy bootstrap of an InferencePool gateway (picker_gateways.py: the gateways and what
each configures): the listener and its HTTP filters, with the tests' extras; the pool's route and
the clusters in picker_gateway_upstreams.py."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from extproc.envoy.contract import DESTINATION, SERVED, socket_address, split_host_port
from extproc.service.dataplanes.picker_gateway_upstreams import (
    every_phase,
    picker_cluster,
    picker_service,
    pool_cluster,
    route_config,
)
from extproc.service.dataplanes.picker_gateways import (
    LB_NAMESPACE,
    PICKER_FILTER,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    BodyMode,
    InferenceGateway,
)

_T = "type.googleapis.com/"
_HCM = _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


def render_inference_gateway_config(
    gateway: InferenceGateway,
    *,
    listen: str,
    admin: str,
    picker: str,
    pool_endpoints: Sequence[str],
    body_mode: BodyMode | None = None,
    allow_mode_override: bool = False,
    subset_hints: Mapping[str, Sequence[str]] | None = None,
    report_served: bool = False,
    show_upstream: bool = False,
) -> str:
    """Envoy bootstrap (JSON text) for ``gateway`` in front of the picker at ``picker``
    ("host:port", reached over TLS without validation, HTTP/2) and the pool's model servers
    ``pool_endpoints`` ("host:port" each; only kgateway writes them into its config).
    body_mode: None is the gateway's default; a mode the gateway cannot generate is refused.
    allow_mode_override: Envoy AI Gateway's aigateway.envoyproxy.io/allow-mode-override."""
    mode = body_mode or gateway.body_modes[0]
    if mode not in gateway.body_modes:
        raise ValueError(f"{gateway.name} generates no {mode!r} body mode (only {', '.join(gateway.body_modes)})")
    listen_host, listen_port = split_host_port(listen)
    admin_host, admin_port = split_host_port(admin)
    hints = dict(subset_hints or {})
    http_filters = _http_filters(gateway, mode, allow_mode_override, hints, report_served)
    config = {
        "node": {"id": f"{gateway.name}-inference-pool", "cluster": "llm-ring"},
        "admin": {"address": socket_address(admin_host, admin_port)},
        "static_resources": {
            "listeners": [{
                "name": "gateway",
                "address": socket_address(listen_host, listen_port),
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": _HCM,
                        "stat_prefix": "gateway",
                        "codec_type": "AUTO",
                        "route_config": route_config(gateway, mode, pool_endpoints, hints, report_served,
                                                      show_upstream),
                        "http_filters": http_filters,
                    },
                }]}],
            }],
            "clusters": [pool_cluster(gateway, pool_endpoints), picker_cluster(picker)],
        },
    }
    return json.dumps(config, indent=2) + "\n"


def _http_filters(gateway: InferenceGateway, mode: BodyMode, allow_mode_override: bool,
                  hints: Mapping[str, Sequence[str]], report_served: bool) -> list[dict[str, Any]]:
    """The gateway's filters, with the tests' extras (subset hints, the served endpoint reported)."""
    forwarding = sorted(
        set(gateway.forwarding)
        | ({SUBSET_NAMESPACE} if hints else set())
        | ({LB_NAMESPACE} if report_served else set())
    )
    return [
        _strip_client_destination(),
        *(_subset_hint_filter(name, endpoints) for name, endpoints in hints.items()),
        _picker_filter(gateway, mode, allow_mode_override, forwarding),
        *([_destination_to_metadata()] if gateway.destination_to_metadata else []),
        *([_served_to_metadata()] if report_served else []),
        {"name": "envoy.filters.http.router",
         "typed_config": {"@type": _T + "envoy.extensions.filters.http.router.v3.Router"}},
    ]


def _strip_client_destination() -> dict[str, Any]:
    """Safety, in no gateway's config: a client never names the upstream itself."""
    return {
        "name": "strip-client-destination",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": DESTINATION}, {"remove": SERVED}]},
        },
    }


def _picker_filter(
    gateway: InferenceGateway, mode: BodyMode, allow_mode_override: bool, forwarding: list[str]
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": picker_service(gateway.listener_grpc_timeout_s),
        "processing_mode": (
            {"request_header_mode": "SKIP", "response_header_mode": "SKIP"} if gateway.route_processing_mode
            else every_phase(mode)
        ),
        "message_timeout": f"{gateway.message_timeout_s}s",
        "failure_mode_allow": gateway.listener_fail_open,
        "allow_mode_override": allow_mode_override,
    }
    receiving = list(gateway.receiving)
    if forwarding or receiving:
        config["metadata_options"] = {
            **({"forwarding_namespaces": {"untyped": forwarding}} if forwarding else {}),
            **({"receiving_namespaces": {"untyped": receiving}} if receiving else {}),
        }
    return {"name": PICKER_FILTER, "typed_config": config}


def _destination_to_metadata() -> dict[str, Any]:
    """kgateway: the picked header copied into envoy.lb metadata (kept on the request)."""
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [{
                "header": DESTINATION,
                "on_header_present": {"metadata_namespace": LB_NAMESPACE, "key": DESTINATION, "type": "STRING"},
                "remove": False,
            }],
        },
    }


def _served_to_metadata() -> dict[str, Any]:
    """Test-only: the served-upstream response header (set by the route from %UPSTREAM_HOST%)
    becomes envoy.lb metadata before the picker's filter sees the response headers (encoding
    runs the filters in reverse), and is removed from what the client gets."""
    return {
        "name": "served-to-metadata",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "response_rules": [{
                "header": SERVED,
                "on_header_present": {"metadata_namespace": LB_NAMESPACE, "key": SERVED, "type": "STRING"},
                "remove": True,
            }],
        },
    }


def _subset_hint_filter(name: str, endpoints: Sequence[str]) -> dict[str, Any]:
    """Test-only: envoy.lb.subset_hint for requests routed by the matching test route (the
    filter is off unless the route turns it on)."""
    return {
        "name": f"subset-hint.{name}",
        "disabled": True,
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [{"metadata_namespace": SUBSET_NAMESPACE, "value": {SUBSET_KEY: list(endpoints)}}],
        },
    }
