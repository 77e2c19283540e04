"""`llm-ring serve --config FILE`: the ext_proc routing service.

One grpc.aio server per audience. The picker port (service.listen, over TLS when service.tls is
set) carries what an InferencePool gateway talks to: the ExternalProcessor, as an Endpoint
Picker, and gRPC health. The abstract socket service.ext_proc_socket is our own Envoy's, in
this pod or on this host: the ExternalProcessor and the access log service, whose entries
release load; nothing else serves the access log (none behind an InferencePool gateway). The
Admin service (proto/admin.proto) and gRPC health are on service.admin_listen only, so nothing
that reaches the picker port can change the routing; service.migration_listen, when set, serves only the
part a leaving replica's slot sidecar calls (admin.MigrationService), to callers carrying the token of
service.migration_token_file (bearer.py). Prometheus metrics, and
HTTP probes /livez and /readyz, are on service.metrics_listen (http_probes.py).
Discovery snapshots update the router (and, when service.envoy_endpoints_file is set, the
endpoint file Envoy watches).

Health, with the service names of the Endpoint Picker protocol: "" and "liveness" are SERVING
as soon as the servers run; "readiness" and "envoy.service.ext_proc.v3.ExternalProcessor" are
SERVING while at least one replica is known, NOT_SERVING otherwise. On SIGTERM all turn
NOT_SERVING for good while in-flight requests finish (drain.py, up to service.drain_seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import orjson
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from extproc.discovery import leaving_of
from extproc.discovery.plugin import make_discovery
from extproc.envoy.contract import split_host_port, write_endpoints_file
from extproc.routing import Router
from extproc.service import admin_pb2_grpc
from extproc.service.admin import AdminService, MigrationService
from extproc.service.bearer import BearerCheck
from extproc.service.catalog import ModelFetcher
from extproc.service.dataplanes.own_envoy import access_log_handler
from extproc.service.decision_log import DecisionLog
from extproc.service.drain import drain
from extproc.service.gateway import Gateway
from extproc.service.http_probes import Readiness, start_metrics_server
from extproc.service.metrics import Metrics
from extproc.service.offload import BodyParser
from extproc.service.processor import SERVICE, handler
from extproc.service.replica_health import ReplicaHealth
from extproc.service.residency_watch import ResidencyWatcher
from extproc.service.tls import SELF_SIGNED, TlsError, server_credentials
from extproc.service.tokenizer import TokenCounter, TokenizerError, make_counter
from extproc.service.waiting_room import WaitingRoom
from extproc.settings import ServiceSettings, Settings, SettingsError, load_settings, read_secret_file

log = structlog.get_logger("extproc.service")
LOST_SWEEP_SECONDS = 30.0
LIVE = ("", "liveness")  # SERVING while the process serves
READY = ("readiness", SERVICE)  # SERVING while a replica is known


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, metavar="FILE", help="settings TOML (see extproc/service/router.toml)"
    )


def main(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config)
    except SettingsError as exc:
        print(f"llm-ring serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.service.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(serve(settings))
    return 0


def configure_logging(level: str) -> None:
    """structlog JSON lines on stdout, one object per event (orjson: a route_decision line with
    its whole trace is rendered on every request, so the serializer's speed matters)."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=orjson.dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.BytesLoggerFactory(sys.stdout.buffer),
        cache_logger_on_first_use=True,
    )


async def serve(settings: Settings) -> int:
    """Serve until SIGTERM/SIGINT (drained, exit status 0) or until discovery fails (1)."""
    service = settings.service
    migration_token = read_secret_file("service.migration_token_file", service.migration_token_file)
    replica_key = read_secret_file("service.replica_api_key_file", service.replica_api_key_file)
    try:
        credentials = server_credentials(service.tls)
        counter = make_counter(service.tokenizer, service.chars_per_token)
    except TlsError as exc:
        print(f"llm-ring serve: {exc}", file=sys.stderr)
        return 2
    except TokenizerError as exc:
        print(f"llm-ring serve: service.tokenizer: {exc}", file=sys.stderr)
        return 2
    gateway = _make_gateway(settings, counter, replica_key)
    askers = _ReplicaAskers.start(gateway, service, replica_key)
    room = WaitingRoom(gateway, settings.flow) if settings.flow.enabled else None
    if settings.store.url:  # several routers agree through it; a fresh id per start (the old one expires)
        await gateway.publishing.share_state(settings.store, secrets.token_hex(6))
    metrics_host, metrics_port = split_host_port(service.metrics_listen)
    readiness = Readiness()
    metrics_server = start_metrics_server(metrics_host, metrics_port, gateway.metrics.registry, readiness)
    parser = BodyParser(gateway.reader.limits, counter)
    health_service = health_aio.HealthServicer()
    servers, listen = await _start_servers(service, gateway, (parser, room, health_service), credentials,
                                           migration_token)
    log.info("service_started", listen=listen, tls=_tls_kind(service.tls), ext_proc_socket=service.ext_proc_socket,
             admin=service.admin_listen, migration=service.migration_listen,
             metrics=f"{metrics_host}:{metrics_server.server_port}", policy=settings.routing.policy,
             discovery=settings.discovery.source, tokenizer=counter.name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    watcher = loop.create_task(follow_discovery(settings, gateway, askers, health_service, readiness))
    sweeper = loop.create_task(_release_lost(gateway))
    watcher.add_done_callback(lambda task: _discovery_ended(task, stop))
    try:
        await stop.wait()
        if not watcher.done():  # a signal, not a failed discovery
            readiness.draining = True
            in_flight = gateway.requests.pending
            await drain(lambda: len(in_flight) + (room.waiting() if room is not None else 0), health_service,
                        service.drain_seconds)
    finally:
        log.info("service_stopping", in_flight=gateway.router.ledger.total_requests())
        for task in (watcher, sweeper):
            task.cancel()
        await askers.close()
        await asyncio.gather(*(server.stop(grace=2) for server in servers))
        if gateway.store is not None:
            await gateway.store.close()
        parser.close()
        metrics_server.shutdown()
        with contextlib.suppress(Exception, asyncio.CancelledError):  # a failure is logged: discovery_failed
            await watcher
    # a supervisor (Kubernetes, the stack) must see that the service gave up
    return 1 if not watcher.cancelled() and watcher.exception() is not None else 0


def _make_gateway(settings: Settings, counter: TokenCounter, replica_key: str | None) -> Gateway:
    """The gateway over a Router of ``settings.routing``, its metrics watching it."""
    metrics = Metrics()
    metrics.tokenizer(counter.name)
    gateway = Gateway(Router(settings.routing), settings.service, metrics, counter=counter, replica_key=replica_key)
    if getattr(logging, settings.service.log_level.upper()) <= logging.INFO:  # the per-request line, its own path
        gateway.decision_log = DecisionLog(sys.stdout.buffer)
    metrics.watch(gateway.replica_states, lambda: gateway.router.speeds.speeds())  # reconfigure may replace them
    return gateway


@dataclass(frozen=True)
class _ReplicaAskers:
    """What asks the replicas themselves: whether a failed one is back, what each serves and holds loaded."""

    health: ReplicaHealth
    models: ModelFetcher
    residency: ResidencyWatcher

    @classmethod
    def start(cls, gateway: Gateway, service: ServiceSettings, replica_key: str | None) -> _ReplicaAskers:
        health = ReplicaHealth(gateway, service.health_probe_seconds)
        gateway.on_replica_failed = health.replica_failed

        def endpoints() -> dict[str, str]:  # read at each use: discovery replaces the fleet's map
            return gateway.fleet.endpoints

        models = ModelFetcher(gateway.catalog, endpoints, replica_key, service.health_probe_seconds)
        residency = ResidencyWatcher(lambda: gateway.router.residency, endpoints, replica_key,
                                     service.model_status_seconds)
        return cls(health, models, residency)

    def replicas_changed(self) -> None:
        self.models.replicas_changed()
        self.residency.replicas_changed()

    async def close(self) -> None:
        self.health.close()
        await self.models.close()
        await self.residency.close()


async def _start_servers(
    service: ServiceSettings, gateway: Gateway,
    serving: tuple[BodyParser, WaitingRoom | None, health_aio.HealthServicer],
    tls: grpc.ServerCredentials | None, migration_token: str | None,
) -> tuple[list[grpc.aio.Server], str]:
    """Every gRPC server started (the gateway's, the Admin API's, the migration port's), health
    set (live, not ready until a replica is known); and where the picker port listens."""
    parser, room, health = serving
    servers, listen = _gateway_servers(service, gateway, parser, room, health, tls)
    admin = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    admin_service = AdminService(gateway)
    admin_pb2_grpc.add_AdminServicer_to_server(admin_service, admin)
    health_pb2_grpc.add_HealthServicer_to_server(health, admin)
    servers.append(admin)
    if service.migration_listen:
        migration = grpc.aio.server(options=[("grpc.so_reuseport", 0)],
                                    interceptors=_token_check(migration_token, gateway.metrics))
        admin_pb2_grpc.add_AdminServicer_to_server(MigrationService(admin_service), migration)
        if migration.add_insecure_port(service.migration_listen) == 0:
            raise SystemExit(f"llm-ring serve: cannot listen on service.migration_listen={service.migration_listen!r}")
        servers.append(migration)
    if admin.add_insecure_port(service.admin_listen) == 0:
        raise SystemExit(f"llm-ring serve: cannot listen on service.admin_listen={service.admin_listen!r}")
    for server in servers:
        await server.start()
    for name in LIVE:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    for name in READY:
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return servers, listen


async def follow_discovery(
    settings: Settings, gateway: Gateway, askers: _ReplicaAskers, health: health_aio.HealthServicer,
    readiness: Readiness,
) -> None:
    """Each snapshot of the chosen discovery source becomes the gateway's replica set (with the
    leaving ones' order of leaving), Envoy's endpoints file and the readiness."""
    endpoints_file = settings.service.envoy_endpoints_file
    if endpoints_file:
        Path(endpoints_file).parent.mkdir(parents=True, exist_ok=True)
    discovery = settings.discovery
    async for replicas in make_discovery(discovery).snapshots():
        gateway.set_replicas(replicas)
        for name in leaving_of(replicas) - gateway.leaving.orders.keys():  # a pod began terminating
            gateway.begin_leaving(name, discovery.leaving_seconds, discovery.leaving_near_seconds)
        askers.replicas_changed()  # what each replica serves, and holds loaded
        if endpoints_file:
            write_endpoints_file(endpoints_file, replicas)
        status = health_pb2.HealthCheckResponse.SERVING if replicas else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in READY:
            await health.set(name, status)
        readiness.replicas_known = bool(replicas)
        # Not "replicas_changed": that is discovery's own event (kubernetes.py), with another shape.
        log.info("replicas_applied", replicas=replicas)


def _token_check(token: str | None, metrics: Metrics) -> list[BearerCheck]:
    """The migration port's interceptors: none without a token (a loopback port)."""
    if token is None:
        return []

    def refused() -> None:
        metrics.errors["migration_unauthenticated"] += 1

    return [BearerCheck(token, refused)]


def _gateway_servers(
    service: ServiceSettings, gateway: Gateway, parser: BodyParser, room: WaitingRoom | None,
    health: health_aio.HealthServicer,
    tls: grpc.ServerCredentials | None,
) -> tuple[list[grpc.aio.Server], str]:
    """The picker port's server (service.listen: ext_proc as an Endpoint Picker, health; TLS
    when asked) and our own Envoy's (service.ext_proc_socket: ext_proc and the access log,
    plaintext: only this host or pod reaches it), each when set; and where the port listens."""
    # A buffered body up to max_body_bytes comes in one message (plus its envelope).
    options = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", service.max_body_bytes + (64 << 10))]
    servers, where = [], ""
    if service.listen:
        picker = grpc.aio.server(options=options)
        picker.add_generic_rpc_handlers((handler(gateway, parser, room, own_envoy=False),))
        health_pb2_grpc.add_HealthServicer_to_server(health, picker)
        listen = service.listen
        port = picker.add_secure_port(listen, tls) if tls is not None else picker.add_insecure_port(listen)
        if port == 0:
            raise SystemExit(f"llm-ring serve: cannot listen on service.listen={listen!r}")
        servers.append(picker)
        where = f"{split_host_port(listen)[0]}:{port}"
    if service.ext_proc_socket:
        envoy = grpc.aio.server(options=options)
        envoy.add_generic_rpc_handlers((handler(gateway, parser, room, own_envoy=True), access_log_handler(gateway)))
        try:
            envoy.add_insecure_port(f"unix-abstract:{service.ext_proc_socket}")
        except RuntimeError:
            raise SystemExit(f"llm-ring serve: cannot listen on service.ext_proc_socket={service.ext_proc_socket!r} "
                             "(in use by another process?)") from None
        servers.append(envoy)
    return servers, where


def _tls_kind(setting: str) -> str:
    return "" if not setting else SELF_SIGNED if setting == SELF_SIGNED else "files"


async def _release_lost(gateway: Gateway) -> None:
    """Requests whose access log entry never came are released (see PendingRequests.release_lost, lifecycle.py)."""
    while True:
        await asyncio.sleep(LOST_SWEEP_SECONDS)
        lost = gateway.requests.release_lost(time.monotonic())
        if lost:
            log.warning("access_log_entries_lost", released=lost)


def _discovery_ended(task: asyncio.Task[None], stop: asyncio.Event) -> None:
    """Discovery never ends on its own: if it failed, say why and stop the service."""
    if not task.cancelled() and task.exception() is not None:
        log.error("discovery_failed", error=str(task.exception()))
        stop.set()
