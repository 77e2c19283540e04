"""Starting the benchmark's stubs (stub_upstream.py, stub_processor.py) as processes, with
the stack's process helpers: each start waits until the stub accepts connections."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

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
