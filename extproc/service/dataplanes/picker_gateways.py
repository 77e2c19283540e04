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

Here: each gateway's settings (``InferenceGateway``, with the files followed);
picker_gateway_config.py renders its bootstrap and filters, picker_gateway_upstreams.py the
pool's route and the clusters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from extproc.envoy.contract import DESTINATION

BodyMode = Literal["duplex", "buffered"]
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = f"{DESTINATION}-subset"
TEST_SUBSET_HEADER = "x-llm-ring-test-subset"
UPSTREAM_HEADER = "x-upstream-host"
PICKER_CLUSTER = "endpoint-picker"
POOL_CLUSTER = "inference-pool"
PICKER_FILTER = "envoy.filters.http.ext_proc/endpoint-picker"


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
