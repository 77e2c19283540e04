"""Replica discovery from Kubernetes EndpointSlices (list + watch, official client).

The replicas are the ready, not terminating endpoints of the EndpointSlices labelled
``kubernetes.io/service-name=<service>``, named after their pods (``llm-0``, ``llm-1``, …)
so that a replica keeps its place on the hash ring across restarts and IP changes.
A terminating endpoint leaves at once: it gets no new conversations while it drains.

The ``kubernetes`` client is synchronous, so the list/watch loop runs in one daemon
thread, the only user of the ApiClient; it hands each new full snapshot to the asyncio side,
which yields it from ``snapshots()``. The grpc.aio loop never blocks on the API.

Loop: list (full state, resourceVersion) → watch from that version, again and again,
resuming from the last version seen (events and bookmarks) → on 410 Gone relist at
once; on any other failure (API unreachable, 401/403, 5xx) keep the last known set,
wait with exponential backoff and relist.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from extproc.settings import DiscoverySettings

log = structlog.get_logger("extproc.discovery.kubernetes")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
HTTP_GONE = 410
# Server-side length of one watch request; the stream then ends and is resumed from the
# last resourceVersion. Kept well under the API server's own limit (~30-60 min).
WATCH_TIMEOUT_SECONDS = 300
# The backoff doubles from discovery.kubernetes_backoff_seconds up to this ceiling.
MAX_BACKOFF_SECONDS = 30.0
CONNECT_TIMEOUT_SECONDS = 5.0
LIST_TIMEOUT_SECONDS = 30.0


# ----------------------------------------------------------------------------- core


@dataclass(frozen=True, order=True)
class _Candidate:
    """One usable endpoint; ordering picks a deterministic winner for duplicates."""

    not_ipv4: bool  # prefer IPv4 when a dual-stack Service lists a pod twice
    address: str
    name: str
    target: str


def replicas_from_slices(slices: Iterable[Any], port_name: str) -> dict[str, str]:
    """Map EndpointSlices (client models) to {replica name: "ip:port"}.

    Keeps endpoints that are ready (an unset condition counts as ready, as the API
    documents) and not terminating, on a slice that has a port named ``port_name``.
    """
    best: dict[str, _Candidate] = {}
    for endpoint_slice in slices:
        port = _named_port(endpoint_slice, port_name)
        address_type = endpoint_slice.address_type
        if port is None or address_type not in ("IPv4", "IPv6"):
            continue
        for endpoint in endpoint_slice.endpoints or ():
            if not _accepts_traffic(endpoint) or not endpoint.addresses:
                continue
            address = endpoint.addresses[0]
            host = f"[{address}]" if address_type == "IPv6" else address
            name = _replica_name(endpoint)
            candidate = _Candidate(address_type != "IPv4", address, name, f"{host}:{port}")
            if name not in best or candidate < best[name]:
                best[name] = candidate
    return {name: best[name].target for name in sorted(best)}


def _named_port(endpoint_slice: Any, port_name: str) -> int | None:
    for port in endpoint_slice.ports or ():
        if port.name == port_name and port.port is not None:
            return int(port.port)
    return None


def _accepts_traffic(endpoint: Any) -> bool:
    conditions = endpoint.conditions
    if conditions is None:
        return True
    return conditions.ready is not False and conditions.terminating is not True


def _replica_name(endpoint: Any) -> str:
    """The pod's name (stable for a StatefulSet), else the hostname, else the address."""
    ref = endpoint.target_ref
    if ref is not None and ref.kind == "Pod" and ref.name:
        return str(ref.name)
    return str(endpoint.hostname or endpoint.addresses[0])


# ----------------------------------------------------------------------------- shell


class KubernetesCredentialsError(RuntimeError):
    """No usable credentials: nothing to retry, the service should stop and say why."""


def credentials() -> client.ApiClient:
    try:
        return default_api_client()
    except Exception as exc:
        raise KubernetesCredentialsError(
            f'discovery.source = "kubernetes" but no usable credentials ({type(exc).__name__}: {exc}); '
            "in a pod the ServiceAccount token is used, elsewhere KUBECONFIG or ~/.kube/config"
        ) from exc


def default_api_client() -> client.ApiClient:
    """In-cluster credentials in a pod; elsewhere the kubeconfig (KUBECONFIG, ~/.kube/config)."""
    configuration = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:  # KUBECONFIG is read here, not at import time as the client's default does
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration)
    return client.ApiClient(configuration)


@dataclass(frozen=True)
class WatchConfig:
    namespace: str
    service: str
    port_name: str
    backoff_seconds: float
    max_backoff_seconds: float
    watch_timeout_seconds: int

    @property
    def selector(self) -> str:
        return f"{SERVICE_NAME_LABEL}={self.service}"


class KubernetesDiscovery:
    """Discovery protocol: ``snapshots()`` yields {replica: "ip:port"} on every change.

    ``api_client`` is for tests and tools; by default the credentials come from
    ``default_api_client()``. Each ``snapshots()`` iteration runs its own watch thread,
    stopped when the iteration is closed or cancelled.
    """

    def __init__(
        self,
        settings: DiscoverySettings,
        api_client: client.ApiClient | None = None,
        *,
        watch_timeout_seconds: int = WATCH_TIMEOUT_SECONDS,
        max_backoff_seconds: float = MAX_BACKOFF_SECONDS,
    ) -> None:
        self.config = WatchConfig(
            namespace=settings.kubernetes_namespace,
            service=settings.kubernetes_service,
            port_name=settings.kubernetes_port_name,
            backoff_seconds=settings.kubernetes_backoff_seconds,
            max_backoff_seconds=max(max_backoff_seconds, settings.kubernetes_backoff_seconds),
            watch_timeout_seconds=watch_timeout_seconds,
        )
        self._api_client = api_client

    async def snapshots(self) -> AsyncIterator[dict[str, str]]:
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        latest: list[dict[str, str]] = [{}]  # one slot, written on the loop thread only

        def deliver(snapshot: dict[str, str]) -> None:
            latest[0] = snapshot
            changed.set()

        def publish(snapshot: dict[str, str]) -> None:  # called from the watch thread
            with contextlib.suppress(RuntimeError):  # the loop closed as the thread finished
                loop.call_soon_threadsafe(deliver, snapshot)

        owned = self._api_client is None
        api_client = await asyncio.to_thread(credentials) if self._api_client is None else self._api_client
        worker = _WatchLoop(self.config, api_client, publish)
        thread = threading.Thread(target=worker.run, name="k8s-discovery", daemon=True)
        thread.start()
        last: dict[str, str] | None = None
        try:
            while True:
                await changed.wait()
                changed.clear()
                if latest[0] != last:
                    last = latest[0]
                    yield dict(last)
        finally:
            await asyncio.to_thread(worker.stop_and_join, thread, CONNECT_TIMEOUT_SECONDS)
            if owned:
                api_client.close()


class _WatchLoop:
    """The blocking list/watch loop; runs in its own thread, the only user of the ApiClient."""

    def __init__(
        self, cfg: WatchConfig, api_client: client.ApiClient, publish: Callable[[dict[str, str]], None]
    ) -> None:
        self._cfg = cfg
        self._api = client.DiscoveryV1Api(api_client)
        self._publish = publish
        self._stopped = threading.Event()
        self._watch: watch.Watch | None = None
        self._slices: dict[str, Any] = {}
        self._published: dict[str, str] | None = None

    def stop_and_join(self, thread: threading.Thread, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._stopped.set()
        while thread.is_alive() and time.monotonic() < deadline:
            # Shuts the watch socket down, unblocking a read in progress. Repeated: a watch
            # whose response headers have not arrived yet has no socket to shut down.
            current = self._watch
            if current is not None:
                current.stop()
            thread.join(0.05)

    def run(self) -> None:
        api = self._api
        backoff = self._cfg.backoff_seconds
        while not self._stopped.is_set():
            try:
                version = self._list(api)
                backoff = self._cfg.backoff_seconds
                while not self._stopped.is_set():
                    version = self._watch_once(api, version)
            except ApiException as exc:
                if exc.status == HTTP_GONE:
                    log.info("endpointslice_watch_expired", action="relist")
                    continue
                log.warning(
                    "kubernetes_api_error",
                    status=exc.status,
                    reason=str(exc.reason),
                    retry_in_s=backoff,
                    serving=sorted(self._published or {}),
                )
            except Exception as exc:  # unreachable, reset, timed out, malformed reply
                if self._stopped.is_set():
                    break
                log.warning(
                    "kubernetes_api_unreachable",
                    error=f"{type(exc).__name__}: {exc}",
                    retry_in_s=backoff,
                    serving=sorted(self._published or {}),
                )
            self._stopped.wait(backoff)
            backoff = min(backoff * 2, self._cfg.max_backoff_seconds)

    def _list(self, api: client.DiscoveryV1Api) -> str:
        result = api.list_namespaced_endpoint_slice(
            self._cfg.namespace,
            label_selector=self._cfg.selector,
            _request_timeout=(CONNECT_TIMEOUT_SECONDS, LIST_TIMEOUT_SECONDS),
        )
        self._slices = {str(item.metadata.name): item for item in result.items or () if item.metadata}
        self._emit()
        if result.metadata is None or not result.metadata.resource_version:
            raise ValueError("EndpointSlice list without a resourceVersion: cannot watch from it")
        return str(result.metadata.resource_version)

    def _watch_once(self, api: client.DiscoveryV1Api, version: str) -> str:
        """One watch request; returns the version to resume from (events and bookmarks)."""
        cfg = self._cfg
        self._watch = current = watch.Watch()
        try:
            for event in current.stream(
                api.list_namespaced_endpoint_slice,
                cfg.namespace,
                label_selector=cfg.selector,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=cfg.watch_timeout_seconds,
                # the client gives up one timeout later: a silently dead connection ends too
                _request_timeout=(
                    CONNECT_TIMEOUT_SECONDS,
                    cfg.watch_timeout_seconds + CONNECT_TIMEOUT_SECONDS,
                ),
            ):
                kind = event["type"]
                if kind in ("ADDED", "MODIFIED"):
                    self._slices[event["object"].metadata.name] = event["object"]
                elif kind == "DELETED":
                    self._slices.pop(event["object"].metadata.name, None)
                if kind != "BOOKMARK":
                    self._emit()
        finally:
            self._watch = None
        return str(current.resource_version or version)

    def _emit(self) -> None:
        snapshot = replicas_from_slices(self._slices.values(), self._cfg.port_name)
        if snapshot == self._published:
            return
        previous = self._published or {}
        self._published = snapshot
        log.info(
            "replicas_changed",
            replicas=sorted(snapshot),
            added=sorted(set(snapshot) - set(previous)),
            removed=sorted(set(previous) - set(snapshot)),
            endpoints=snapshot,
            service=f"{self._cfg.namespace}/{self._cfg.service}",
        )
        self._publish(snapshot)
