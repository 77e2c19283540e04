"""What the routing service and Envoy agree on: header names, metadata keys, the CEL
attributes sent, timeouts, and the replica endpoints (a file Envoy watches, or DNS).

The service (extproc.service) reads and sets these; the renderers (extproc/service/dataplanes/)
wire Envoy to them. Changing one here changes both sides.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.files import write_atomically

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
# The Endpoint Picker protocol (gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol):
# the pick's metadata namespace and the fallback key in it (site-src/guides/implementers.md), and where a
# gateway may name the subset of endpoints the picker must choose from.
LB_NAMESPACE = "envoy.lb"
DESTINATION_FALLBACK = "x-gateway-destination-endpoint-fallback"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
ROUTED_TO = "x-routed-to"
ROUTE_REASON = "x-route-reason"
PREDICTED_CACHED = "x-route-predicted-cached-tokens"  # the router's guess, compared with cache_n
QUEUE_WAIT = "x-route-queue-wait-ms"  # flow control: how long the request waited in the router
# flow control's refusals (429, 503) say why, as llm-d's x-llm-d-request-dropped-reason does
DROPPED_REASON = "x-llm-ring-dropped-reason"
REQUEST_ID = "x-request-id"
OBSERVE = "x-llm-ring-observe"  # set by the service on streamed requests: observe the answer
# Where llama.cpp reads its API key from (--api-key-file; x-api-key when authorization is
# absent): the gateway removes both from client requests and sets authorization on the ones
# it routes, "Bearer <key>" (docs/security.md#the-replicas-api-key).
REPLICA_KEY_HEADER = "authorization"
CLIENT_KEY_HEADERS = (REPLICA_KEY_HEADER, "x-api-key")
CLUSTER = "replicas"  # whole JSON answers: keep-alive connections
STREAMED_CLUSTER = "replicas-streamed"  # the same replicas, one connection per streamed answer
EXT_PROC_CLUSTER = "ext_proc"
METADATA_NAMESPACE = "llm-ring"  # where the timings of a JSON answer land (json_to_metadata)
# Envoy ends a request that shows no activity (bytes either way) for this long; the service
# takes a request whose access log entry is this late twice over as lost (service/lifecycle.py: release_lost).
STREAM_IDLE_TIMEOUT_S = 300
# Connections to a replica idle this long are closed by Envoy: below the 5 s after which
# llama.cpp's HTTP server (cpp-httplib, CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND) closes them
# itself. Without it Envoy may reuse a connection the replica is closing: 503 "upstream
# connection termination" (measured: 1 request in 60 after 5.0 s idle gaps, none at 4.5 s).
UPSTREAM_IDLE_TIMEOUT_S = 4
# Envoy waits this long for each answer of the ext_proc service before it fails open (or 500).
# A request waiting in the router's queue (flow control) asks for longer, up to the TTL and
# this margin (the service's override_message_timeout, allowed up to max_message_timeout).
EXT_PROC_MESSAGE_TIMEOUT_MS = 2000
QUEUE_WAIT_MARGIN_S = 2
# A client has this long to send its request headers, and this long for the whole request
# (the body is buffered before the pick: an upload held open holds a buffer of up to
# max_request_bytes). The timer stops once the request is sent upstream: generations,
# however long, are not cut (stream_idle_timeout covers a silent one).
REQUEST_HEADERS_TIMEOUT_S = 10
REQUEST_TIMEOUT_S = 30
# A client connection with no request in flight is closed after this long (Envoy's default: 1 h).
DOWNSTREAM_IDLE_TIMEOUT_S = 60
# Open client connections, all listeners together (Envoy's overload manager): past it Envoy
# accepts no more, so held connections cannot exhaust its memory or file descriptors.
MAX_DOWNSTREAM_CONNECTIONS = 8192


@dataclass(frozen=True)
class EndpointsFile:
    """Replica endpoints from a file Envoy watches (local stack); see write_endpoints_file."""

    path: str


@dataclass(frozen=True)
class DnsEndpoints:
    """Replica endpoints from DNS, e.g. a headless Service "llm.llm-ring.svc.cluster.local:8080"."""

    address: str


Endpoints = EndpointsFile | DnsEndpoints

# What Envoy copies from a JSON answer into dynamic metadata (METADATA_NAMESPACE) for the
# access log (its json_to_metadata filter): metadata key -> path in the body. The service reads
# them back as timings (extproc.service.bodies.timings_from_metadata).
RESPONSE_METADATA: dict[str, tuple[str, ...]] = {
    **{name: ("timings", name) for name in ("cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms")},
    "cached_tokens": ("usage", "prompt_tokens_details", "cached_tokens"),
    "prompt_tokens": ("usage", "prompt_tokens"),
    "completion_tokens": ("usage", "completion_tokens"),
}

# What the service reads, sent as CEL attributes with the first message of each side. The
# session headers (service.session_ids) are read from the request's header map, which Envoy
# sends whole: a change of that setting needs no new Envoy config.
REQUEST_ATTRIBUTES = (
    "request.url_path",
    "request.id",
    "request.headers['content-type']",
    "request.headers['x-turn']",
)
RESPONSE_ATTRIBUTES = ("request.id", "response.code", "upstream.address")


def ext_proc_address(socket: str) -> str:
    """Where our own Envoy reaches the service: its abstract unix socket ("@name",
    service.ext_proc_socket), the one place that serves the access log (never the picker port)."""
    if not socket:
        raise ValueError("service.ext_proc_socket is empty: our own Envoy reaches ext_proc and the access log "
                         "service there alone")
    return f"@{socket}"


def write_endpoints_file(path: str | Path, replicas: Mapping[str, str]) -> None:
    """Write the replica set as an EDS file Envoy picks up (atomically: a reader never sees
    half of it; readable by all: Envoy may run as another user, e.g. in Kubernetes)."""
    path = Path(path)
    lb_endpoints = []
    for name in sorted(replicas):
        host, port = split_host_port(replicas[name])
        lb_endpoints.append(
            {
                "endpoint": {"address": socket_address(host, port), "hostname": name},
                "metadata": {"filter_metadata": {"llm-ring": {"replica": name}}},
            }
        )
    document = {
        "version_info": str(len(lb_endpoints)),
        "resources": [
            {
                "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
                "cluster_name": CLUSTER,
                "endpoints": [{"lb_endpoints": lb_endpoints}],
            }
        ],
    }
    write_atomically(path, json.dumps(document), mode=0o644)


def split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


def socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def connection_limit() -> dict[str, Any]:
    """The overload manager of every Envoy we render: MAX_DOWNSTREAM_CONNECTIONS at most."""
    return {
        "resource_monitors": [
            {
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": {
                    "@type": "type.googleapis.com/"
                    + "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                    "max_active_downstream_connections": MAX_DOWNSTREAM_CONNECTIONS,
                },
            }
        ]
    }
