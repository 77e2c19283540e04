"""The Envoy data planes that InferencePool gateways generate, rendered as static bootstraps.

An InferencePool gateway (Gateway API Inference Extension) puts an ext_proc filter in front
of an ``ORIGINAL_DST`` cluster: the Endpoint Picker (here `llm-ring serve`) answers the
request headers with ``x-gateway-destination-endpoint: host:port`` and Envoy connects to
exactly that address. Each variant below follows one gateway's own code, named with its
repository, files and commit; only the addresses (the picker's Service DNS name, the pool's
pods) are replaced by loopback ones so the same configuration runs here, under test.

What no variant's gateway does and this renderer adds for safety: a client-sent
``x-gateway-destination-endpoint`` is removed before the picker runs. Neither gateway strips
it (their sources have no such filter): the picker overwrites it on every answer it gives, but
an ``ORIGINAL_DST`` cluster reading the header would send a request whose picker let it pass
unanswered (kgateway's listener-level filter fails open) to any address the client named.

Test-only extras, all off by default (none of them is in any gateway's configuration):
  - ``subset_hints``: named subset hints; a request carrying ``x-llm-ring-test-subset: NAME``
    gets ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset`` (a list of
    endpoints) in its dynamic metadata, forwarded to the picker (set_metadata, no Lua);
  - ``report_served``: the upstream that served the request, as
    ``x-gateway-destination-endpoint-served`` in ``envoy.lb`` metadata forwarded to the
    picker with the response headers (what the protocol lets a data plane report);
  - ``show_upstream``: the upstream address as the ``x-upstream-host`` response header, so a
    test knows which replica answered.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from extproc.envoy.contract import DESTINATION, SERVED, socket_address, split_host_port

_T = "type.googleapis.com/"
BodyMode = Literal["duplex", "buffered"]
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = f"{DESTINATION}-subset"
TEST_SUBSET_HEADER = "x-llm-ring-test-subset"
UPSTREAM_HEADER = "x-upstream-host"
PICKER_CLUSTER = "endpoint-picker"
POOL_CLUSTER = "inference-pool"
PICKER_FILTER = "envoy.filters.http.ext_proc/endpoint-picker"
_HCM = _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_BODY_MODES = {"duplex": "FULL_DUPLEX_STREAMED", "buffered": "BUFFERED"}


@dataclass(frozen=True)
class InferenceGateway:
    """What one gateway configures for an InferencePool (the fields where the variants differ)."""

    name: str
    source: str  # repository@commit: files followed
    body_modes: tuple[BodyMode, ...]  # what the gateway can generate; the first is its default
    message_timeout_s: int
    listener_grpc_timeout_s: int | None  # the picker call's gRPC deadline (None: none)
    listener_fail_open: bool  # the listener-level filter's failure_mode_allow
    # the pool route's ExtProcPerRoute overrides: failure_mode_allow (None: no override at all),
    # the gRPC deadline there, and whether the processing mode is set there (the listener
    # filter then sends the headers of no other route)
    route_fail_open: bool | None
    route_grpc_timeout_s: int | None
    route_processing_mode: bool
    forwarding: tuple[str, ...]  # metadata namespaces sent to the picker
    receiving: tuple[str, ...]  # metadata namespaces accepted from the picker
    destination_to_metadata: bool  # copies the picked header into envoy.lb metadata
    route_timeout_s: int | None  # None: not set (Envoy's default, 15 s); 0: none
    route_retries: int  # Istio's default retry policy (0: no retry policy)
    # the pool: ORIGINAL_DST reading the header, or the pool's endpoints with override_host
    # reading envoy.lb metadata and recording the host it chose (Istio)
    pool: Literal["original_dst", "override_host"]
    pool_connect_timeout_s: int
    pool_circuit_breaker: int | None  # max connections/pending/requests (None: Envoy's defaults)
    route_subset_match: bool  # the pool's endpoints as the route's envoy.lb.subset_hint metadata_match


AI_GATEWAY = InferenceGateway(
    name="envoy-ai-gateway",
    source=(
        "envoyproxy/ai-gateway@c217da8a539570ba3f6014a60c2687c29a945f1f: "
        "internal/extensionserver/inferencepool.go (buildHTTPFilterForInferencePool, "
        "buildExtProcClusterForInferencePoolEndpointPicker), post_cluster_modify.go "
        "(handleInferencePoolCluster), post_route_modify.go, post_translate_modify.go "
        "(patchListenerWithInferencePoolFilters: the filter goes right before the router), "
        "api/v1beta1/ai_gateway_route_helper.go (defaultRequestTimeout 60s)"
    ),
    # aigateway.envoyproxy.io/processing-body-mode: "duplex" (default) or "buffered"
    body_modes=("duplex", "buffered"),
    message_timeout_s=300,
    listener_grpc_timeout_s=None,
    listener_fail_open=False,
    route_fail_open=None,
    route_grpc_timeout_s=None,
    route_processing_mode=False,
    forwarding=(),  # no metadata_options: nothing forwarded, nothing received
    receiving=(),
    destination_to_metadata=False,
    route_timeout_s=60,
    route_retries=0,
    pool="original_dst",
    pool_connect_timeout_s=10,
    pool_circuit_breaker=None,
    route_subset_match=False,
)

KGATEWAY = InferenceGateway(
    name="kgateway",
    source=(
        "kgateway-dev/kgateway@8134a619c599b6f693b3dda8000a380fad993a89: "
        "internal/kgateway/extensions2/plugins/inferenceextension/endpointpicker/plugin.go "
        "(inference.networking.k8s.io/v1; HttpFilters, ApplyForBackend, buildExtProcCluster; "
        "the ORIGINAL_DST cluster: processPoolBackendObjIR)"
    ),
    body_modes=("duplex",),
    message_timeout_s=5,
    listener_grpc_timeout_s=None,
    # the listener-level filter fails open so unmatched routes still 404; the pool's route
    # overrides it with the pool's failure mode (FailClose unless the pool says FailOpen)
    listener_fail_open=True,
    route_fail_open=False,
    route_grpc_timeout_s=10,
    route_processing_mode=False,
    forwarding=(SUBSET_NAMESPACE,),
    receiving=(LB_NAMESPACE,),
    destination_to_metadata=True,  # header_to_metadata, before the router
    route_timeout_s=None,
    route_retries=0,
    pool="original_dst",
    pool_connect_timeout_s=1000,
    pool_circuit_breaker=40000,
    route_subset_match=True,
)

ISTIO = InferenceGateway(
    name="istio",
    source=(
        "istio/istio@86c9f01fd735fb01d8192f5bcaf0d424afb7f14c: pilot/pkg/xds/filters/filters.go "
        "(InferencePoolExtProc), pilot/pkg/networking/core/route/route.go (the pool route's "
        "ExtProcPerRoute; setTimeout: no route timeout), route/retry/retry.go (DefaultPolicy), "
        "pilot/pkg/networking/core/cluster_builder.go (applyOverrideHostPolicy)"
    ),
    body_modes=("duplex",),
    message_timeout_s=1000,
    listener_grpc_timeout_s=10,
    listener_fail_open=True,
    route_fail_open=False,  # the pool's failure mode: FailClose unless it says FailOpen
    route_grpc_timeout_s=None,
    route_processing_mode=True,  # the listener filter skips the headers; the pool route sends all
    forwarding=(LB_NAMESPACE,),
    receiving=(LB_NAMESPACE,),
    destination_to_metadata=False,
    route_timeout_s=0,
    route_retries=2,
    pool="override_host",
    pool_connect_timeout_s=10,  # the mesh default connectTimeout
    pool_circuit_breaker=None,
    route_subset_match=False,
)

GATEWAYS = {gateway.name: gateway for gateway in (AI_GATEWAY, KGATEWAY, ISTIO)}


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
                        "route_config": _route_config(gateway, mode, pool_endpoints, hints, report_served,
                                                      show_upstream),
                        "http_filters": http_filters,
                    },
                }]}],
            }],
            "clusters": [_pool_cluster(gateway, pool_endpoints), _picker_cluster(picker)],
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
        "grpc_service": _picker_service(gateway.listener_grpc_timeout_s),
        "processing_mode": (
            {"request_header_mode": "SKIP", "response_header_mode": "SKIP"} if gateway.route_processing_mode
            else _every_phase(mode)
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


def _every_phase(mode: BodyMode) -> dict[str, str]:
    body = _BODY_MODES[mode]
    return {
        "request_header_mode": "SEND", "request_body_mode": body, "request_trailer_mode": "SEND",
        "response_header_mode": "SEND", "response_body_mode": body, "response_trailer_mode": "SEND",
    }


def _picker_service(timeout_s: int | None) -> dict[str, Any]:
    return {
        "envoy_grpc": {"cluster_name": PICKER_CLUSTER, "authority": "endpoint-picker.llm-ring.svc"},
        **({"timeout": f"{timeout_s}s"} if timeout_s else {}),
    }


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


def _route_config(
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
            "grpc_service": _picker_service(gateway.route_grpc_timeout_s),
            **({"processing_mode": _every_phase(mode)} if gateway.route_processing_mode else {}),
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


def _pool_cluster(gateway: InferenceGateway, pool_endpoints: Sequence[str]) -> dict[str, Any]:
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


def _picker_cluster(picker: str) -> dict[str, Any]:
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
