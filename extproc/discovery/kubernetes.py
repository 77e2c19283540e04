"""Replica discovery from Kubernetes EndpointSlices (list + watch, official client: watch.py).

The replicas are the ready, not terminating endpoints of the EndpointSlices labelled
``kubernetes.io/service-name=<service>``, named after their pods (``llm-0``, ``llm-1``, …)
so that a replica keeps its place on the hash ring across restarts and IP changes.
A terminating endpoint that still serves (its pod's preStop drain runs) stays listed as
leaving (``Snapshot.leaving``) while ``discovery.leaving_seconds`` > 0: the router sends it no
new conversation, only follow-ups whose cache has not moved yet; with 0 it leaves at once.
One list/watch loop (watch.py) follows the Service's slices.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from pydantic import Field

from extproc.discovery import Snapshot
from extproc.discovery.plugin import SharedKeys, SourcePlugin
from extproc.discovery.watch import ListWatchLoop, Publish, WatchedSource, WatchSettings, log_change, threaded_snapshots

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


# ----------------------------------------------------------------------------- core


class KubernetesSettings(WatchSettings):
    """[discovery.kubernetes]: the EndpointSlices of a Service in ``namespace``, port by name."""

    service: str = Field(description="EndpointSlices labelled kubernetes.io/service-name=<this>")
    port_name: str = Field(description="named port of the replicas in the EndpointSlice")


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


class KubernetesDiscovery(WatchedSource):
    """Discovery protocol: ``snapshots()`` yields {replica: "ip:port"} on every change of the
    Service's EndpointSlices (one watch thread)."""

    def __init__(self, section: KubernetesSettings, shared: SharedKeys, api_client: client.ApiClient | None = None,
                 **timing: Any) -> None:
        super().__init__(section, shared, api_client, **timing)
        self.service = section.service
        self.port_name = section.port_name

    def snapshots(self) -> AsyncIterator[dict[str, str]]:
        return threaded_snapshots(self._api_client, lambda api, publish: [_SliceLoop(self, api, publish)])


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


PLUGIN = SourcePlugin("kubernetes", KubernetesSettings, KubernetesDiscovery)
