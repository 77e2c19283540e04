"""The front of several gateways: the local stack's stand-in for a Kubernetes Service, one TCP
listener in front of the gateway Envoys (render_front_config)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from extproc.envoy.contract import connection_limit, socket_address, split_host_port

_T = "type.googleapis.com/"

FRONT_CLUSTER = "gateways"
FRONT_HEALTH_INTERVAL_MS = 500  # a dead gateway is marked unhealthy within about this long
# A refused connection is tried again this many times in all, after a pause growing from 20 ms to
# 200 ms: each try draws a gateway at random again (a TCP proxy cannot exclude the one that refused),
# and the refusing gateway's ejection reaches the draws only later. Measured with one of two
# gateways killed, 12 new connections at once, 40 times: 3 tries without pauses lost 62 of 480
# connections (reset), 10 tries with the pauses none (scripts/measure-front-retries).
FRONT_CONNECT_ATTEMPTS = 10
FRONT_RETRY_PAUSE = {"base_interval": "0.02s", "max_interval": "0.2s"}


def render_front_config(*, listen: str, admin: str, gateways: Sequence[tuple[str, str]],
                        connect_timeout_ms: int = 1000) -> str:
    """The front of several gateways (the local stack's stand-in for a Kubernetes Service):
    one TCP listener that hands each new connection to a gateway Envoy drawn at random,
    without reading the HTTP inside (connection-level, as kube-proxy does).

    gateways: (listener "host:port", admin "host:port") of each gateway Envoy. A connection
    that cannot be made is tried again on a gateway drawn anew, after a growing pause
    (FRONT_CONNECT_ATTEMPTS), and ejects the one that refused it (outlier detection,
    local-origin failures); an active health
    check of each gateway's admin /ready keeps a dead one out and lets it back within one
    interval of its return. Panic routing is off: with one gateway of two down, every
    connection goes to the live one (Envoy's default would spread over all below 50 %).
    """
    listen_host, listen_port = split_host_port(listen)
    admin_host, admin_port = split_host_port(admin)
    config = {
        "node": {"id": "llm-ring-front", "cluster": "llm-ring"},
        "admin": {"address": socket_address(admin_host, admin_port)},
        "overload_manager": connection_limit(),
        "static_resources": {
            "listeners": [{
                "name": "front",
                "address": socket_address(listen_host, listen_port),
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.tcp_proxy",
                    "typed_config": {
                        "@type": _T + "envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                        "stat_prefix": "front",
                        "cluster": FRONT_CLUSTER,
                        "max_connect_attempts": max(FRONT_CONNECT_ATTEMPTS, len(gateways) + 1),
                        "backoff_options": FRONT_RETRY_PAUSE,
                    },
                }]}],
            }],
            "clusters": [_front_cluster(gateways, connect_timeout_ms)],
        },
    }
    return json.dumps(config, indent=2) + "\n"


def _front_cluster(gateways: Sequence[tuple[str, str]], connect_timeout_ms: int) -> dict[str, Any]:
    """The gateways, drawn at random, health-checked on their admin /ready and ejected on a refusal."""
    interval = f"{FRONT_HEALTH_INTERVAL_MS / 1000:g}s"
    endpoints = []
    for gateway_listen, gateway_admin in gateways:
        host, port = split_host_port(gateway_listen)
        endpoints.append({"endpoint": {
            "address": socket_address(host, port),
            "health_check_config": {"port_value": split_host_port(gateway_admin)[1]},
        }})
    return {
        "name": FRONT_CLUSTER,
        "type": "STATIC",
        "connect_timeout": f"{connect_timeout_ms / 1000:g}s",
        "lb_policy": "RANDOM",
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "load_assignment": {"cluster_name": FRONT_CLUSTER, "endpoints": [{"lb_endpoints": endpoints}]},
        "health_checks": [{
            "timeout": "1s", "interval": interval, "no_traffic_interval": interval,
            "unhealthy_threshold": 1, "healthy_threshold": 1,
            "http_health_check": {"path": "/ready"},
        }],
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100,
            "interval": interval,
            "base_ejection_time": "5s",
            "max_ejection_percent": 100,
        },
    }
