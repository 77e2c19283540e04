"""Replica discovery from Kubernetes EndpointSlices (list + watch, official client).

The replicas are the ready, not terminating endpoints of the EndpointSlices labelled
``kubernetes.io/service-name=<service>``, named after their pods (``llm-0``, ``llm-1``, …)
so that a replica keeps its place on the hash ring across restarts and IP changes.
A terminating endpoint that still serves (its pod's preStop drain runs) stays listed as
leaving (``Snapshot.leaving``) while ``discovery.leaving_seconds`` > 0: the router sends it no
new conversation, only follow-ups whose cache has not moved yet; with 0 it leaves at once.

The ``kubernetes`` client is synchronous, so each list/watch loop runs in a daemon thread
(one here; InferencePool discovery, inference_pool.py, runs two on one ApiClient, whose
connection pool is thread-safe); it hands each new full snapshot to the asyncio side,
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

from extproc.discovery import Snapshot, leaving_of
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
    return _endpoints(slices, port_name, _accepts_traffic)


def leaving_from_slices(slices: Iterable[Any], port_name: str) -> dict[str, str]:
    """The terminating endpoints that still serve ({name: "ip:port"}): pods on their way out."""
    return _endpoints(slices, port_name, _still_serving)


def snapshot_from_slices(slices: Iterable[Any], port_name: str, keep_leaving: bool) -> Snapshot:
    """The ready replicas and, with ``keep_leaving``, the leaving ones that are not also ready."""
    ready = replicas_from_slices(slices, port_name)
    if not keep_leaving:
        return Snapshot(ready)
    leaving = {name: target for name, target in leaving_from_slices(slices, port_name).items() if name not in ready}
    both = ready | leaving
    return Snapshot({name: both[name] for name in sorted(both)}, leaving)


def _endpoints(slices: Iterable[Any], port_name: str, keep: Callable[[Any], bool]) -> dict[str, str]:
    best: dict[str, _Candidate] = {}
    for endpoint_slice in slices:
        port = _named_port(endpoint_slice, port_name)
        address_type = endpoint_slice.address_type
        if port is None or address_type not in ("IPv4", "IPv6"):
            continue
        for endpoint in endpoint_slice.endpoints or ():
            if not keep(endpoint) or not endpoint.addresses:
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


def _still_serving(endpoint: Any) -> bool:
    """Terminating, its readiness still passing (``serving`` set: an unset one is not trusted)."""
    conditions = endpoint.conditions
    return conditions is not None and conditions.terminating is True and conditions.serving is True


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
class WatchTiming:
    backoff_seconds: float
    max_backoff_seconds: float
    watch_timeout_seconds: int


def watch_timing(settings: DiscoverySettings, watch_timeout_seconds: int, max_backoff_seconds: float) -> WatchTiming:
    return WatchTiming(
        backoff_seconds=settings.kubernetes_backoff_seconds,
        max_backoff_seconds=max(max_backoff_seconds, settings.kubernetes_backoff_seconds),
        watch_timeout_seconds=watch_timeout_seconds,
    )


Publish = Callable[[dict[str, str]], None]


async def threaded_snapshots(
    api_client: client.ApiClient | None, start_loops: Callable[[client.ApiClient, Publish], list[ListWatchLoop]]
) -> AsyncIterator[dict[str, str]]:
    """The Discovery protocol over blocking list/watch loops, one daemon thread each.

    ``start_loops`` builds the loops on an ApiClient (``api_client``, else one from
    ``credentials()``, closed at the end) and a thread-safe ``publish``; every published
    snapshot that differs from the last one yielded is yielded. The loops stop when the
    iteration is closed or cancelled.
    """
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()
    latest: list[dict[str, str]] = [{}]  # one slot, written on the loop thread only

    def deliver(snapshot: dict[str, str]) -> None:
        latest[0] = snapshot
        changed.set()

    def publish(snapshot: dict[str, str]) -> None:  # called from the watch threads
        with contextlib.suppress(RuntimeError):  # the loop closed as a thread finished
            loop.call_soon_threadsafe(deliver, snapshot)

    owned = api_client is None
    api = await asyncio.to_thread(credentials) if api_client is None else api_client
    workers = start_loops(api, publish)
    threads = [threading.Thread(target=w.run, name="k8s-discovery", daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    last: dict[str, str] | None = None
    try:
        while True:
            await changed.wait()
            changed.clear()
            if latest[0] != last:
                last = latest[0]
                yield Snapshot(last, leaving_of(last))
    finally:
        for worker in workers:
            worker.stopped.set()  # all stop at once, then each is joined
        for worker, thread in zip(workers, threads, strict=True):
            await asyncio.to_thread(worker.stop_and_join, thread, CONNECT_TIMEOUT_SECONDS)
        if owned:
            api.close()


class WatchedSource:
    """What every API-watching discovery shares: the namespace, the watch timing, the client.

    ``api_client`` is for tests and tools; by default the credentials come from
    ``default_api_client()``. Each ``snapshots()`` iteration runs its own watch threads,
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
        self.namespace = settings.kubernetes_namespace
        self.keep_leaving = settings.leaving_seconds > 0
        self.timing = watch_timing(settings, watch_timeout_seconds, max_backoff_seconds)
        self._api_client = api_client


class KubernetesDiscovery(WatchedSource):
    """Discovery protocol: ``snapshots()`` yields {replica: "ip:port"} on every change of the
    Service's EndpointSlices (one watch thread)."""

    def __init__(self, settings: DiscoverySettings, api_client: client.ApiClient | None = None, **timing: Any) -> None:
        super().__init__(settings, api_client, **timing)
        self.service = settings.kubernetes_service
        self.port_name = settings.kubernetes_port_name

    def snapshots(self) -> AsyncIterator[dict[str, str]]:
        return threaded_snapshots(self._api_client, lambda api, publish: [_SliceLoop(self, api, publish)])


class ListWatchLoop:
    """The blocking list/watch loop of one resource; runs in its own thread.

    List (full state, resourceVersion) → watch from that version, again and again,
    resuming from the last version seen (events and bookmarks) → on 410 Gone relist at
    once; on any other failure keep what is known, back off and relist. A relist replaces
    the whole state, so a dropped watch neither loses nor duplicates an object.
    Subclasses name the list call and say what the list and each event change.
    """

    resource = ""  # names the log events

    def __init__(self, timing: WatchTiming) -> None:
        self._timing = timing
        self.stopped = threading.Event()
        self._watch: watch.Watch | None = None

    def list_call(self) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        """The list function, its positional arguments and its selectors."""
        raise NotImplementedError

    def replace(self, items: list[Any]) -> None:
        """A list's full state."""
        raise NotImplementedError

    def apply(self, kind: str, obj: Any) -> None:
        """One ADDED, MODIFIED or DELETED event."""
        raise NotImplementedError

    def serving(self) -> list[str]:
        """The replicas in service, for the failure log lines."""
        raise NotImplementedError

    def stop_and_join(self, thread: threading.Thread, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self.stopped.set()
        while thread.is_alive() and time.monotonic() < deadline:
            # Shuts the watch socket down, unblocking a read in progress. Repeated: a watch
            # whose response headers have not arrived yet has no socket to shut down.
            current = self._watch
            if current is not None:
                current.stop()
            thread.join(0.05)

    def run(self) -> None:
        backoff = self._timing.backoff_seconds
        while not self.stopped.is_set():
            try:
                version = self._list()
                backoff = self._timing.backoff_seconds
                while not self.stopped.is_set():
                    version = self._watch_once(version)
            except ApiException as exc:
                if exc.status == HTTP_GONE:
                    log.info(f"{self.resource}_watch_expired", action="relist")
                    continue
                log.warning(
                    "kubernetes_api_error",
                    resource=self.resource,
                    status=exc.status,
                    reason=str(exc.reason),
                    retry_in_s=backoff,
                    serving=self.serving(),
                )
            except Exception as exc:  # unreachable, reset, timed out, malformed reply
                if self.stopped.is_set():
                    break
                log.warning(
                    "kubernetes_api_unreachable",
                    resource=self.resource,
                    error=f"{type(exc).__name__}: {exc}",
                    retry_in_s=backoff,
                    serving=self.serving(),
                )
            self.stopped.wait(backoff)
            backoff = min(backoff * 2, self._timing.max_backoff_seconds)

    def _list(self) -> str:
        function, args, selectors = self.list_call()
        result = function(*args, **selectors, _request_timeout=(CONNECT_TIMEOUT_SECONDS, LIST_TIMEOUT_SECONDS))
        if isinstance(result, dict):  # custom objects come as plain JSON
            items, version = result.get("items") or [], (result.get("metadata") or {}).get("resourceVersion")
        else:
            items, version = result.items or [], result.metadata and result.metadata.resource_version
        self.replace(list(items))
        if not version:
            raise ValueError(f"{self.resource} list without a resourceVersion: cannot watch from it")
        return str(version)

    def _watch_once(self, version: str) -> str:
        """One watch request; returns the version to resume from (events and bookmarks)."""
        function, args, selectors = self.list_call()
        timeout = self._timing.watch_timeout_seconds
        self._watch = current = watch.Watch()
        try:
            for event in current.stream(
                function,
                *args,
                **selectors,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout,
                # the client gives up one timeout later: a silently dead connection ends too
                _request_timeout=(CONNECT_TIMEOUT_SECONDS, timeout + CONNECT_TIMEOUT_SECONDS),
            ):
                if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                    self.apply(event["type"], event["object"])
        finally:
            self._watch = None
        return str(current.resource_version or version)


class _SliceLoop(ListWatchLoop):
    """The EndpointSlices of one Service; each change publishes the replicas they hold."""

    resource = "endpointslice"

    def __init__(self, source: KubernetesDiscovery, api_client: client.ApiClient, publish: Publish) -> None:
        super().__init__(source.timing)
        self._source = source
        self._api = client.DiscoveryV1Api(api_client)
        self._publish = publish
        self._slices: dict[str, Any] = {}
        self._published: dict[str, str] | None = None

    def list_call(self) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        selector = f"{SERVICE_NAME_LABEL}={self._source.service}"
        return self._api.list_namespaced_endpoint_slice, (self._source.namespace,), {"label_selector": selector}

    def replace(self, items: list[Any]) -> None:
        self._slices = {str(item.metadata.name): item for item in items if item.metadata}
        self._emit()

    def apply(self, kind: str, obj: Any) -> None:
        if kind == "DELETED":
            self._slices.pop(obj.metadata.name, None)
        else:
            self._slices[obj.metadata.name] = obj
        self._emit()

    def serving(self) -> list[str]:
        return sorted(self._published or {})

    def _emit(self) -> None:
        snapshot = snapshot_from_slices(self._slices.values(), self._source.port_name, self._source.keep_leaving)
        if snapshot == self._published:
            return
        log_change(self._published or {}, snapshot, service=f"{self._source.namespace}/{self._source.service}")
        self._published = snapshot
        self._publish(snapshot)


def log_change(previous: dict[str, str], snapshot: dict[str, str], **source: str) -> None:
    log.info(
        "replicas_changed",
        replicas=sorted(snapshot),
        added=sorted(set(snapshot) - set(previous)),
        removed=sorted(set(previous) - set(snapshot)),
        leaving=sorted(leaving_of(snapshot)),
        endpoints=dict(snapshot),
        **source,
    )
