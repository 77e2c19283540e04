"""Several gateways on the local stack: what each one is, where it listens, and the
redis-server that will hold their shared state.

With one gateway the stack is as it always was: its Envoy listens on [ports] gateway, its
routing service on [ports] router. With N > 1 there are N gateway pairs (Envoy + routing
service), gateway i on [ports] gateway_base + 4i .. + 4i + 3, behind one front Envoy on
[ports] gateway that hands each new connection to a gateway at random (connection level,
as a Kubernetes Service does; extproc.envoy.front.render_front_config), plus one
redis-server on [ports] store whose URL every routing service gets as [store] url.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.stack.ports import HOST, PORTS_PER_GATEWAY, port_of
from extproc.stack.redis_server import user_url

FRONT = "front"
STORE = "store"


@dataclass
class GatewayState:
    """One gateway pair as state.json holds it."""

    name: str  # gw-0, gw-1, ...
    router_name: str  # process names: "router"/"envoy" with one gateway, "router-i"/"envoy-i" with several
    envoy_name: str
    files: str  # folder of its router.toml and envoy/ (the run dir itself with one gateway)
    listen: str  # its Envoy's listener, host:port
    envoy_admin: str
    router_address: str  # gRPC: the Admin API + health (Envoy reaches ext_proc on its abstract socket)
    metrics_url: str
    router: dict[str, Any] = field(default_factory=dict)  # a daemons.Daemon
    envoy: dict[str, Any] = field(default_factory=dict)

    @property
    def router_settings(self) -> Path:
        return Path(self.files) / "router.toml"

    @property
    def envoy_dir(self) -> Path:
        return Path(self.files) / "envoy"


def layout(count: int, run: Path, single: tuple[int, int, int, int], base: int,
           spare: list[int]) -> list[GatewayState]:
    """The gateways of a stack: with count 1 the ports in `single` (gateway, envoy_admin,
    router, metrics) and the run dir's own files; else gateway i on base + 4i + 0..3 (free
    ports from `spare` when base is 0), its files in <run>/gw-i."""
    if count == 1:
        listen, admin, router, metrics = single
        return [_gateway("gw-0", "router", "envoy", run, (listen, admin, router, metrics))]
    gateways = []
    for i in range(count):
        ports = tuple(base + PORTS_PER_GATEWAY * i + k if base else spare.pop() for k in range(PORTS_PER_GATEWAY))
        gateways.append(_gateway(f"gw-{i}", f"router-{i}", f"envoy-{i}", run / f"gw-{i}", ports))
    return gateways


def _gateway(name: str, router: str, envoy: str, files: Path, ports: tuple[int, ...]) -> GatewayState:
    listen, admin, grpc, metrics = ports
    return GatewayState(name=name, router_name=router, envoy_name=envoy, files=str(files),
                        listen=f"{HOST}:{listen}", envoy_admin=f"{HOST}:{admin}", router_address=f"{HOST}:{grpc}",
                        metrics_url=f"http://{HOST}:{metrics}/metrics")


def port_purposes(gateways: list[GatewayState]) -> list[tuple[int, str]]:
    """Every port of the gateways, with what it is for (the stack's port check names it)."""
    several = len(gateways) > 1
    purposes = []
    for gw in gateways:
        of = f" of {gw.name}" if several else ""
        purposes += [
            (port_of(gw.listen), f"the gateway (Envoy listener){of}"), (port_of(gw.envoy_admin), f"Envoy admin{of}"),
            (port_of(gw.router_address), f"the routing service (gRPC){of}"),
            (port_of(gw.metrics_url), f"the router's metrics{of}"),
        ]
    return purposes


# ---- the store: one redis-server, nothing kept on disk ---------------------------------

def store_url(port: int) -> str:
    """As the routers connect: the ACL user of redis_server.py (its password in a file)."""
    return user_url(f"{HOST}:{port}")
