"""The local stack's Envoys: each gateway's, and the front before several gateways."""

from __future__ import annotations

import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from extproc.stack.daemons import Daemon, http_ok, spawn, wait_for, wait_until
from extproc.stack.errors import Progress
from extproc.stack.gateways import FRONT, GatewayState
from extproc.stack.processes import envoy_binary
from extproc.stack.state import StackRun

if TYPE_CHECKING:
    from extproc.stack.state import StackState


def start_envoy(stack: StackRun, gw: GatewayState, progress: Progress) -> None:
    from extproc.envoy.contract import EndpointsFile, ext_proc_address
    from extproc.service.dataplanes.own_envoy_config import flow_options, render_envoy_config
    from extproc.settings import load_settings
    from extproc.stack.replicas import api_key_file

    settings = load_settings(gw.router_settings)
    service = settings.service
    endpoints = Path(service.envoy_endpoints_file)
    wait_until(endpoints.exists, 10.0, f"the routing service did not write {endpoints}")
    config = render_envoy_config(
        listen=gw.listen, admin=gw.envoy_admin,
        ext_proc=ext_proc_address(service.ext_proc_socket),
        endpoints=EndpointsFile(str(endpoints)),
        fail_open=service.fail_open, max_request_bytes=service.max_body_bytes, retries=service.fallbacks,
        cors_origins=service.cors_origins,
        flow=flow_options(settings.flow),
        replica_key_file=str(api_key_file(Path(stack.state.run_dir))),
    )
    (gw.envoy_dir / "envoy.yaml").write_text(config)
    envoy = spawn_envoy(stack.state, gw.envoy_dir / "envoy.yaml", gw.envoy_name)
    gw.envoy = asdict(envoy)
    stack.keep(gw)
    stack.save()
    wait_for(envoy, lambda: http_ok(f"http://{gw.envoy_admin}/ready"), 30.0, "Envoy")
    progress(f"Envoy gateway on http://{gw.listen}" + (f" ({gw.name})" if len(stack.state.gateways) > 1 else ""))


def front_config(state: StackState) -> Path:
    return Path(state.run_dir) / "front" / "envoy.yaml"


def start_front(stack: StackRun, progress: Progress) -> None:
    from extproc.envoy.front import render_front_config

    state = stack.state
    config = front_config(state)
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(render_front_config(
        listen=state.gateway_url.removeprefix("http://"), admin=state.envoy_admin,
        gateways=[(gw.listen, gw.envoy_admin) for gw in stack.gateway_list]))
    front = spawn_envoy(state, config, FRONT)
    state.front = asdict(front)
    stack.save()
    wait_for(front, lambda: http_ok(f"http://{state.envoy_admin}/ready"), 30.0, "the front Envoy")
    progress(f"front on {state.gateway_url}: connections spread at random over "
             f"{len(state.gateways)} gateways")


def spawn_envoy(state: StackState, config: Path, name: str) -> Daemon:
    run = Path(state.run_dir)
    command = [envoy_binary(), "-c", str(config), "--concurrency", "2", "-l", "warning", "--disable-hot-restart"]
    return spawn(command, run / "logs" / f"{name}.log", die_with_parent=state.die_with_parent)


def wait_envoy_knows(addresses: set[str], envoy_admin: str) -> None:
    """Envoy reads the endpoint file a moment after the router writes it; until then a pick
    of the new replica would be served by its fallback."""
    def known() -> bool:
        with urllib.request.urlopen(f"http://{envoy_admin}/clusters", timeout=2) as reply:
            listing = reply.read().decode()
        return all(f"::{address}::" in listing for address in addresses)

    wait_until(known, 15.0, f"Envoy ({envoy_admin}) did not pick up {sorted(addresses)} from the endpoint file")
