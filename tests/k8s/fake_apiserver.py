"""A small fake Kubernetes API server for the discovery tests (EndpointSlices, InferencePools, pods).

It speaks the real HTTP/JSON wire protocol of the parts the router uses, so the
official ``kubernetes`` client talks to it unmodified:

- ``GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices``,
  ``/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools`` and
  ``/api/v1/namespaces/{ns}/pods``: get, list (returns the
  current resourceVersion) and ``?watch=true`` (chunked JSON event lines from a given
  resourceVersion, ``timeoutSeconds``, ``BOOKMARK`` events when ``allowWatchBookmarks``);
  a watch from a version older than the compaction point gets HTTP 200 and an ``ERROR``
  event with a 410 ``Expired`` Status, as the real server does;
- equality label selectors (``a=b,c=d``) and the field selector ``metadata.name=<name>``;
- bearer tokens: an unknown token gets 401; a known one is authorised by RBAC rules
  (apiGroups/resources/verbs/resourceNames, namespaced Roles), else 403 with a Status naming
  the user; as the real authoriser does, a rule with resourceNames allows a list or watch only
  when its ``metadata.name`` field selector names one of them; an "admin" token may do everything;
- a few other paths (services, secrets, endpoints, cluster-wide endpointslices) only
  so that authorisation can be checked on them;
- HTTPS when started with a TLS context (the in-cluster path: CA file + token file);
- ``stop()``/``start()``: the API vanishes (listener closed, open streams cut) and
  comes back on the same port with the same state, like an apiserver restart over etcd.

What it does NOT model: client certificates, authentication webhooks, the real
authoriser (ClusterRoles, aggregation, impersonation), admission and CRD schema validation
(tests validate their InferencePools against the vendored CRD schema), the
watch cache's periodic bookmarks (bookmarks are sent only when a test asks), object
labels changing out of a selector during a watch (no synthetic DELETED), set-based
selectors, other field selectors, pagination (limit/continue), list resourceVersion
semantics (a list always returns the latest state), resourceVersionMatch,
sendInitialEvents/streaming lists, protobuf, HTTP/2, rate limiting (429) and
priority-and-fairness, and the EndpointSlice controller itself: tests write the
slices that the controller would write, and the kubelet: tests write pod statuses.
"""

from __future__ import annotations

import contextlib
import copy
import json
import queue
import re
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

ADMIN = "admin"
_CLOSE = object()  # queued to a watch stream to end it
_PATHS = [
    # (regex, api group, resource); group "" is the core group
    (
        re.compile(r"^/apis/discovery\.k8s\.io/v1/namespaces/([^/]+)/endpointslices(?:/([^/]+))?$"),
        "discovery.k8s.io",
        "endpointslices",
    ),
    (re.compile(r"^/apis/discovery\.k8s\.io/v1/endpointslices()(?:/([^/]+))?$"), "discovery.k8s.io", "endpointslices"),
    (
        re.compile(r"^/apis/inference\.networking\.k8s\.io/v1/namespaces/([^/]+)/inferencepools(?:/([^/]+))?$"),
        "inference.networking.k8s.io",
        "inferencepools",
    ),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/(pods|services|secrets|endpoints)(?:/([^/]+))?$"), "", None),
]
# what the fake stores and serves: kind -> (resource, apiVersion)
_STORED = {
    "EndpointSlice": ("endpointslices", "discovery.k8s.io/v1"),
    "InferencePool": ("inferencepools", "inference.networking.k8s.io/v1"),
    "Pod": ("pods", "v1"),
}
_RESOURCES = {resource: (kind, api_version) for kind, (resource, api_version) in _STORED.items()}


@dataclass(frozen=True)
class Rule:
    api_groups: frozenset[str]
    resources: frozenset[str]
    verbs: frozenset[str]
    resource_names: frozenset[str] = frozenset()  # empty: every name

    def allows(self, group: str, resource: str, verb: str, name: str | None) -> bool:
        return (
            (group in self.api_groups or "*" in self.api_groups)
            and (resource in self.resources or "*" in self.resources)
            and (verb in self.verbs or "*" in self.verbs)
            and (not self.resource_names or name in self.resource_names)
        )


@dataclass(frozen=True)
class Identity:
    user: str
    rules: tuple[tuple[str, Rule], ...] = ()  # (namespace of the Role, rule)


def identity_from_manifests(docs: Iterable[Mapping[str, Any]], namespace: str, account: str) -> Identity:
    """The RBAC rules that RoleBindings in ``docs`` grant to ServiceAccount ``account``."""
    docs = list(docs)
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs if d["kind"] == "Role"}
    rules: list[tuple[str, Rule]] = []
    for binding in (d for d in docs if d["kind"] == "RoleBinding"):
        bound_ns = binding["metadata"]["namespace"]
        subjects = binding.get("subjects", [])
        if not any(
            s["kind"] == "ServiceAccount" and s["name"] == account and s.get("namespace", bound_ns) == namespace
            for s in subjects
        ):
            continue
        ref = binding["roleRef"]
        if ref["kind"] != "Role":  # ClusterRoles are not modelled
            continue
        role = roles.get((bound_ns, ref["name"]))
        for rule in (role or {}).get("rules", []):
            rules.append(
                (
                    bound_ns,
                    Rule(
                        frozenset(rule.get("apiGroups", [])),
                        frozenset(rule.get("resources", [])),
                        frozenset(rule.get("verbs", [])),
                        frozenset(rule.get("resourceNames", [])),
                    ),
                )
            )
    return Identity(f"system:serviceaccount:{namespace}:{account}", tuple(rules))


@dataclass
class Endpoint:
    pod: str
    ip: str
    ready: bool | None = True
    terminating: bool | None = False


def endpoint_slice(
    name: str,
    service: str,
    endpoints: Iterable[Endpoint],
    *,
    namespace: str = "llm-ring",
    port_name: str = "http",
    port: int = 8080,
    address_type: str = "IPv4",
) -> dict[str, Any]:
    """An EndpointSlice as the EndpointSlice controller writes it for a Service's pods."""
    items = []
    for e in endpoints:
        conditions = {
            k: v
            for k, v in (("ready", e.ready), ("serving", e.ready or e.terminating), ("terminating", e.terminating))
            if v is not None
        }
        items.append(
            {
                "addresses": [e.ip],
                "conditions": conditions,
                "nodeName": "worker",
                "targetRef": {"kind": "Pod", "namespace": namespace, "name": e.pod, "uid": f"uid-{e.pod}"},
            }
        )
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": address_type,
        "endpoints": items,
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }


def pod(
    name: str,
    ip: str | None,
    labels: Mapping[str, str],
    *,
    ready: bool = True,
    deleting: bool = False,
    namespace: str = "llm-ring",
    ports: Iterable[int] = (8080,),
) -> dict[str, Any]:
    """A Pod as the kubelet reports it: scheduled, running, Ready or not; ``deleting``: its
    deletionTimestamp is set (terminating, still running its preStop)."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels), "uid": f"uid-{name}"}
    if deleting:
        metadata |= {"deletionTimestamp": "2026-01-01T00:00:00Z", "deletionGracePeriodSeconds": 60}
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Initialized", "status": "True"},
            {"type": "ContainersReady", "status": str(ready)},
            {"type": "Ready", "status": str(ready)},
        ],
    }
    if ip is not None:
        status |= {"podIP": ip, "podIPs": [{"ip": ip}]}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "containers": [
                {
                    "name": "llama",
                    "image": "ghcr.io/ggml-org/llama.cpp:server",
                    "ports": [{"containerPort": port, "protocol": "TCP"} for port in ports],
                }
            ]
        },
        "status": status,
    }


def inference_pool(
    name: str, match_labels: Mapping[str, str], ports: Iterable[int], *, namespace: str = "llm-ring"
) -> dict[str, Any]:
    """An InferencePool (inference.networking.k8s.io/v1) whose picker is the Service ``<name>-picker``."""
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": dict(match_labels)},
            "targetPorts": [{"number": port} for port in ports],
            "endpointPickerRef": {"name": f"{name}-picker", "port": {"number": 9002}},
        },
    }


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    verb: str
    status: int


@dataclass(frozen=True)
class Query:
    """What a list or watch asks for: a resource, in a namespace (None: all), by labels, by name."""

    resource: str
    namespace: str | None
    labels: Mapping[str, str]
    name: str | None = None

    def matches(self, obj: Mapping[str, Any]) -> bool:
        meta = obj["metadata"]
        if _STORED[obj["kind"]][0] != self.resource:
            return False
        if self.namespace is not None and meta["namespace"] != self.namespace:
            return False
        if self.name is not None and meta["name"] != self.name:
            return False
        labels = meta.get("labels") or {}
        return all(labels.get(k) == v for k, v in self.labels.items())


@dataclass
class _Watcher:
    query: Query
    bookmarks: bool
    events: queue.Queue[Any] = field(default_factory=queue.Queue)


class FakeApiServer:
    def __init__(self, identities: Mapping[str, Identity]) -> None:
        self.identities = dict(identities)  # bearer token -> identity (ADMIN allows all)
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (resource, namespace, name)
        self._history: list[tuple[int, str, dict[str, Any]]] = []
        self._version = 100
        self._compacted = 0  # a watch from a version below this gets 410 Gone
        self._watchers: list[_Watcher] = []
        self._connections: set[socket.socket] = set()
        self._admitting = threading.Event()  # cleared: new watch requests wait
        self._admitting.set()
        self._server: ThreadingHTTPServer | None = None
        self._serving = False  # False while stopped: a request a stopping server still took opens no watch
        self._thread: threading.Thread | None = None
        self.port = 0
        self.scheme = "http"

    # ------------------------------------------------------------------ lifecycle
    def start(self, tls: ssl.SSLContext | None = None) -> FakeApiServer:
        """Serve plain HTTP, or HTTPS with ``tls`` (a server-side context), on 127.0.0.1."""
        handler = type("Handler", (_Handler,), {"api": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self._server.daemon_threads = True
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self.scheme = "https" if tls is not None else "http"
        self.port = self._server.server_address[1]
        self._serving = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-apiserver", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """The API vanishes: no listener, every open connection cut."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            self._serving = False
            for watcher in self._watchers:
                watcher.events.put(_CLOSE)
            for conn in list(self._connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        assert self._thread is not None
        self._thread.join(5)
        self._server = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ state changes
    def apply(self, obj: Mapping[str, Any]) -> int:
        """Create or replace an EndpointSlice, InferencePool or Pod (by kind, namespace, name)."""
        obj = copy.deepcopy(dict(obj))
        meta = obj["metadata"]
        key = (_STORED[obj["kind"]][0], meta["namespace"], meta["name"])
        with self._lock:
            kind = "MODIFIED" if key in self._objects else "ADDED"
            return self._record(kind, key, obj)

    def delete(self, namespace: str, name: str, kind: str = "EndpointSlice") -> int:
        key = (_STORED[kind][0], namespace, name)
        with self._lock:
            return self._record("DELETED", key, copy.deepcopy(self._objects[key]))

    def bookmark(self) -> int:
        """Send a BOOKMARK with the current version to every watch that asked for them."""
        with self._lock:
            event = {
                "type": "BOOKMARK",
                "object": {
                    "metadata": {"resourceVersion": str(self._version)},
                },
            }
            for watcher in self._watchers:
                if watcher.bookmarks:
                    kind, api_version = _RESOURCES[watcher.query.resource]
                    watcher.events.put(event | {"object": event["object"] | {"kind": kind, "apiVersion": api_version}})
            return self._version

    def compact(self) -> int:
        """Forget the event history: watches from any earlier version now get 410 Gone."""
        with self._lock:
            self._history.clear()
            self._compacted = self._version
            return self._version

    def end_watches(self) -> None:
        """End every open watch normally (as when its timeoutSeconds runs out)."""
        with self._lock:
            for watcher in self._watchers:
                watcher.events.put(_CLOSE)

    def hold_watches(self) -> None:
        """New watch requests wait (up to 10 s) until release_watches(): lets a test change
        state while the client has no watch open, e.g. to force a 410 on its next watch."""
        self._admitting.clear()

    def release_watches(self) -> None:
        self._admitting.set()

    def watch_count(self) -> int:
        with self._lock:
            return len(self._watchers)

    def _record(self, kind: str, key: tuple[str, str, str], obj: dict[str, Any]) -> int:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)
        if kind == "DELETED":
            del self._objects[key]
        else:
            self._objects[key] = obj
        self._history.append((self._version, kind, obj))
        event = {"type": kind, "object": obj}
        for watcher in self._watchers:
            if watcher.query.matches(obj):
                watcher.events.put(event)
        return self._version

    # ------------------------------------------------------------------ requests
    def authorize(
        self, token: str | None, namespace: str | None, group: str, resource: str, verb: str, name: str | None = None
    ) -> tuple[int, dict[str, Any] | None]:
        """``name``: the object's (get, delete) or the metadata.name field selector's (list, watch)."""
        identity = self.identities.get(token or "")
        if token == ADMIN:
            return 200, None
        if identity is None:
            return 401, _status(401, "Unauthorized", "Unauthorized")
        for rule_ns, rule in identity.rules:
            if rule_ns == namespace and rule.allows(group, resource, verb, name):
                return 200, None
        where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
        full = f"{resource}.{group}" if group else resource
        message = (
            f'{full} is forbidden: User "{identity.user}" cannot {verb} resource "{resource}" '
            f'in API group "{group}"{where}'
        )
        return 403, _status(403, "Forbidden", message, {"group": group, "kind": resource})

    def list_body(self, query: Query) -> dict[str, Any]:
        with self._lock:
            items = [copy.deepcopy(o) for o in self._objects.values() if query.matches(o)]
            kind, api_version = _RESOURCES[query.resource]
            return {
                "kind": f"{kind}List",
                "apiVersion": api_version,
                "metadata": {"resourceVersion": str(self._version)},
                "items": items,
            }

    def open_watch(
        self, query: Query, since: str | None, bookmarks: bool
    ) -> tuple[_Watcher | None, list[dict[str, Any]]]:
        """Register a watch; returns it and the backlog, or (None, [410 ERROR event])."""
        self._admitting.wait(10)
        with self._lock:
            if not self._serving:
                return None, []
            if since in (None, "", "0"):
                backlog = [
                    {"type": "ADDED", "object": copy.deepcopy(o)}
                    for o in self._objects.values()
                    if query.matches(o)
                ]
            else:
                version = int(since)
                if version < self._compacted:
                    error = _status(410, "Expired", f"too old resource version: {version} ({self._compacted})")
                    return None, [{"type": "ERROR", "object": error}]
                backlog = [
                    {"type": kind, "object": copy.deepcopy(obj)}
                    for v, kind, obj in self._history
                    if v > version and query.matches(obj)
                ]
            watcher = _Watcher(query, bookmarks)
            self._watchers.append(watcher)
            return watcher, backlog

    def close_watch(self, watcher: _Watcher) -> None:
        with self._lock:
            self._watchers.remove(watcher)


def _peer_closed(conn: socket.socket) -> bool:
    """True once the client has closed its end (the real server notices too)."""
    if isinstance(conn, ssl.SSLSocket):  # no MSG_PEEK over TLS: noticed at the next write
        return False
    readable, _, _ = select.select([conn], [], [], 0)
    if not readable:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    status = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        status["details"] = details
    return status


def _selector(text: str) -> dict[str, str]:
    pairs = [part.split("=", 1) for part in text.split(",") if part]
    if any(len(p) != 2 or p[0].endswith("!") for p in pairs):
        raise ValueError(f"only equality selectors are modelled: {text!r}")
    return {k.strip(): v.strip().lstrip("=") for k, v in pairs}


def _field_name(text: str) -> str | None:
    """The name a ``metadata.name=<name>`` field selector asks for (the only one modelled)."""
    if not text:
        return None
    key, sep, value = text.partition("=")
    if key.strip() != "metadata.name" or not sep or "," in value:
        raise ValueError(f"only the field selector metadata.name=<name> is modelled: {text!r}")
    return value.strip().lstrip("=")


class _Handler(BaseHTTPRequestHandler):
    api: FakeApiServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
        pass

    def setup(self) -> None:
        super().setup()
        with self.api._lock:
            self.api._connections.add(self.connection)

    def finish(self) -> None:
        with self.api._lock:
            self.api._connections.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._serve("DELETE")

    def _serve(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if method in ("POST", "DELETE") and int(self.headers.get("Content-Length") or 0):
            self.rfile.read(int(self.headers["Content-Length"]))
        route = next(((p.match(url.path), g, r) for p, g, r in _PATHS if p.match(url.path)), None)
        if route is None:
            missing = _status(404, "NotFound", "the server could not find the requested resource")
            return self._reply(method, url.path, query, "", 404, missing)
        match, group, resource = route
        groups = match.groups()
        namespace = groups[0] or None
        resource = resource or groups[1]
        name = groups[-1]
        watching = query.get("watch") in ("true", "1")
        verb = {"POST": "create", "DELETE": "delete"}.get(method) or (
            "get" if name else "watch" if watching else "list"
        )
        auth = self.headers.get("Authorization", "")
        scheme, _, credentials = auth.partition(" ")
        token = credentials.strip() if scheme.lower() == "bearer" else None  # the scheme is case-insensitive
        field_name = _field_name(query.get("fieldSelector", ""))
        code, denial = self.api.authorize(token, namespace, group, resource, verb, name or field_name)
        if denial is not None:
            return self._reply(method, url.path, query, verb, code, denial)
        if resource not in _RESOURCES or method != "GET":
            kind = "List" if not name else resource
            return self._reply(
                method, url.path, query, verb, 200, {"kind": kind, "apiVersion": "v1", "metadata": {}, "items": []}
            )
        wanted = Query(resource, namespace, _selector(query.get("labelSelector", "")), name or field_name)
        if verb == "list":
            return self._reply(method, url.path, query, verb, 200, self.api.list_body(wanted))
        if verb == "get":
            items = self.api.list_body(wanted)["items"]
            if not items:
                return self._reply(method, url.path, query, verb, 404, _status(404, "NotFound", f"{name} not found"))
            return self._reply(method, url.path, query, verb, 200, items[0])
        self._watch(url.path, query, wanted)

    def _reply(
        self, method: str, path: str, query: dict[str, str], verb: str, code: int, body: Mapping[str, Any]
    ) -> None:
        self.api.requests.append(Request(method, path, query, verb, code))
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _watch(self, path: str, query: dict[str, str], wanted: Query) -> None:
        watcher, backlog = self.api.open_watch(
            wanted, query.get("resourceVersion"), query.get("allowWatchBookmarks") in ("true", "1")
        )
        self.api.requests.append(Request("GET", path, query, "watch", 200))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        deadline = time.monotonic() + float(query.get("timeoutSeconds", 60))
        try:
            for event in backlog:
                self._chunk(event)
            while watcher is not None and (left := deadline - time.monotonic()) > 0:
                try:
                    event = watcher.events.get(timeout=min(left, 0.1))
                except queue.Empty:
                    if _peer_closed(self.connection):
                        break
                    continue
                if event is _CLOSE:
                    break
                self._chunk(event)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:  # the client went away or the server was stopped
            self.close_connection = True
        finally:
            if watcher is not None:
                self.api.close_watch(watcher)

    def _chunk(self, event: Mapping[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()
