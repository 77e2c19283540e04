"""Graceful drain on SIGTERM, through real Envoy and the real service: a request in flight
finishes, health turns NOT_SERVING at once, the process exits 0 within service.drain_seconds.
(The pod's preStop hook against a real Envoy started with the pod's flags: tests/k8s/test_k8s_drain.py.)"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from extproc.bench.stub_upstream import BODY
from extproc.service.drain import drain, drain_envoy, main
from extproc.service.processor import SERVICE
from extproc.stack.processes import free_port, static_discovery
from tests.service.gateway_support import Gateway, chat, gateway, post, whole_records

URL = "/v1/chat/completions"
HEADERS = {"x-conversation-id": "c-drain", "x-turn": "1"}
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HeldUpstream(ThreadingHTTPServer):
    """A llama.cpp-shaped upstream that holds every request until ``release`` is set."""

    daemon_threads = True

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.release = threading.Event()
        super().__init__(("127.0.0.1", free_port()), _Held)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


class _Held(BaseHTTPRequestHandler):
    server: HeldUpstream
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.server.arrived.set()
        self.server.release.wait(60)
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[HeldUpstream]:
    server = HeldUpstream()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


def health(address: str, service: str) -> int:
    """The status a new health check gets (raises if the server does not answer at all)."""
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(reply.status)


def send_in_background(gw: Gateway) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def send() -> None:
        try:
            result["reply"] = post(gw.url + URL, chat("held"), HEADERS, timeout=60)
        except httpx.HTTPError as exc:
            result["error"] = exc

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, result


def log_events(gw: Gateway) -> dict[str, dict[str, Any]]:
    return {record["event"]: record for record in whole_records(gw.log) if record["event"].startswith("drain_")}


@pytest.mark.live
def test_sigterm_lets_the_request_in_flight_finish(tmp_path: Path, upstream: HeldUpstream) -> None:
    with gateway(tmp_path, static_discovery({"llm-0": upstream.address}), drain_seconds="60") as gw:
        service = gw.running[0].process
        thread, result = send_in_background(gw)
        assert upstream.arrived.wait(20), "the request never reached the upstream"
        service.send_signal(signal.SIGTERM)
        # new health checks: NOT_SERVING (readiness and liveness alike), while the process is
        # still there, waiting for the request it routed
        for name in (SERVICE, ""):
            status = health(gw.admin, name)
            while status != NOT_SERVING and service.poll() is None:
                status = health(gw.admin, name)
            assert status == NOT_SERVING, name
        assert service.poll() is None, "exited with a request in flight"
        upstream.release.set()
        thread.join(60)
        reply = result.get("reply")
        assert reply is not None and reply.status_code == 200, result
        assert reply.headers["x-routed-to"] == "llm-0" and reply.json() == httpx.Response(200, content=BODY).json()
        assert service.wait(timeout=60) == 0
    events = log_events(gw)
    assert events["drain_started"]["in_flight"] == 1 and events["drain_started"]["bound_seconds"] == 60
    assert events["drain_finished"]["left"] == 0 and "drain_timed_out" not in events


@pytest.mark.live
def test_a_request_that_never_ends_is_cut_off_at_the_bound(tmp_path: Path, upstream: HeldUpstream) -> None:
    with gateway(tmp_path, static_discovery({"llm-0": upstream.address}), drain_seconds="1") as gw:
        service = gw.running[0].process
        send_in_background(gw)
        assert upstream.arrived.wait(20), "the request never reached the upstream"
        service.send_signal(signal.SIGTERM)
        assert service.wait(timeout=30) == 0  # the bound (1 s) plus the server's stop, far below 30 s
    events = log_events(gw)
    assert events["drain_timed_out"]["left"] == 1 and events["drain_timed_out"]["seconds"] >= 1
    assert "drain_finished" not in events


def test_the_prestop_hook_survives_an_envoy_that_is_not_there(capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(OSError):
        drain_envoy(address)
    assert main(["--envoy-admin", address, "--wait-seconds", "0"]) == 0
    assert "Envoy's drain not started" in capsys.readouterr().err



def test_discovery_cannot_turn_a_draining_service_ready_again() -> None:
    """A replica change during the drain (discovery's health.set) leaves readiness NOT_SERVING."""
    servicer = health_aio.HealthServicer()
    left = [2]

    def in_flight() -> int:
        left[0] -= 1  # one request finishes per look
        return max(left[0], 0)

    async def scenario() -> tuple[int, int]:
        await servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        remaining = await drain(in_flight, servicer, bound_seconds=60)
        await servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)  # discovery, later
        reply = await servicer.Check(health_pb2.HealthCheckRequest(service=SERVICE), None)
        return remaining, reply.status

    assert asyncio.run(scenario()) == (0, NOT_SERVING)


def test_a_bad_prestop_option_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--envoy-admin", "127.0.0.1:9901", "--wait-seconds", "-1"])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and error.count("\n") == 1 and "--wait-seconds" in error and "must be >= 0" in error
