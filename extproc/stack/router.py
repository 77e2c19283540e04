"""The local stack's routing services: their generated settings, start, and what they know."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import tomli_w

from extproc.routing.replica_facts import ReplicaFacts
from extproc.settings import read_toml
from extproc.stack.daemons import Daemon, spawn, wait_for, wait_until
from extproc.stack.errors import Progress, StackError
from extproc.stack.gateways import STORE, GatewayState
from extproc.stack.processes import ROUTER_REFERENCE, grpc_serving, socket_name
from extproc.stack.redis_server import password_file
from extproc.stack.replicas import api_key_file
from extproc.stack.state import StackRun

if TYPE_CHECKING:
    from extproc.stack.state import StackState


def start_router(stack: StackRun, gw: GatewayState, base_settings: str, progress: Progress) -> None:
    from extproc.settings import SettingsError, load_settings

    state = stack.state
    run = Path(state.run_dir)
    base = Path(base_settings) if base_settings else ROUTER_REFERENCE
    several = len(state.gateways) > 1
    gw.router_settings.write_text(render_router_settings(
        base,
        policy=state.policy,
        admin_listen=gw.router_address,
        metrics_listen=gw.metrics_url.removeprefix("http://").removesuffix("/metrics"),
        replicas_file=run / "replicas.json",
        envoy_endpoints_file=gw.envoy_dir / "endpoints.json",
        store_url=state.store_url if several else None,
        store_password_file=password_file(run / STORE) if several else None,
        replicas=ReplicaFacts(slots=state.replica_settings["parallel"], cache_tokens=state.prefix_capacity_tokens),
        tokenizer=_tokenizer(stack),
        replica_key_file=api_key_file(run),
    ))
    try:
        load_settings(gw.router_settings)
    except SettingsError as exc:
        raise StackError(f"the generated router settings are invalid: {exc}") from None
    router = spawn_router(state, gw)
    gw.router = asdict(router)
    stack.keep(gw)
    stack.save()
    wait_for(router, lambda: grpc_serving(gw.router_address), 30.0, "the routing service")
    wait_router_knows({r.name for r in stack.replica_list}, gw.router_address)
    progress(f"routing service ({state.policy}) on {gw.router_address}")


def _tokenizer(stack: StackRun) -> str:
    """service.tokenizer: the replicas' GGUF file, counted as they count; a fleet of several models
    has no one tokenizer: characters (a prompt's tokens differ by model, its characters do not)."""
    served = stack.served_models()
    return served[0].path if len(served) == 1 else "chars"


def spawn_router(state: StackState, gw: GatewayState) -> Daemon:
    run = Path(state.run_dir)
    command = [sys.executable, "-m", "extproc.cli", "serve", "--config", str(gw.router_settings)]
    return spawn(command, run / "logs" / f"{gw.router_name}.log", die_with_parent=state.die_with_parent)


def router_replicas(router: str) -> set[str]:
    from extproc.service.admin_client import AdminClient

    with AdminClient(router) as admin:
        return {r["name"] for r in admin.state()["replicas"]}


def wait_router_knows(names: set[str], router: str) -> None:
    wait_until(lambda: names <= router_replicas(router), 15.0,
               f"the routing service on {router} did not pick up {sorted(names)} from replicas.json")


def wait_router_forgets(names: set[str], router: str) -> None:
    wait_until(lambda: not names & router_replicas(router), 15.0,
               f"the routing service on {router} still lists {sorted(names)}")


def render_router_settings(base: Path, *, policy: str, admin_listen: str, metrics_listen: str, replicas_file: Path,
                           envoy_endpoints_file: Path, store_url: str | None = None,
                           store_password_file: Path | None = None,
                           replicas: ReplicaFacts | None = None,
                           tokenizer: str | None = None, replica_key_file: Path | None = None) -> str:
    """The routing service's settings: `base` with this stack's addresses, files and policy.
    store_url, store_password_file (several gateways): their shared store, as [store] url and
    password_file; replicas: what this stack's replicas are (their --parallel, the prompt tokens
    they hold), as [routing.replicas]; tokenizer: their GGUF model file (service.tokenizer: counted
    as they count); replica_key_file: the key they want (service.replica_api_key_file: their
    /v1/models)."""
    raw = read_toml(base)
    raw["routing"]["policy"] = policy
    if replicas is not None:
        raw["routing"]["replicas"] = replicas.model_dump()
    raw["service"].update(  # no picker port: Envoy reaches ext_proc and the access log on the socket
        listen="",
        admin_listen=admin_listen,
        ext_proc_socket=socket_name(admin_listen),  # one per router: several may run on one machine
        metrics_listen=metrics_listen,
        envoy_endpoints_file=str(envoy_endpoints_file),
        routing_headers=True,  # experiments record each answer's replica, reason and prediction
    )
    if tokenizer is not None:
        raw["service"]["tokenizer"] = tokenizer
    if replica_key_file is not None:
        raw["service"]["replica_api_key_file"] = str(replica_key_file)
    raw["discovery"]["source"] = "file"
    raw["discovery"]["file"]["path"] = str(replicas_file)
    if store_url is not None:
        raw["store"]["url"] = store_url
    if store_password_file is not None:
        raw["store"]["password_file"] = str(store_password_file)
    return f"# generated by `llm-ring up` from {base}\n" + tomli_w.dumps(raw)
