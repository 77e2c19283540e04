"""Live harness of the gateway tests: real Envoy, real `llm-ring serve`, stub or llama.cpp upstreams."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from extproc.service.admin_client import AdminClient
from extproc.stack.processes import Running, free_port, service_env, start_gateway_envoy, start_service


@dataclass
class Gateway:
    url: str
    admin: str  # the service's gRPC address (Admin, health)
    log: Path  # the service's stdout: structlog JSON lines
    endpoints_file: Path
    running: list[Running] = field(default_factory=list)

    def decisions(self) -> list[dict[str, Any]]:
        return [
            record
            for line in self.log.read_text().splitlines()
            if line.startswith("{") and (record := json.loads(line)).get("event") == "route_decision"
        ]

    def state(self) -> dict[str, Any]:
        with AdminClient(self.admin) as admin:
            return admin.state()

    def wait_idle(self, timeout: float = 5.0) -> dict[str, Any]:
        """The state once nothing is in flight (or the last state seen at the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state()
            if state["in_flight_requests"] == 0 or time.monotonic() > deadline:
                return state
            time.sleep(0.05)


@contextmanager
def gateway(
    workdir: Path, discovery: Mapping[str, str], fail_open: bool = True, envoy_idle_timeout_s: int | None = None,
    **service: str,
) -> Iterator[Gateway]:
    """`llm-ring serve` + Envoy rendered by render_envoy_config; everything stopped on exit."""
    endpoints_file = workdir / "eds" / "replicas.json"
    listen = f"127.0.0.1:{free_port()}"
    started: list[Running] = []
    try:
        settings = {"health_probe_seconds": "0.2", "log_level": '"debug"', **service}
        started.append(start_service(workdir / "service", service_env(listen, endpoints_file, discovery, **settings)))
        _wait_for(endpoints_file.exists, 5.0)
        idle = {"stream_idle_timeout_s": envoy_idle_timeout_s} if envoy_idle_timeout_s else {}
        envoy = start_gateway_envoy(workdir / "envoy", started[0].ext_proc, endpoints_file, fail_open, 1, **idle)
        started.append(envoy)
        gw = Gateway(f"http://{envoy.listen}", listen, started[0].log_path, endpoints_file, started)
        _wait_for(lambda: _has_endpoints(envoy.address), 5.0)
        yield gw
    finally:
        for running in reversed(started):
            running.stop()


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def post(url: str, body: Any, headers: Mapping[str, str] | None = None, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(url, json=body, headers=dict(headers or {}), timeout=timeout)


def accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _has_endpoints(admin: str) -> bool:
    try:
        text = httpx.get(f"http://{admin}/clusters", timeout=1.0).text
    except httpx.HTTPError:
        return False
    return "replicas::" in text and "::cx_active::" in text


def _wait_for(condition: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met after {timeout}s")
        time.sleep(0.05)
