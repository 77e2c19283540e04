"""`llm-ring serve` as the Endpoint Picker of InferencePool gateways: real Envoy with each
gateway's data plane (extproc.service.dataplanes.picker_gateways: Envoy AI Gateway full-duplex and
buffered, kgateway and Istio full-duplex; the picker over TLS), real llama.cpp replicas
(xllamacpp + SmolLM2-135M, 2 replicas, which want an API key). The picker is configured as a
gateway user would (start_picker_service: static replicas, self-signed TLS, the replicas' key
file, nothing else).

Each plane: JSON and SSE turns back to back, the openai SDK with no custom header, a fan-out
on one prefix, the subset hint (honoured; 503 when nothing in it is eligible), a stream the
client abandons, and bodies of 200 KiB both ways through an echo upstream. Every follow-up
must land on its replica with the previous prompt cached there, and the picker's in-flight
load must be back to 0 after each test (its Admin API on service.admin_listen).
The variants: AI Gateway duplex exactly as generated (no served-endpoint metadata), AI
Gateway buffered and kgateway with the served endpoint reported on the response by the test
option, Istio as generated (its override_host pool reports the served endpoint itself).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from extproc.service.admin_client import AdminClient
from extproc.service.dataplanes.picker_gateways import (
    AI_GATEWAY,
    ISTIO,
    KGATEWAY,
    TEST_SUBSET_HEADER,
    UPSTREAM_HEADER,
    BodyMode,
    InferenceGateway,
)
from extproc.stack.processes import (
    Running,
    start_inference_gateway_envoy,
    start_picker_service,
    tls_grpc_serving,
)
from tests.service.gateway_support import LlamaReplicas, assert_sdk_turns_stay_on_one_cache, llama_replicas

pytestmark = pytest.mark.live
CHAT = "/v1/chat/completions"
# (gateway, body mode, the served endpoint reported by the test option); Istio reports it itself
PLANES = [(AI_GATEWAY, "duplex", False), (AI_GATEWAY, "buffered", True), (KGATEWAY, "duplex", True),
          (ISTIO, "duplex", False)]
PLANE_IDS = [f"{gateway.name}-{mode}" + ("-served" if served else "") for gateway, mode, served in PLANES]


@dataclass
class Plane:
    url: str
    picker: Running  # .address: its Admin API
    replica_of: dict[str, str]  # upstream address -> replica name

    def state(self) -> dict[str, Any]:
        with AdminClient(self.picker.address) as admin:
            return admin.state()

    def assert_idle(self, timeout: float = 5.0) -> None:
        """In-flight load back to 0 (the picker releases from the response phases, no access log)."""
        deadline = time.monotonic() + timeout
        while (state := self.state())["in_flight_requests"] or state["in_flight_tokens"]:
            assert time.monotonic() < deadline, f"load still charged: {state['in_flight_requests']} requests"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaReplicas]:
    with llama_replicas(tmp_path_factory.mktemp("replicas")) as replicas:
        yield replicas


@pytest.fixture(scope="module")
def picker(llama: LlamaReplicas, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    running = start_picker_service(tmp_path_factory.mktemp("picker"), llama.addresses, health_probe_seconds="0.2",
                                   replica_api_key_file=f'"{llama.key_file}"',
                                   log_level='"debug"')
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module", params=PLANES, ids=PLANE_IDS)
def plane(request: pytest.FixtureRequest, llama: LlamaReplicas, picker: Running,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    gateway, mode, served = request.param
    envoy = start_plane(tmp_path_factory.mktemp("envoy"), gateway, mode, served, picker, llama.addresses)
    try:
        yield Plane(f"http://{envoy.listen}", picker, {address: name for name, address in llama.addresses.items()})
    finally:
        envoy.stop()


def start_plane(workdir: Path, gateway: InferenceGateway, mode: BodyMode, served: bool, picker: Running,
                replicas: dict[str, str]) -> Running:
    hints = {"first": [replicas["llm-0"]], "nowhere": ["127.0.0.1:1"]}
    return start_inference_gateway_envoy(
        workdir, gateway, picker.ext_proc, sorted(replicas.values()), 1, body_mode=mode, subset_hints=hints,
        report_served=served, show_upstream=True,
    )


def test_the_picker_serves_the_protocol_health_names_over_tls(picker: Running) -> None:
    for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert tls_grpc_serving(picker.ext_proc, name), name


def test_the_picker_serves_a_gateway_with_only_the_settings_the_guide_names(
    tmp_path: Path, llama: LlamaReplicas
) -> None:
    """Static replicas, the ports, no socket, no EDS file, self-signed TLS, the replicas' key
    file: nothing else set."""
    minimal = start_picker_service(tmp_path / "picker", llama.addresses, private_admin=False,
                                   replica_api_key_file=f'"{llama.key_file}"')
    try:
        envoy = start_plane(tmp_path / "envoy", AI_GATEWAY, "duplex", False, minimal, llama.addresses)
        try:
            reply = httpx.post(f"http://{envoy.listen}{CHAT}", timeout=60,
                               json={"messages": [{"role": "user", "content": "Hello?"}], "max_tokens": 2})
            assert reply.status_code == 200 and reply.headers[UPSTREAM_HEADER] in llama.addresses.values(), reply.text
        finally:
            envoy.stop()
    finally:
        minimal.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_back_to_back_turns_land_on_their_replica_with_the_previous_prompt_cached(
    plane: Plane, stream: bool
) -> None:
    for conversation in range(3):
        turns = conversation_turns(plane, f"{conversation}-{stream}", stream, turns=4)
        for previous, turn in zip(turns, turns[1:], strict=False):
            assert turn["replica"] == turns[0]["replica"], turns
            assert turn["cache_n"] >= previous["cache_n"] + previous["prompt_n"], turns
    plane.assert_idle()


def test_the_openai_sdk_with_no_custom_header_stays_on_its_cache(plane: Plane) -> None:
    assert_sdk_turns_stay_on_one_cache(plane.url, lambda headers: plane.replica_of[headers[UPSTREAM_HEADER]])
    plane.assert_idle()


def test_a_fan_out_on_one_prefix_is_answered_whole_and_its_follow_up_finds_its_cache(plane: Plane) -> None:
    LENGTHS = (24, 4)  # noqa: N806 - branch 0 is sent once branch 1 is charged, and decodes longer: it ends last
    shared = [{"role": "system", "content": "You plan tasks. " * 20}, {"role": "user", "content": "Plan."},
              {"role": "assistant", "content": "OK."}]  # fmt: skip

    def ask(task: int) -> dict[str, Any]:
        messages = [*shared, {"role": "user", "content": f"Task {task}: go."}]
        reply = post(plane, {"messages": messages, "max_tokens": LENGTHS[task], "ignore_eos": True})
        replica = plane.replica_of[reply.headers[UPSTREAM_HEADER]]
        return {"messages": messages, "reply": reply.json(), "replica": replica}

    # two: a replica's two slots hold both prompts, so the follow-up's prefix is still in one
    with ThreadPoolExecutor(1) as pool:
        short = pool.submit(ask, 1)
        deadline = time.monotonic() + 10
        while not (short.done() or plane.state()["in_flight_requests"]):  # branch 1 decided first
            assert time.monotonic() < deadline, "branch 1 was never routed"
            time.sleep(0.01)
        answers = [ask(0), short.result()]
    assert [answer["reply"]["timings"]["predicted_n"] for answer in answers] == list(LENGTHS)
    # the branch answered last (the longer one) is the conversation's history now: a follow-up of
    # another branch shows no proof of it, and is routed as a new conversation (docs/security.md)
    first = answers[0]
    plane.assert_idle()
    follow = [*first["messages"], first["reply"]["choices"][0]["message"], {"role": "user", "content": "Next."}]
    reply = post(plane, {"messages": follow, "max_tokens": 2})
    assert plane.replica_of[reply.headers[UPSTREAM_HEADER]] == first["replica"]
    timings = first["reply"]["timings"]
    assert reply.json()["timings"]["cache_n"] >= timings["cache_n"] + timings["prompt_n"]
    plane.assert_idle()


def test_the_subset_hint_is_honoured_and_an_empty_subset_is_503(plane: Plane) -> None:
    for conversation in range(4):
        body = {"messages": [{"role": "user", "content": f"Subset chat {conversation}."}], "max_tokens": 2}
        reply = post(plane, body, {TEST_SUBSET_HEADER: "first"})
        assert plane.replica_of[reply.headers[UPSTREAM_HEADER]] == "llm-0"
    body = {"messages": [{"role": "user", "content": "Nowhere to go."}], "max_tokens": 2}
    refused = httpx.post(plane.url + CHAT, json=body, headers={TEST_SUBSET_HEADER: "nowhere"}, timeout=30)
    assert refused.status_code == 503, refused.text
    plane.assert_idle()


def test_an_abandoned_stream_releases_its_load(plane: Plane) -> None:
    """The client hangs up mid-generation. Raw HTTP: with the buffered annotation Envoy holds a
    streamed answer whole, so the hang-up comes while the picker has seen no response at all."""
    body = json.dumps({"messages": [{"role": "user", "content": "Write a long poem about the sea."}],
                       "max_tokens": 400, "stream": True, "ignore_eos": True}).encode()
    host, port = plane.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nhost: pool\r\ncontent-type: application/json\r\n"
                       b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while plane.state()["in_flight_requests"] != 1:
            assert time.monotonic() < deadline, "the request was never charged"
            time.sleep(0.05)
    plane.assert_idle()


def test_a_generation_carries_the_replicas_key_over_whatever_the_client_sent(plane: Plane) -> None:
    """The picker's answer sets authorization: a client's own (or none) never reaches the replica."""
    for credentials in ({"authorization": "Bearer not-the-key"}, {"x-api-key": "not-the-key"}):
        post(plane, {"messages": [{"role": "user", "content": "Who holds the key?"}], "max_tokens": 2}, credentials)
    plane.assert_idle()


CONTROL = [("GET", "/slots"), ("POST", "/slots/0?action=erase"), ("POST", "/slots/1?action=erase"),
           ("POST", "/slots/0?action=save"), ("POST", "/slots/0?action=restore"), ("POST", "/lora-adapters"),
           ("GET", "/props"), ("GET", "/metrics")]


def test_no_control_action_reaches_a_replica_with_the_key_and_a_victims_cache_stays(plane: Plane) -> None:
    """Whatever the gateway lets through to a replica besides a generation goes without the
    replicas' key, so llama.cpp refuses it (401; or the gateway refuses it first): nobody's
    slots are read, erased, saved or restored."""
    plane.assert_idle()  # no load left from the tests before to move the victim's next turn
    victim = {"x-conversation-id": f"victim-{plane.url.rsplit(':', 1)[1]}"}  # the picker serves every plane
    history = [{"role": "user", "content": "Remember the lighthouse keeper and the storm of the north coast."}]
    first = post(plane, {"messages": history, "max_tokens": 4, "ignore_eos": True}, victim)
    answer = first.json()
    held = answer["timings"]["cache_n"] + answer["timings"]["prompt_n"]
    for _ in range(2):  # the pass-through turns round the replicas
        for method, path in CONTROL:
            reply = httpx.request(method, plane.url + path, json={"filename": "attacker-written.bin"}, timeout=30,
                                  headers={"authorization": "Bearer not-the-key"})
            assert reply.status_code in (401, 404), (method, path, reply.status_code, reply.text)
    history += [answer["choices"][0]["message"], {"role": "user", "content": "What did he see?"}]
    plane.assert_idle()
    second = post(plane, {"messages": history, "max_tokens": 4}, victim)
    assert second.headers[UPSTREAM_HEADER] == first.headers[UPSTREAM_HEADER], plane.state()
    assert second.json()["timings"]["cache_n"] >= held - 1, "the victim's cache is intact"
    plane.assert_idle()


# ------------------------------------------------------------- large bodies, both ways


class _Echo(BaseHTTPRequestHandler):
    """Answers a POST with its own body, in 16 KiB chunks; GET /health for the picker's probes."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        self._answer(b'{"status": "ok"}', chunked=False)

    def do_POST(self) -> None:  # noqa: N802
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
        self._answer(body, chunked=True)

    def _answer(self, body: bytes, chunked: bool) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("transfer-encoding" if chunked else "content-length", "chunked" if chunked else str(len(body)))
        self.end_headers()
        if not chunked:
            self.wfile.write(body)
            return
        for start in range(0, len(body), 16384):
            piece = body[start:start + 16384]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture(scope="module")
def echo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], Running]]:
    """An echo upstream as the only replica of a second picker."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    replicas = {"echo-0": f"127.0.0.1:{server.server_address[1]}"}
    running = start_picker_service(tmp_path_factory.mktemp("echo-picker"), replicas)
    try:
        yield replicas, running
    finally:
        running.stop()
        server.shutdown()


@pytest.mark.parametrize("gateway, mode, served", PLANES, ids=PLANE_IDS)
def test_bodies_of_200_kib_arrive_whole_and_in_order_both_ways(
    tmp_path: Path, echo: tuple[dict[str, str], Running], gateway: InferenceGateway, mode: BodyMode, served: bool
) -> None:
    replicas, echo_picker = echo
    envoy = start_plane(tmp_path, gateway, mode, served, echo_picker, {"llm-0": replicas["echo-0"]})
    try:
        words = " ".join(f"w{i:06d}" for i in range(200 * 1024 // 8))  # numbered: any reordering shows
        body = json.dumps({"messages": [{"role": "user", "content": words}], "max_tokens": 1}).encode()
        reply = httpx.post(f"http://{envoy.listen}{CHAT}", content=body,
                           headers={"content-type": "application/json"}, timeout=30)
        assert reply.status_code == 200, reply.text[:200]
        assert len(reply.content) == len(body) >= 200 * 1024
        assert hashlib.sha256(reply.content).digest() == hashlib.sha256(body).digest()
        Plane("", echo_picker, {}).assert_idle()
    finally:
        envoy.stop()


# ------------------------------------------------------------------------- helpers


def post(plane: Plane, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    reply = httpx.post(plane.url + CHAT, json=body, headers=headers or {}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply


def conversation_turns(plane: Plane, name: str, stream: bool, turns: int) -> list[dict[str, Any]]:
    """One conversation sent back to back (each turn the instant the last answer is in, as an
    agent loop does), no custom header: per turn the replica and llama.cpp's timings."""
    history: list[dict[str, Any]] = [{"role": "system", "content": f"You are assistant {name}. Answer briefly."}]
    seen = []
    with httpx.Client(timeout=60) as client:
        for turn in range(1, turns + 1):
            history.append({"role": "user", "content": f"Question {turn} of chat {name}: name a colour."})
            body = {"messages": history, "max_tokens": 6, "ignore_eos": True, "stream": stream}
            answer, timings = "", {}
            with client.stream("POST", plane.url + CHAT, json=body) as reply:
                assert reply.status_code == 200, reply.read()
                if stream:
                    lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
                    assert lines[-1] == "data: [DONE]", lines[-3:]  # the stream came whole
                    events = [json.loads(line[6:]) for line in lines[:-1]]
                    answer = "".join((e["choices"][0].get("delta") or {}).get("content") or "" for e in events)
                    timings = next(e["timings"] for e in reversed(events) if e.get("timings"))
                else:
                    data = json.loads(reply.read())
                    answer, timings = data["choices"][0]["message"]["content"], data["timings"]
                seen.append({"replica": plane.replica_of[reply.headers[UPSTREAM_HEADER]], **timings})
            history.append({"role": "assistant", "content": answer})
    return seen
