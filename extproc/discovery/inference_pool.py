"""Replica discovery from a Gateway API Inference Extension ``InferencePool`` (list + watch).

The pool (``inference.networking.k8s.io/v1``, ``[discovery.inference-pool] name`` in its ``namespace``)
says which pods serve it (``spec.selector.matchLabels``, same namespace) and on which ports
(``spec.targetPorts``). The replicas are its pods that are Ready and not terminating (no
``deletionTimestamp``); a pod being deleted that is still Ready (its preStop drain runs) stays
listed as leaving while ``discovery.leaving_seconds`` > 0, as a terminating EndpointSlice
endpoint does (kubernetes.py); with 0 it leaves at once.

Each target port is a replica of its own, as the CRD says ("every port will be treated as a
distinctive endpoint"): the first is named after the pod (``llm-0``), so that a replica keeps
its place on the hash ring across restarts and IP changes; the n-th after it ``<pod>-rank-<n>``,
as the reference picker names them (gateway-api-inference-extension,
pkg/lwepp/datastore/datastore.go, createEndpointNamespacedName, commit 84436a96).

Two list/watch loops (watch.py's, each in its thread) feed one state: the pool, watched
by name (fieldSelector metadata.name, so that RBAC can grant this one pool through
resourceNames), and every pod of the namespace, as the reference picker caches them
(pkg/lwepp/server/controller_manager.go): a changed selector or port list takes effect at
once, without a new pod watch. A deleted pool leaves no replicas until it is created again.
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import structlog
from kubernetes import client
from pydantic import Field

from extproc.discovery import Snapshot
from extproc.discovery.plugin import SharedKeys, SourcePlugin
from extproc.discovery.watch import ListWatchLoop, Publish, WatchedSource, WatchSettings, log_change, threaded_snapshots

log = structlog.get_logger("extproc.discovery.inference_pool")

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
PLURAL = "inferencepools"


# ----------------------------------------------------------------------------- core


class InferencePoolSettings(WatchSettings):
    """[discovery.inference-pool]: the pool ``name`` and its pods, in ``namespace``."""

    name: str = Field(description="the InferencePool whose Ready pods, at its targetPorts, are the replicas")


def replicas_from_pool(pool: Mapping[str, Any] | None, pods: Iterable[Any], keep_leaving: bool = False) -> Snapshot:
    """Map an InferencePool (its JSON) and pods (client models) to {replica name: "ip:port"}:
    its Ready pods and, with ``keep_leaving``, those being deleted while still Ready (leaving)."""
    if pool is None:
        return Snapshot()
    selector, ports = pool_targets(pool)
    replicas: dict[str, str] = {}
    leaving: set[str] = set()
    for pod in pods:
        labels = pod.metadata.labels or {}
        deleted = pod.metadata.deletion_timestamp is not None
        if not selector.items() <= labels.items() or not _ready(pod) or (deleted and not keep_leaving):
            continue
        host = _pod_host(pod)
        if host is None:
            continue
        for rank, port in enumerate(ports):
            name = pod.metadata.name if rank == 0 else f"{pod.metadata.name}-rank-{rank}"
            replicas[name] = f"{host}:{port}"
            if deleted:
                leaving.add(name)
    return Snapshot({name: replicas[name] for name in sorted(replicas)}, leaving)


class InvalidPoolError(ValueError):
    """The pool lacks what the CRD requires (the API server would not have stored it)."""


def pool_targets(pool: Mapping[str, Any]) -> tuple[dict[str, str], list[int]]:
    """The pool's pod selector and target ports."""
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels")
    ports = [p.get("number") for p in spec.get("targetPorts") or ()]
    if not isinstance(labels, dict) or not labels:
        raise InvalidPoolError("spec.selector.matchLabels is missing or empty")
    if not ports or not all(isinstance(p, int) and 0 < p < 65536 for p in ports):
        raise InvalidPoolError(f"spec.targetPorts must hold port numbers, got {ports!r}")
    return {str(k): str(v) for k, v in labels.items()}, ports


def _ready(pod: Any) -> bool:
    """Its Ready condition true (with no deletionTimestamp: the reference picker's IsPodReady,
    pkg/lwepp/util/pod/pod.go)."""
    conditions = (pod.status and pod.status.conditions) or ()
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def _pod_host(pod: Any) -> str | None:
    """The pod's address, IPv4 first on a dual-stack pod; IPv6 in brackets."""
    status = pod.status
    addresses = [a.ip for a in status.pod_ips or () if a.ip] or ([status.pod_ip] if status.pod_ip else [])
    parsed = []
    for address in addresses:
        try:
            parsed.append(ipaddress.ip_address(address))
        except ValueError:
            continue
    if not parsed:
        return None
    best = min(parsed, key=lambda ip: ip.version)
    return str(best) if best.version == 4 else f"[{best}]"


# ----------------------------------------------------------------------------- shell


class InferencePoolDiscovery(WatchedSource):
    """Discovery protocol: ``snapshots()`` yields {replica: "ip:port"} on every change of the
    pool or of its pods (two watch threads)."""

    def __init__(self, section: InferencePoolSettings, shared: SharedKeys,
                 api_client: client.ApiClient | None = None, **timing: Any) -> None:
        super().__init__(section, shared, api_client, **timing)
        self.pool = section.name

    def snapshots(self) -> AsyncIterator[dict[str, str]]:
        def start(api_client: client.ApiClient, publish: Publish) -> list[ListWatchLoop]:
            state = _PoolState(f"{self.namespace}/{self.pool}", publish, self.keep_leaving)
            return [_PoolLoop(self, api_client, state), _PodLoop(self, api_client, state)]

        return threaded_snapshots(self._api_client, start)


class _PoolState:
    """The pool and the pods as the two loops last saw them; each change publishes the replicas,
    from the moment both have listed once (before, half the state would publish a false set)."""

    def __init__(self, pool_name: str, publish: Publish, keep_leaving: bool) -> None:
        self._name = pool_name
        self._publish = publish
        self._keep_leaving = keep_leaving
        self._lock = threading.Lock()  # two writer threads
        self._pool: dict[str, Any] | None = None
        self._pods: dict[str, Any] = {}
        self._listed: set[str] = set()  # "pool", "pods": which have listed once
        self._published: dict[str, str] | None = None

    def set_pool(self, pool: dict[str, Any] | None, *, listed: bool = False) -> None:
        if pool is not None:
            try:
                pool_targets(pool)
            except InvalidPoolError as exc:
                log.warning("inference_pool_invalid", pool=self._name, problem=str(exc), action="no replicas")
                pool = None
        with self._lock:
            self._pool = pool
            if listed:
                self._listed.add("pool")
            self._emit()

    def replace_pods(self, pods: Iterable[Any]) -> None:
        with self._lock:
            self._pods = {str(pod.metadata.name): pod for pod in pods if pod.metadata}
            self._listed.add("pods")
            self._emit()

    def apply_pod(self, kind: str, pod: Any) -> None:
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(pod.metadata.name, None)
            else:
                self._pods[pod.metadata.name] = pod
            self._emit()

    def serving(self) -> list[str]:
        with self._lock:
            return sorted(self._published or {})

    def _emit(self) -> None:
        if len(self._listed) < 2:
            return
        snapshot = replicas_from_pool(self._pool, self._pods.values(), self._keep_leaving)
        if snapshot == self._published:
            return
        log_change(self._published or {}, snapshot, inference_pool=self._name)
        self._published = snapshot
        self._publish(snapshot)


class _PoolLoop(ListWatchLoop):
    """The one InferencePool, by name: list/watch with fieldSelector metadata.name."""

    resource = "inferencepool"

    def __init__(self, source: InferencePoolDiscovery, api_client: client.ApiClient, state: _PoolState) -> None:
        super().__init__(source.timing)
        self._source = source
        self._api = client.CustomObjectsApi(api_client)
        self._state = state

    def list_call(self) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        return (
            self._api.list_namespaced_custom_object,
            (GROUP, VERSION, self._source.namespace, PLURAL),
            {"field_selector": f"metadata.name={self._source.pool}"},
        )

    def replace(self, items: list[Any]) -> None:
        pool = next((item for item in items if item["metadata"]["name"] == self._source.pool), None)
        if pool is None:
            log.warning("inference_pool_missing", pool=f"{self._source.namespace}/{self._source.pool}")
        self._state.set_pool(pool, listed=True)

    def apply(self, kind: str, obj: Any) -> None:
        self._state.set_pool(None if kind == "DELETED" else obj)

    def serving(self) -> list[str]:
        return self._state.serving()


class _PodLoop(ListWatchLoop):
    """Every pod of the namespace; the pool's selector picks among them."""

    resource = "pod"

    def __init__(self, source: InferencePoolDiscovery, api_client: client.ApiClient, state: _PoolState) -> None:
        super().__init__(source.timing)
        self._source = source
        self._api = client.CoreV1Api(api_client)
        self._state = state

    def list_call(self) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        return self._api.list_namespaced_pod, (self._source.namespace,), {}

    def replace(self, items: list[Any]) -> None:
        self._state.replace_pods(items)

    def apply(self, kind: str, obj: Any) -> None:
        self._state.apply_pod(kind, obj)

    def serving(self) -> list[str]:
        return self._state.serving()


PLUGIN = SourcePlugin("inference-pool", InferencePoolSettings, InferencePoolDiscovery)
