"""The metrics port's HTTP server: Prometheus /metrics, and /livez and /readyz for probes that
speak neither gRPC health over TLS nor gRPC at all (the kubelet's gRPC probes are plaintext,
and the picker port may be TLS; the Admin API's port stays on loopback)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app


class Readiness:
    """What /readyz and the gRPC "readiness" service say: a replica is known and no drain began."""

    def __init__(self) -> None:
        self.replicas_known = False
        self.draining = False

    def ready(self) -> bool:
        return self.replicas_known and not self.draining


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Scrapes and probes are not logged (one line each, every few seconds)."""


def start_metrics_server(host: str, port: int, registry: CollectorRegistry, readiness: Readiness) -> WSGIServer:
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in ("/livez", "/readyz"):
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        ok = path == "/livez" or readiness.ready()
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
        return [b"ok\n" if ok else b"not ready\n"]

    server = make_server(host, port, app, _Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
