"""The gateway through real Envoy and the real service, in front of stub upstreams (fast):
bad input, forged headers, Endpoint Picker headers, fail-open, a dead replica."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from extproc.bench.stubs import start_stub_upstream
from extproc.envoy.contract import write_endpoints_file
from extproc.routing import reasons
from extproc.stack.processes import (
    Running,
    StartError,
    free_port,
    service_env,
    start_gateway_envoy,
    start_service,
    static_discovery,
)
from tests.service.gateway_support import Gateway, chat, error_message, gateway, post

pytestmark = pytest.mark.live
URL = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[int], Running]]:
    ports = [free_port() for _ in range(4)]  # 3 replicas + 1 outsider no request may reach
    running = start_stub_upstream(ports, tmp_path_factory.mktemp("stubs"))
    yield ports, running
    running.stop()


@pytest.fixture(scope="module")
def gw(stubs: tuple[list[int], Running], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    ports, _ = stubs
    replicas = {f"llm-{i}": f"127.0.0.1:{port}" for i, port in enumerate(ports[:3])}
    with gateway(tmp_path_factory.mktemp("gw"), static_discovery(replicas)) as running:
        yield running


def test_routes_and_answers_with_endpoint_picker_headers(gw: Gateway, stubs: tuple[list[int], Running]) -> None:
    ports, _ = stubs
    reply = post(gw.url + URL, chat("hello"), {"x-conversation-id": "c-1", "x-turn": "1"})
    assert reply.status_code == 200
    assert reply.headers["x-routed-to"] in {"llm-0", "llm-1", "llm-2"}
    assert reply.headers["x-route-reason"] in reasons()
    served = reply.headers["x-gateway-destination-endpoint-served"]
    assert served == f"127.0.0.1:{ports[int(reply.headers['x-routed-to'][-1])]}"
    again = post(gw.url + URL, chat("hello"), {"x-conversation-id": "c-1", "x-turn": "2"})
    assert again.headers["x-routed-to"] == reply.headers["x-routed-to"]
    record = _decision(gw, reply.headers["x-request-id"])
    assert record["conversation"] == "c-1" and record["turn"] == "1" and record["outcome"] == "ok"
    assert record["trace"]["policy"] == "llm-aware" and "predicted_cached_tokens" in record
    assert record["cache_n"] == 3 and record["prompt_n"] == 5  # the stub's timings, read from the body


@pytest.mark.parametrize(
    ("send", "status", "says"),
    [
        (
            lambda url: httpx.post(url + URL, content=b'{"messages": [', headers={"content-type": "application/json"}),
            400,
            "not valid JSON",
        ),
        (
            lambda url: httpx.post(url + URL, content=b"hello", headers={"content-type": "text/plain"}),
            415,
            "text/plain",
        ),
        (
            lambda url: httpx.post(url + URL, content=b"", headers={"content-type": "application/json"}),
            400,
            "empty body",
        ),
        (lambda url: httpx.post(url + URL, json={"messages": []}), 400, "'messages'"),
        (lambda url: httpx.post(url + URL, json=[1, 2]), 400, "JSON object"),
        (lambda url: httpx.post(url + "/completion", json={"prompt": 3}), 400, "'prompt'"),
        (lambda url: httpx.post(url + URL, json={**chat("x"), "max_tokens": "many"}), 400, "'max_tokens'"),
        (lambda url: httpx.get(url + URL), 405, "takes POST"),
        (lambda url: httpx.post(url + "/v1/embeddings", json={"input": "x"}), 404, "unknown path"),
        (
            lambda url: httpx.post(
                url + URL,
                content=b"{" + b" " * (10 << 20) + b"}",
                headers={"content-type": "application/json"},
                timeout=30,
            ),
            413,
            "bytes",
        ),
    ],
    ids=[
        "malformed-json",
        "text-plain",
        "empty",
        "no-messages",
        "not-object",
        "bad-prompt",
        "bad-max-tokens",
        "get",
        "unknown-path",
        "10MB",
    ],
)
def test_bad_input_gets_a_clear_json_error_and_the_service_keeps_serving(
    gw: Gateway, send, status: int, says: str
) -> None:
    before = gw.state()["decisions"]
    reply = send(gw.url)
    assert reply.status_code == status, reply.text
    assert says in error_message(reply.json())
    assert gw.state()["decisions"] == before  # refused before routing: nothing charged
    assert post(gw.url + URL, chat("still there?")).status_code == 200


def test_missing_headers_route_on_the_conversation_opening(gw: Gateway) -> None:
    """No x-conversation-id, no x-turn, no content-type: the key is a hash of the opening."""
    opening = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me about ducks"}]
    turn1 = httpx.post(gw.url + URL, content=httpx.Request("POST", "/", json={"messages": opening}).content)
    turn2 = post(
        gw.url + URL,
        {"messages": [*opening, {"role": "assistant", "content": "quack"}, {"role": "user", "content": "more"}]},
    )
    assert turn1.status_code == turn2.status_code == 200
    assert turn1.headers["x-routed-to"] == turn2.headers["x-routed-to"]
    first, second = _decision(gw, turn1.headers["x-request-id"]), _decision(gw, turn2.headers["x-request-id"])
    assert first["conversation"] == second["conversation"] and first["conversation"].startswith("h:")


def test_forged_destination_and_routing_headers_are_ignored(gw: Gateway, stubs: tuple[list[int], Running]) -> None:
    ports, _ = stubs
    outsider = f"127.0.0.1:{ports[3]}"
    forged = {
        "x-gateway-destination-endpoint": outsider,
        "x-routed-to": "evil",
        "x-route-reason": "forged",
        "x-route-predicted-cached-tokens": "999999",
    }
    for i in range(6):
        reply = post(gw.url + URL, chat(f"forged {i}"), forged)
        assert reply.status_code == 200
        assert reply.headers["x-gateway-destination-endpoint-served"] != outsider
        assert reply.headers["x-routed-to"] != "evil" and reply.headers["x-route-reason"] in reasons()
        assert reply.headers["x-route-predicted-cached-tokens"] != "999999"


def test_policy_switch_and_reset_through_the_admin_client(gw: Gateway) -> None:
    from extproc.service.admin_client import AdminClient

    with AdminClient(gw.admin) as admin:
        state = admin.set_routing({"policy": "round-robin"})
        assert state["routing"]["policy"] == "round-robin" and "epsilon" not in state["routing"]  # none of its own
        reasons = {post(gw.url + URL, chat(f"rr {i}")).headers["x-route-reason"] for i in range(3)}
        assert reasons == {"rotate"}
        admin.set_routing({"policy": "mod-n"})
        assert post(gw.url + URL, chat("m")).headers["x-route-reason"] == "hash"
        with pytest.raises(ValueError, match="routing.mod-n.epsilon: unknown setting"):
            admin.set_routing({"epsilon": 0.5})  # not a key of mod-n's
        with pytest.raises(ValueError, match="routing.mod-n.polcy: unknown setting"):
            admin.set_routing({"polcy": "mod-n"})  # neither a shared key nor mod-n's
        state = admin.set_routing({"policy": "chwbl", "load_factor": 1.5})  # a peer's own parameter
        assert state["routing"]["load_factor"] == 1.5
        state = admin.set_routing({"policy": "llm-aware"})
        assert state["routing"]["policy"] == "llm-aware"
        assert {r["name"] for r in admin.reset()["replicas"]} == {"llm-0", "llm-1", "llm-2"}


def test_no_replica_gives_503_json(tmp_path: Path) -> None:
    with gateway(tmp_path, static_discovery({})) as gw:
        reply = post(gw.url + URL, chat("anyone?"))
        assert reply.status_code == 503
        assert error_message(reply.json()).startswith("no replica available")


@pytest.mark.parametrize(("fail_open", "status"), [(True, 200), (False, 500)])
def test_ext_proc_down(stubs: tuple[list[int], Running], tmp_path: Path, fail_open: bool, status: int) -> None:
    """Nothing listens on the routing service's socket: round robin (fail_open) or 500."""
    ports, _ = stubs
    endpoints = tmp_path / "eds" / "replicas.json"
    endpoints.parent.mkdir()
    write_endpoints_file(endpoints, {"llm-0": f"127.0.0.1:{ports[0]}", "llm-1": f"127.0.0.1:{ports[1]}"})
    envoy = start_gateway_envoy(tmp_path / "envoy", f"@llm-ring-nothing-{free_port()}", endpoints, fail_open,
                                concurrency=1)
    try:
        time.sleep(0.3)  # EDS file loaded
        served = set()
        for i in range(4):
            reply = post(f"http://{envoy.listen}{URL}", chat(f"down {i}"))
            assert reply.status_code == status
            served.add(reply.headers.get("x-gateway-destination-endpoint-served"))
        if fail_open:
            assert served == {f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"}  # round robin
    finally:
        envoy.stop()


def test_dead_replica_fails_over_and_is_avoided_until_healthy(stubs: tuple[list[int], Running], tmp_path: Path) -> None:
    ports, _ = stubs
    dead = free_port()
    replicas = {"llm-0": f"127.0.0.1:{ports[0]}", "llm-1": f"127.0.0.1:{dead}"}
    with gateway(tmp_path, static_discovery(replicas)) as gw:
        picked_dead = None
        for i in range(40):  # until the policy picks the dead one
            reply = post(gw.url + URL, chat(f"conv {i}"), {"x-conversation-id": f"conv-{i}"})
            assert reply.status_code == 200  # served either way
            if reply.headers["x-routed-to"] == "llm-1":
                picked_dead = reply
                break
        assert picked_dead is not None, "the policy never picked llm-1"
        assert picked_dead.headers["x-gateway-destination-endpoint-served"] == replicas["llm-0"]  # the fallback
        record = _decision(gw, picked_dead.headers["x-request-id"])
        assert record["outcome"] == "failed_over" and record["served_replica"] == "llm-0"
        # placement memory learned where the conversation's cache went: the fallback
        again = post(gw.url + URL, chat(f"conv {i}"), {"x-conversation-id": f"conv-{i}"})
        assert _decision(gw, again.headers["x-request-id"])["trace"]["remembered"] == "llm-0"
        health = {r["name"]: r["healthy"] for r in gw.state()["replicas"]}
        assert health == {"llm-0": True, "llm-1": False}
        for i in range(10):
            assert (
                post(gw.url + URL, chat(f"after {i}"), {"x-conversation-id": f"conv-{i}"}).headers["x-routed-to"]
                == "llm-0"
            )
        revived = start_stub_upstream([dead], tmp_path / "revived")
        try:
            deadline = time.monotonic() + 5
            while not all(r["healthy"] for r in gw.state()["replicas"]):
                assert time.monotonic() < deadline, "llm-1 never came back"
                time.sleep(0.1)
        finally:
            revived.stop()
        assert gw.wait_idle()["in_flight_requests"] == 0


def test_only_streamed_requests_open_an_observer_stream(gw: Gateway) -> None:
    """JSON answers reach the service through the access log (status, served, timings); the
    observer's ext_proc stream, the costliest part per request, is opened for streamed ones."""
    before = _observer_streams(gw)
    plain = post(gw.url + URL, chat("plain"), {"x-conversation-id": "obs-1"})
    streamed = post(gw.url + URL, chat("streamed", stream=True), {"x-conversation-id": "obs-2"})
    assert plain.status_code == streamed.status_code == 200
    assert _observer_streams(gw) - before == 1
    for reply in (plain, streamed):  # the stub answers both with JSON timings
        record = _decision(gw, reply.headers["x-request-id"])
        assert record["outcome"] == "ok" and record["cache_n"] == 3 and record["prompt_n"] == 5
        assert record["served"] == reply.headers["x-gateway-destination-endpoint-served"]
    assert _decision(gw, streamed.headers["x-request-id"])["stream"] is True


def test_a_json_request_the_client_abandons_is_released_once_and_logged(tmp_path: Path) -> None:
    """No answer ever comes (the replica accepts and stays silent); the client gives up. The
    access log entry says the client went away: load released, outcome abandoned."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel completes the handshake; nobody ever reads or answers
        replicas = {"llm-0": f"127.0.0.1:{silent.getsockname()[1]}"}
        with gateway(tmp_path, static_discovery(replicas)) as gw:
            with pytest.raises(httpx.TimeoutException):
                post(gw.url + URL, chat("anyone there?"), {"x-conversation-id": "gone"}, timeout=1.0)
            assert gw.wait_idle()["in_flight_requests"] == 0
            (record,) = [r for r in _decisions_eventually(gw) if r["conversation"] == "gone"]
            assert record["outcome"] == "abandoned" and record["replica"] == "llm-0"


def _decisions_eventually(gw: Gateway, timeout: float = 3.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while not (found := gw.decisions()):
        assert time.monotonic() < deadline, "no route_decision logged"
        time.sleep(0.05)
    return found


def _observer_streams(gw: Gateway) -> int:
    stats = httpx.get(f"http://{gw.running[1].address}/stats?filter=ext_proc.observe.streams_started").text
    return int(stats.split(":")[-1]) if stats.strip() else 0


def _decision(gw: Gateway, request_id: str, timeout: float = 3.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in gw.decisions() if r["request_id"] == request_id]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no route_decision for {request_id}"
        time.sleep(0.05)


def test_a_socket_name_in_use_stops_the_service_naming_the_key(gw: Gateway, tmp_path: Path) -> None:
    listen = f"127.0.0.1:{free_port()}"
    env = service_env(listen, tmp_path / "eds.json", static_discovery({"llm-0": "127.0.0.1:9"}))
    env["LLM_RING__SERVICE__EXT_PROC_SOCKET"] = f'"{gw.running[0].ext_proc.removeprefix("@")}"'  # the running service's
    with pytest.raises(StartError, match="service.ext_proc_socket"):
        start_service(tmp_path / "second", env)
    assert post(gw.url + URL, chat("still served")).status_code == 200


def test_a_replica_that_never_answers_gets_504_after_the_idle_timeout_and_is_avoided(
    stubs: tuple[list[int], Running], tmp_path: Path
) -> None:
    """A drill: llm-1 accepts connections and never answers. A request routed there gets Envoy's
    504 once its stream has been silent for the idle timeout (300 s in production, 2 s here);
    the service then marks llm-1 unhealthy, and every later request goes to llm-0."""
    ports, _ = stubs
    with _silent_server() as silent_port:
        replicas = {"llm-0": f"127.0.0.1:{ports[0]}", "llm-1": f"127.0.0.1:{silent_port}"}
        with gateway(tmp_path, static_discovery(replicas), envoy_idle_timeout_s=2) as gw:
            timed_out = None
            for i in range(40):  # until the policy picks the silent one
                started = time.monotonic()
                reply = post(gw.url + URL, chat(f"conv {i}"), {"x-conversation-id": f"hang-{i}"}, timeout=10)
                if reply.headers.get("x-routed-to") == "llm-1":
                    timed_out = (reply, time.monotonic() - started)
                    break
                assert reply.status_code == 200
            assert timed_out is not None, "the policy never picked llm-1"
            reply, waited = timed_out
            assert reply.status_code == 504 and waited >= 1.9
            record = _decision(gw, reply.headers["x-request-id"])
            assert record["outcome"] == "failed" and record["status"] == 504
            _until(lambda: {r["name"]: r["healthy"] for r in gw.state()["replicas"]} == {"llm-0": True, "llm-1": False})
            for i in range(10):
                again = post(gw.url + URL, chat(f"after {i}"), {"x-conversation-id": f"after-hang-{i}"})
                assert again.status_code == 200 and again.headers["x-routed-to"] == "llm-0"
            assert gw.wait_idle()["in_flight_requests"] == 0


@contextmanager
def _silent_server() -> Iterator[int]:
    """A TCP server that accepts every connection, reads what comes and never writes."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()


def _until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
