"""Starting the benchmark's stubs (stub_upstream.py, stub_processor.py) as processes, with
the stack's process helpers: each start waits until the stub accepts connections."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from extproc.envoy.contract import ext_proc_address, write_endpoints_file
from extproc.stack.processes import (
    Running,
    accepts,
    free_port,
    service_env,
    socket_name,
    spawn_child,
    start_service,
    static_discovery,
    tls_grpc_serving,
    wait_until_ready,
)


@dataclass
class ServiceOnStubs:
    """`llm-ring serve` routing over stub upstreams, as both gateway benchmarks start it."""

    upstream: Running  # the stub upstream process (all replicas)
    service: Running
    replicas: dict[str, str]  # name -> 127.0.0.1:port
    endpoints: Path  # the EDS file the service writes and Envoy reads
    env: dict[str, str]  # the service's settings overrides (service_env)

    @property
    def processes(self) -> list[Running]:
        return [self.upstream, self.service]


def start_service_on_stubs(workdir: Path, replicas: int, prefix: str,
                           settings: Mapping[str, str] | None = None) -> ServiceOnStubs:
    """``replicas`` stub upstreams named ``<prefix>-<i>`` and the routing service over them
    (static discovery, ``settings``: more LLM_RING__ values); the endpoints file is written
    before the service starts, so an Envoy without the service (a baseline) reads the same replicas."""
    ports = [free_port() for _ in range(replicas)]
    upstream = start_stub_upstream(ports, workdir)
    try:
        addresses = {f"{prefix}-{i}": f"127.0.0.1:{port}" for i, port in enumerate(ports)}
        endpoints = workdir / "eds" / "replicas.json"
        endpoints.parent.mkdir(parents=True, exist_ok=True)
        write_endpoints_file(endpoints, addresses)
        env = service_env(f"127.0.0.1:{free_port()}", endpoints, static_discovery(addresses)) | dict(settings or {})
        service = start_service(workdir / "service", env)
    except BaseException:
        upstream.stop()
        raise
    return ServiceOnStubs(upstream, service, addresses, endpoints, env)


def start_stub_upstream(ports: Sequence[int], workdir: Path) -> Running:
    """The llama.cpp-shaped upstream (stub_upstream.py) on each of ``ports``."""
    workdir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "extproc.bench.stub_upstream", *map(str, ports)]
    running = spawn_child("stub upstream", command, workdir / "stub.log")
    wait_until_ready(running, lambda: all(accepts(port) for port in ports), 10.0)
    return running


def start_stub_processor(port: int, endpoint: str, workdir: Path) -> Running:
    """The do-nothing ext_proc server (benchmark floor), answering every request with endpoint."""
    workdir.mkdir(parents=True, exist_ok=True)
    address = f"127.0.0.1:{port}"
    command = [sys.executable, "-m", "extproc.bench.stub_processor", str(port), endpoint, socket_name(address)]
    running = spawn_child("stub ext_proc", command, workdir / "stub_processor.log")
    wait_until_ready(running, lambda: accepts(port), 10.0)
    running.address = address
    running.ext_proc = ext_proc_address(socket_name(address))
    return running


def start_stub_picker(port: int, endpoint: str, workdir: Path) -> Running:
    """The do-nothing InferencePool picker (stub_picker.py, gRPC over TLS), picking endpoint."""
    workdir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "extproc.bench.stub_picker", str(port), endpoint]
    running = spawn_child("stub picker", command, workdir / "stub_picker.log")
    address = f"127.0.0.1:{port}"
    wait_until_ready(running, lambda: tls_grpc_serving(address, "readiness"), 10.0)
    running.address = running.ext_proc = address
    return running


# flow control on, no slot reserved; with flow control measured every service is told the stubs have room
# enough that every request is routed at once: a request's load is released when Envoy's access
# log entry comes, in batches, so far more requests than the clients' are counted in flight
FLOW_ENV = {"LLM_RING__FLOW__ENABLED": "true", "LLM_RING__FLOW__RESERVED_SLOTS": "0"}
ROOM_KEY = "LLM_RING__ROUTING__REPLICAS__SLOTS"
ROOM_ENV = {ROOM_KEY: "1024"}


def room_of(stubbed: ServiceOnStubs) -> dict[str, str]:
    """The stubs' slots as the first service was told them (ROOM_ENV), for another service."""
    return {ROOM_KEY: stubbed.env[ROOM_KEY]} if ROOM_KEY in stubbed.env else {}


def start_variant_service(workdir: Path, stubbed: ServiceOnStubs, name: str, settings: dict[str, str]) -> Running:
    """Another `llm-ring serve` over the same stubs, with ``settings`` (LLM_RING__ variables) changed."""
    listen = f"127.0.0.1:{free_port()}"
    env = service_env(listen, workdir / f"eds-{name}" / "replicas.json", static_discovery(stubbed.replicas))
    running = start_service(workdir / f"service-{name}", env | room_of(stubbed) | settings)
    running.listen = env["LLM_RING__SERVICE__METRICS_LISTEN"].strip('"')  # its /metrics, read at the end
    return running


def flow_outcomes(service: Running) -> dict[str, int]:
    """How the requests went through the flow-controlled service: at_once, else queued."""
    text = httpx.get(f"http://{service.listen}/metrics", timeout=5.0).text
    outcomes = [(sample.labels["outcome"], sample.value) for family in text_string_to_metric_families(text)
                for sample in family.samples if sample.name == "llm_ring_flow_requests_total"]
    at_once = sum(value for outcome, value in outcomes if outcome == "at_once")
    return {"at_once": int(at_once), "other": int(sum(value for _, value in outcomes) - at_once)}
