"""The one Envoy configuration, rendered for the local stack and for Kubernetes.

Request path, in filter order:
  1. header_mutation strips client-sent routing headers (a client must never pick the upstream)
     and credentials (a client's key never reaches a replica);
  2. buffer: holds the request until its whole body is in (413 past max_request_bytes), so the
     next filter gets the headers and then the body in one piece;
  3. ext_proc "route" (blocking): the request headers with CEL attributes and, without waiting
     for their answer, the body -> one round trip: the service picks a replica and answers the
     headers: sets ``x-gateway-destination-endpoint`` (ordered fallbacks, comma-separated) and
     ``envoy.lb`` metadata, clears the route cache; then lets the body pass unchanged; nothing
     of the response is sent to it;
  4. ext_proc "observe" (``observability_mode``: Envoy never waits for it), for streamed
     (SSE) answers only: the response body, from whose last events the service reads
     llama.cpp's timings. The service marks such requests with ``x-llm-ring-observe`` and
     clears the route cache: the route that matches that header enables the filter, the
     others disable it (an ext_proc stream costs the service ~0.5 ms of CPU here);
  5. json_to_metadata "timings": a JSON answer's timings/usage numbers -> dynamic metadata;
  6. credential_injector "inject-replica-key", on the generation routes alone: ``authorization:
     Bearer <key>``, the key the replicas want, read by Envoy from a file (a secret of the
     bootstrap that names only the file's path), also while the service is down;
  7. router -> cluster ``replicas`` with the Override Host load-balancing policy: the first
     endpoint of the header, the next ones on retries, round robin when the header is absent
     (fail-open, ext_proc down).
Every request's outcome (status, the upstream that served it, reset flags, those timings)
reaches the service through Envoy's gRPC access log, batched on one long-lived stream, on the
service's abstract socket: the only place the service accepts it, so Envoy runs beside it.
The route adds ``x-routed-to``/``x-route-reason`` to the response from the request headers the
service set (``%REQ(..)%``), so the response needs no round trip to the service at all.

Here: the bootstrap, the listener and its connection manager (the filters in that order, Envoy's
own error answers, the access log); the filters in own_envoy_filters.py, the routes in
own_envoy_routes.py, the clusters in own_envoy_clusters.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.envoy.contract import (
    CLUSTER,
    DOWNSTREAM_IDLE_TIMEOUT_S,
    EXT_PROC_CLUSTER,
    EXT_PROC_MESSAGE_TIMEOUT_MS,
    QUEUE_WAIT_MARGIN_S,
    REQUEST_HEADERS_TIMEOUT_S,
    REQUEST_TIMEOUT_S,
    STREAM_IDLE_TIMEOUT_S,
    STREAMED_CLUSTER,
    Endpoints,
    EndpointsFile,
    connection_limit,
    socket_address,
    split_host_port,
)
from extproc.envoy.surface import SERVED_PATHS, error_document, error_type
from extproc.routing.flows import FlowSettings
from extproc.service.dataplanes.own_envoy_clusters import ext_proc_cluster, replicas_cluster
from extproc.service.dataplanes.own_envoy_filters import (
    WITH_REPLICA_KEY,
    cors_filter,
    ext_proc_filter,
    inject_replica_key,
    replica_key_secret,
    strip_client_routing_headers,
    timings_to_metadata,
    whole_body,
)
from extproc.service.dataplanes.own_envoy_routes import preflight_cluster, route_config

_T = "type.googleapis.com/"


def render_envoy_config(
    *,
    listen: str,
    admin: str,
    ext_proc: str | None,
    endpoints: Endpoints,
    fail_open: bool,
    max_request_bytes: int,
    retries: int,
    replica_key_file: str | None,
    ext_proc_timeout_ms: int = EXT_PROC_MESSAGE_TIMEOUT_MS,
    connect_timeout_ms: int = 1000,
    stream_idle_timeout_s: int = STREAM_IDLE_TIMEOUT_S,
    cors_origins: Sequence[str] = (),
    flow: FlowOptions | None = None,
) -> str:
    """Envoy bootstrap as JSON text (JSON is YAML: save it as envoy.yaml or envoy.json).

    listen/admin are "host:port"; ext_proc is "@name", the service's abstract unix socket
    (service.ext_proc_socket; see ext_proc_address), where ext_proc and the access log are served;
    ext_proc=None renders the same proxy without the routing service (the benchmark's baseline).
    fail_open: when the routing service is unreachable, serve round robin (True) or 500 (False).
    max_request_bytes: the service's service.max_body_bytes: larger bodies get 413 from Envoy.
    retries: the service's service.fallbacks: Envoy tries that many endpoints after the pick.
    replica_key_file: the file holding the replicas' API key (their --api-key-file), sent as
    ``authorization: Bearer <key>`` with every generation; None: no key (upstreams that want none).
    stream_idle_timeout_s: a request with no bytes either way for this long gets 504 (the tests
    shorten it to drill a replica that never answers; the service's lost-entry sweep assumes
    STREAM_IDLE_TIMEOUT_S).
    cors_origins: service.cors_origins, the browser origins allowed (none: no CORS filter).
    flow: flow control's wait ([flow], flow_options); None: off.
    """
    if ext_proc is not None and not ext_proc.startswith("@"):
        raise ValueError(f"ext_proc={ext_proc!r}: the service's abstract socket '@name' (service.ext_proc_socket), "
                         "the only place it serves the access log")
    admin_host, admin_port = split_host_port(admin)
    manager = _http_connection_manager(ext_proc is not None, fail_open, ext_proc_timeout_ms, retries,
                                       max_request_bytes, stream_idle_timeout_s, cors_origins,
                                       replica_key_file is not None, flow)
    config = {
        # File-based EDS needs a node identity.
        "node": {"id": "llm-ring-gateway", "cluster": "llm-ring"},
        "admin": {"address": socket_address(admin_host, admin_port)},
        "overload_manager": connection_limit(),
        "static_resources": {
            "listeners": [_gateway_listener(listen, max_request_bytes, manager)],
            "clusters": [
                replicas_cluster(name, endpoints, connect_timeout_ms, max_request_bytes)
                for name in (CLUSTER, STREAMED_CLUSTER)
            ]
            + ([ext_proc_cluster(ext_proc, connect_timeout_ms)] if ext_proc is not None else [])
            + ([preflight_cluster()] if cors_origins else []),
            **({"secrets": [replica_key_secret(replica_key_file)]} if replica_key_file is not None else {}),
        },
    }
    return json.dumps(config, indent=2) + "\n"


def _gateway_listener(listen: str, max_request_bytes: int, manager: dict[str, Any]) -> dict[str, Any]:
    host, port = split_host_port(listen)
    return {
        "name": "gateway",
        "address": socket_address(host, port),
        # The buffered body must fit: larger ones get Envoy's 413 (as JSON, below).
        "per_connection_buffer_limit_bytes": max_request_bytes,
        "filter_chains": [{"filters": [manager]}],
    }


@dataclass(frozen=True)
class FlowOptions:
    """Flow control behind our own Envoy: how long a request may wait in the router (the headers
    naming its flow reach the service in the request's header map, as any)."""

    ttl_seconds: float

    @property
    def max_wait_s(self) -> int:
        """What Envoy lets the service ask for (max_message_timeout), in whole seconds."""
        return math.ceil(self.ttl_seconds) + QUEUE_WAIT_MARGIN_S


def flow_options(flow: FlowSettings) -> FlowOptions | None:
    """[flow] as the renderer needs it; None when flow control is off."""
    return FlowOptions(flow.ttl_seconds) if flow.enabled else None


def _http_connection_manager(
    with_ext_proc: bool, fail_open: bool, timeout_ms: int, retries: int, max_request_bytes: int,
    stream_idle_timeout_s: int, cors_origins: Sequence[str], with_replica_key: bool, flow: FlowOptions | None,
) -> dict[str, Any]:
    ext_proc = [
        ext_proc_filter("route", fail_open, timeout_ms, observe=False,
                        max_wait_s=flow.max_wait_s if flow is not None else None),
        ext_proc_filter("observe", True, timeout_ms, observe=True),
    ]
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "gateway",
            "codec_type": "AUTO",
            "generate_request_id": True,
            # Long generations: no deadline once the request is in; idle streams end after 5 min
            # of silence. A slow or unfinished request is cut (see REQUEST_TIMEOUT_S).
            "request_headers_timeout": f"{REQUEST_HEADERS_TIMEOUT_S}s",
            # a request held in the router's queue is not sent upstream yet: the wait comes on top
            "request_timeout": f"{REQUEST_TIMEOUT_S + (flow.max_wait_s if flow is not None else 0)}s",
            # ... and silence while it waits is no idle stream
            "stream_idle_timeout": f"{max(stream_idle_timeout_s, flow.max_wait_s if flow is not None else 0)}s",
            "common_http_protocol_options": {"idle_timeout": f"{DOWNSTREAM_IDLE_TIMEOUT_S}s"},
            "route_config": route_config(retries, WITH_REPLICA_KEY if with_replica_key else {}, cors_origins),
            **({"access_log": [_access_log()]} if with_ext_proc else {}),
            "local_reply_config": _local_replies(max_request_bytes),
            "http_filters": [
                *([cors_filter()] if cors_origins else []),
                strip_client_routing_headers(),
                *([whole_body(max_request_bytes), *ext_proc] if with_ext_proc else []),
                *([timings_to_metadata()] if with_ext_proc else []),
                *([inject_replica_key()] if with_replica_key else []),
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {"@type": _T + "envoy.extensions.filters.http.router.v3.Router"},
                },
            ],
        },
    }


def _local_replies(max_request_bytes: int) -> dict[str, Any]:
    """Envoy's own error answers in OpenAI's shape, as the service's are: its 413 (body over the
    buffer limit) with our message; any other (no healthy upstream, a reset, a timeout) with its
    own text and response code details. Ours (direct responses, the service's immediate
    answers: details "llm_ring_*") are in that shape already and left alone. A CONNECT, which
    Envoy refuses before any route with an empty 403, gets the 405 and message of a method not
    allowed."""
    def mapper(expression: str, document: dict[str, Any], status: int | None = None) -> dict[str, Any]:
        cel = {"@type": _T + "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
               "expression": expression}
        return {"filter": {"extension_filter": {"name": "envoy.access_loggers.extension_filters.cel",
                                                "typed_config": cel}},
                **({"status_code": status} if status else {}),
                "body_format_override": {"json_format": document}}

    too_large = error_document(413, f"request body over {max_request_bytes} bytes (service.max_body_bytes)",
                               "request_too_large")
    connect = error_document(405, f"method CONNECT not allowed: the gateway serves {SERVED_PATHS}",
                             "method_not_allowed")
    envoy_own = "response.code_details != 'direct_response' && !response.code_details.startsWith('llm_ring_')"
    return {"mappers": [
        mapper("response.code == 413 && response.code_details == 'request_payload_too_large'", too_large),
        mapper("response.code_details == 'upgrade_failed'", connect, 405),
        *(mapper(f"response.code {bounds} && {envoy_own}",
                 {"error": {"message": "%LOCAL_REPLY_BODY%", "type": error_type(status), "param": None,
                            "code": "%RESPONSE_CODE_DETAILS%"}})
          for bounds, status in ((">= 500", 500), (">= 400 && response.code < 500", 400))),
    ]}


def _access_log() -> dict[str, Any]:
    """Each request's outcome to the service over gRPC, batched (one message carries many
    entries) on one long-lived stream: cheaper than an ext_proc stream per response."""
    return {
        "name": "envoy.access_loggers.http_grpc",
        "typed_config": {
            "@type": _T + "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": "llm-ring",
                "grpc_service": {"envoy_grpc": {"cluster_name": EXT_PROC_CLUSTER}},
                "transport_api_version": "V3",
                "buffer_flush_interval": "0.02s",
                "buffer_size_bytes": 16384,
            },
        },
    }


EXAMPLE_ARGUMENTS: dict[str, Any] = {
    "listen": "127.0.0.1:19000",
    "admin": "127.0.0.1:19001",
    "ext_proc": "@llm-ring-ext-proc",
    "endpoints": EndpointsFile(".llm-ring/envoy/replicas.json"),
    "fail_open": True,
    "max_request_bytes": 4194304,
    "retries": 2,
    "replica_key_file": ".llm-ring/replica-api-key",
}


def example() -> str:
    """envoy/envoy.example.yaml: the rendering for router.toml's addresses, for reading."""
    header = "# GENERATED by `python -m extproc.service.dataplanes.own_envoy_config`: do not edit.\n"
    return header + render_envoy_config(**EXAMPLE_ARGUMENTS)


if __name__ == "__main__":
    Path(__file__).parents[3].joinpath("envoy", "envoy.example.yaml").write_text(example())
