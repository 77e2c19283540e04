"""Our own Envoy's routes (own_envoy_config.py renders the rest): the gateway's surface
(extproc/envoy/surface.py) and nothing more, the CORS preflights when origins are allowed, and
the answers Envoy gives itself, without reading the body or asking the service."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from extproc.envoy.contract import (
    CLUSTER,
    OBSERVE,
    PREDICTED_CACHED,
    QUEUE_WAIT,
    REQUEST_ID,
    ROUTE_REASON,
    ROUTED_TO,
    SERVED,
    STREAMED_CLUSTER,
)
from extproc.envoy.cors import ALLOWED_HEADERS, EXPOSED_HEADERS, MAX_AGE_S, REPLICA_CORS_HEADERS
from extproc.envoy.surface import (
    CORS_METHODS,
    GENERATION_PATHS,
    HEALTH_PATHS,
    MODEL_PREFIX,
    MODELS_PATHS,
    SERVED_PATHS,
    error_document,
)

_T = "type.googleapis.com/"


def route_config(retries: int, replica_key: dict[str, Any], cors_origins: Sequence[str] = ()) -> dict[str, Any]:
    """The gateway's surface (surface.py), nothing more: POST on a generation path -> the replicas
    (the service's pick; round robin when the service is down and fail_open is set; a trailing
    slash dropped on the way; replica_key: the per-filter config that adds the replicas' key, {}
    for none), the answer observed only when the service asked for it; GET on a read-only path ->
    the service, which answers it itself; another method there -> 405; any other path -> 404. A
    CORS policy on the virtual host when cors_origins is set; the replicas' own CORS headers never
    reach the client."""
    post = {"name": ":method", "string_match": {"exact": "POST"}}
    get = {"name": ":method", "string_match": {"exact": "GET"}}
    observe = {"name": OBSERVE, "present_match": True}
    no_observer = {"ext_proc.observe": {"@type": _EXT_PROC_PER_ROUTE, "disabled": True}}
    # CONNECT (a tunnel; its body never ends) is refused at once: without this route the
    # buffer filter would wait for the end of that body (measured: no answer in 10 s).
    routes: list[dict[str, Any]] = [_local_reply({"connect_matcher": {}}, 405, "method CONNECT not allowed",
                                                 "method_not_allowed")]
    for path in GENERATION_PATHS:
        # the path, or with one trailing slash, which the replica does not serve: dropped on the way
        match = {"safe_regex": {"regex": f"^{re.escape(path)}/?$"}}
        for headers, per_filter, cluster in (([post, observe], {}, STREAMED_CLUSTER), ([post], no_observer, CLUSTER)):
            routes.append(
                {
                    "match": {**match, "headers": headers},
                    "route": {**_to_replicas(cluster, retries), "regex_rewrite": TRAILING_SLASH},
                    "request_headers_to_remove": [OBSERVE],
                    "response_headers_to_add": _response_headers(),
                    "response_headers_to_remove": list(REPLICA_CORS_HEADERS),  # the replica's: cors_origins decides
                    **({"typed_per_filter_config": per_filter | replica_key} if per_filter | replica_key else {}),
                }
            )
        routes += _preflight(match, cors_origins)
        routes.append(_not_allowed(path, "POST", match))
    read_only = [("path", path) for path in (*MODELS_PATHS, *HEALTH_PATHS)] + [("prefix", MODEL_PREFIX)]
    for kind, path in read_only:
        routes.append({"match": {kind: path, "headers": [get]}, "route": _to_replicas(CLUSTER, retries),
                       "response_headers_to_remove": list(REPLICA_CORS_HEADERS),
                       "typed_per_filter_config": no_observer | replica_key})
        routes += _preflight({kind: path}, cors_origins)
        routes.append(_not_allowed(path, "GET", {kind: path}))
    unknown = f"unknown path: the gateway serves {SERVED_PATHS}"
    routes.append(_local_reply({"prefix": "/"}, 404, unknown, "unknown_path"))
    host: dict[str, Any] = {"name": "llm", "domains": ["*"], "routes": routes}
    if cors_origins:
        host["typed_per_filter_config"] = {"envoy.filters.http.cors": _cors_policy(cors_origins)}
    return {"name": "llm", "virtual_hosts": [host]}


def _not_allowed(path: str, method: str, match: dict[str, Any]) -> dict[str, Any]:
    reply = _local_reply(match, 405, f"method not allowed on {path}: it takes {method}",
                         "method_not_allowed")
    reply["response_headers_to_add"].append({"header": {"key": "allow", "value": f"{method}, OPTIONS"}})
    return reply


def _preflight(match: dict[str, Any], origins: Sequence[str]) -> list[dict[str, Any]]:
    """A CORS preflight from an allowed origin on a served path, which the CORS filter answers
    itself: a route with a route action (the filter skips direct responses), to a cluster with no
    endpoint, so that nothing could ever reach a replica. Other preflights get the 405."""
    if not origins:
        return []
    allowed = ".*" if "*" in origins else "|".join(re.escape(origin) for origin in origins)
    headers = [{"name": ":method", "string_match": {"exact": "OPTIONS"}},
               {"name": "origin", "string_match": {"safe_regex": {"regex": f"^({allowed})$"}}},
               {"name": "access-control-request-method", "present_match": True}]
    return [{"match": {**match, "headers": headers}, "route": {"cluster": PREFLIGHT_CLUSTER},
             "typed_per_filter_config": _UNREAD}]


def preflight_cluster() -> dict[str, Any]:
    return {"name": PREFLIGHT_CLUSTER, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": PREFLIGHT_CLUSTER, "endpoints": []}}


def _cors_policy(origins: Sequence[str]) -> dict[str, Any]:
    """Envoy's CORS filter answers preflights and adds the headers, as CorsPolicy (cors.py) does."""
    allowed = [{"safe_regex": {"regex": ".*"}} if origin == "*" else {"exact": origin} for origin in origins]
    return {
        "@type": _T + "envoy.extensions.filters.http.cors.v3.CorsPolicy",
        "allow_origin_string_match": allowed,
        "allow_methods": CORS_METHODS,
        "allow_headers": ALLOWED_HEADERS,
        "expose_headers": EXPOSED_HEADERS,
        "max_age": str(MAX_AGE_S),
        "forward_not_matching_preflights": False,  # answered here, never by a replica (_preflight)
    }


def _to_replicas(cluster: str, retries: int) -> dict[str, Any]:
    return {
        "cluster": cluster,
        "timeout": "0s",
        "retry_policy": {
            # Only where the replica never answered: the connection failed or was refused, or was
            # reset before any response byte (e.g. a keep-alive connection the replica closed
            # as the request went out, or a replica that died before answering). A started
            # answer is never retried, so a client never gets two generations.
            "retry_on": "connect-failure,refused-stream,reset-before-request,reset,retriable-status-codes",
            "retriable_status_codes": [503],
            "num_retries": retries,
            "per_try_timeout": "0s",
        },
    }


def _response_headers() -> list[dict[str, Any]]:
    def add(name: str, value: str) -> dict[str, Any]:
        return {"header": {"key": name, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}

    return [
        add(ROUTED_TO, f"%REQ({ROUTED_TO})%"),
        add(ROUTE_REASON, f"%REQ({ROUTE_REASON})%"),
        add(PREDICTED_CACHED, f"%REQ({PREDICTED_CACHED})%"),
        add(QUEUE_WAIT, f"%REQ({QUEUE_WAIT})%"),
        add(SERVED, "%UPSTREAM_HOST%"),
        add(REQUEST_ID, f"%REQ({REQUEST_ID})%"),
    ]


TRAILING_SLASH = {"pattern": {"regex": "/$"}, "substitution": ""}
_EXT_PROC_PER_ROUTE = _T + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
PREFLIGHT_CLUSTER = "cors-preflights"  # no endpoint: the CORS filter answers the preflights routed there
# a route answered by Envoy itself: the body is not buffered, the service not asked
_UNREAD = {"ext_proc.route": {"@type": _EXT_PROC_PER_ROUTE, "disabled": True},
           "ext_proc.observe": {"@type": _EXT_PROC_PER_ROUTE, "disabled": True},
           "whole-body": {"@type": _T + "envoy.extensions.filters.http.buffer.v3.BufferPerRoute", "disabled": True}}


def _local_reply(match: dict[str, Any], status: int, message: str, code: str) -> dict[str, Any]:
    """Answered by Envoy without reading the body (no buffering) nor asking the service, as an
    error in OpenAI's shape."""
    return {
        "match": match,
        "direct_response": {"status": status,
                            "body": {"inline_string": json.dumps(error_document(status, message, code))}},
        "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"}}],
        "typed_per_filter_config": _UNREAD,
    }
