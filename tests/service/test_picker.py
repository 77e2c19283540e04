"""The Endpoint Picker's side of the protocol, message by message, against a real `llm-ring serve`.

The test plays the gateway: a real gRPC client sends what an InferencePool gateway's Envoy sends
(no CEL attributes; every phase; FULL_DUPLEX_STREAMED or BUFFERED bodies; a subset hint and the
served endpoint in the metadata context, which stock Envoy cannot be made to send without a
gateway's control plane) and checks each answer. The same service behind real Envoy with the
gateways' own configurations: test_inference_gateways.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.service.admin_client import AdminClient
from extproc.service.dataplanes.own_envoy import ACCESS_LOG_SERVICE
from extproc.stack.processes import ROUTER_REFERENCE, Running, free_port, service_env, start_service, static_discovery
from tests.service.gateway_support import error_message, route_decisions

Mode = processing_mode_pb2.ProcessingMode
REPLICAS = {"llm-0": "10.9.0.1:8080", "llm-1": "10.9.0.2:8080", "llm-2": "10.9.0.3:8080"}
CHAT = "/v1/chat/completions"
REPLICA_KEY = "the-replicas-key"  # service.replica_api_key_file's
ANSWER = {"choices": [{"message": {"role": "assistant", "content": "hi"}}],
          "timings": {"cache_n": 7, "prompt_n": 3, "prompt_ms": 1.0, "predicted_n": 1, "predicted_ms": 1.0}}


@pytest.fixture(scope="module")
def picker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """`llm-ring serve` as the issue's one-liner configures it: static replicas, no socket, no
    endpoints file, a self-signed certificate on the picker port; and the replicas' key."""
    workdir = tmp_path_factory.mktemp("picker")
    listen = f"127.0.0.1:{free_port()}"
    (workdir / "replica-key").write_text(REPLICA_KEY + "\n")
    env = service_env(listen, Path(""), static_discovery(REPLICAS), tls='"self-signed"', log_level='"debug"',
                      replica_api_key_file=f'"{workdir / "replica-key"}"')
    env.update({"LLM_RING__SERVICE__EXT_PROC_SOCKET": '""', "LLM_RING__SERVICE__ENVOY_ENDPOINTS_FILE": '""'})
    running = start_service(workdir, env)
    running.listen = listen
    yield running
    running.stop()


def credentials(listen: str) -> grpc.ChannelCredentials:
    """Trust the certificate the picker made at start-up (the gateways do not check it at all)."""
    host, port = listen.rsplit(":", 1)
    pem = ssl.get_server_certificate((host, int(port))).encode()
    return grpc.ssl_channel_credentials(root_certificates=pem)


def secure_channel(listen: str) -> grpc.aio.Channel:
    options = [("grpc.ssl_target_name_override", "localhost")]
    return grpc.aio.secure_channel(listen, credentials(listen), options=options)


def headers(path: str, end_of_stream: bool = False, method: str = "POST", **values: str) -> pb.HttpHeaders:
    pairs = {":method": method, ":path": path, "content-type": "application/json",
             **{name.replace("_", "-"): value for name, value in values.items()}}
    values_ = [base_pb2.HeaderValue(key=key, raw_value=value.encode()) for key, value in pairs.items()]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values_), end_of_stream=end_of_stream)


def first_message(path: str, mode: int, *, end_of_stream: bool = False, subset: list[str] | None = None,
                  wait: bool = True, method: str = "POST", **values: str) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest(
        request_headers=headers(path, end_of_stream, method, **values),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode,
                                                 send_body_without_waiting_for_header_response=not wait),
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def chat(text: str, answered: str | None = None) -> bytes:
    messages = [{"role": "user", "content": text}]
    if answered is not None:
        messages += [{"role": "assistant", "content": answered}, {"role": "user", "content": "and then?"}]
    return json.dumps({"messages": messages, "max_tokens": 8}).encode()


def set_headers(response: pb.ProcessingResponse) -> dict[str, str]:
    common = getattr(response, response.WhichOneof("response")).response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def lb(response: pb.ProcessingResponse) -> dict[str, Any]:
    return dict(response.dynamic_metadata.fields["envoy.lb"].struct_value.items())


class Exchange:
    """One ext_proc stream, driven message by message."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = pb_grpc.ExternalProcessorStub(channel).Process()

    async def send(self, message: pb.ProcessingRequest) -> None:
        await self.call.write(message)

    async def answer(self) -> pb.ProcessingResponse:
        return await asyncio.wait_for(self.call.read(), 5.0)

    async def body(self, data: bytes, end: bool, response: bool = False) -> None:
        key = "response_body" if response else "request_body"
        await self.send(pb.ProcessingRequest(**{key: pb.HttpBody(body=data, end_of_stream=end)}))

    async def response_headers(self, status: int = 200, served: str = "") -> pb.ProcessingResponse:
        message = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=":status", raw_value=str(status).encode())])))
        if served:
            message.metadata_context.filter_metadata["envoy.lb"].update(
                {"x-gateway-destination-endpoint-served": served})
        await self.send(message)
        return await self.answer()


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def decisions(service: Running) -> list[dict[str, Any]]:
    return route_decisions(service.log_path)


def in_flight(service: Running) -> int:
    with AdminClient(service.address) as admin:
        return int(admin.state()["in_flight_requests"])


def eventually_idle(service: Running, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while in_flight(service) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert in_flight(service) == 0


def test_full_duplex_gets_one_endpoint_its_body_back_in_order_and_releases_at_the_answers_end(picker: Running):
    body = chat("full duplex " * 40)
    pieces = [body[:100], body[100:250], body[250:]]

    async def exchange() -> tuple[list[pb.ProcessingResponse], pb.ProcessingResponse, list[pb.ProcessingResponse]]:
        async with secure_channel(picker.listen) as channel:
            x = Exchange(channel)
            await x.send(first_message(CHAT, Mode.FULL_DUPLEX_STREAMED, x_conversation_id="duplex-1"))
            for index, piece in enumerate(pieces):
                await x.body(piece, index == len(pieces) - 1)
            request = [await x.answer() for _ in range(1 + len(pieces))]
            assert in_flight(picker) == 1  # charged until the answer ends
            response_headers = await x.response_headers()
            answer = json.dumps(ANSWER).encode()
            await x.body(answer[:20], False, response=True)
            await x.body(answer[20:], True, response=True)
            echoed = [await x.answer(), await x.answer()]
            await x.call.done_writing()
            return request, response_headers, echoed

    request, response_headers, echoed = run(exchange())
    pick = request[0]
    destination = set_headers(pick)["x-gateway-destination-endpoint"]
    assert destination in REPLICAS.values() and "," not in destination  # ORIGINAL_DST reads one endpoint
    assert pick.request_headers.response.clear_route_cache
    assert lb(pick)["x-gateway-destination-endpoint"] == destination
    assert lb(pick)["x-gateway-destination-endpoint-fallback"] in set(REPLICAS.values()) - {destination}
    assert "x-request-id" not in set_headers(pick)  # the gateway's own request id is left alone
    assert set_headers(pick)["authorization"] == f"Bearer {REPLICA_KEY}"  # the replicas want it
    streamed = [r.request_body.response.body_mutation.streamed_response for r in request[1:]]
    assert b"".join(s.body for s in streamed) == body and [s.end_of_stream for s in streamed] == [False, False, True]
    assert set_headers(response_headers)["x-routed-to"] == next(n for n, e in REPLICAS.items() if e == destination)
    back = [r.response_body.response.body_mutation.streamed_response for r in echoed]
    assert b"".join(s.body for s in back) == json.dumps(ANSWER).encode() and back[-1].end_of_stream
    eventually_idle(picker)
    record = next(r for r in decisions(picker) if r["conversation"] == "duplex-1")
    assert (record["outcome"], record["cache_n"], record["prompt_n"]) == ("ok", 7, 3)


def test_buffered_mode_gets_the_pick_in_the_body_answer(picker: Running):
    async def exchange() -> tuple[pb.ProcessingResponse, pb.ProcessingResponse]:
        async with secure_channel(picker.listen) as channel:
            x = Exchange(channel)
            await x.send(first_message(CHAT, Mode.BUFFERED, x_conversation_id="buffered-1"))
            headers_answer = await x.answer()  # Envoy sends a buffered body only once the headers are answered
            await x.body(chat("buffered"), True)
            body_answer = await x.answer()
            await x.response_headers()
            await x.body(json.dumps(ANSWER).encode(), True, response=True)
            await x.answer()
            await x.call.done_writing()
            return headers_answer, body_answer

    headers_answer, body_answer = run(exchange())
    assert headers_answer.WhichOneof("response") == "request_headers" and not set_headers(headers_answer)
    assert body_answer.WhichOneof("response") == "request_body"
    assert set_headers(body_answer)["x-gateway-destination-endpoint"] in REPLICAS.values()
    assert set_headers(body_answer)["authorization"] == f"Bearer {REPLICA_KEY}"
    assert body_answer.request_body.response.clear_route_cache
    assert not body_answer.request_body.response.HasField("body_mutation")  # the body passes as it is
    eventually_idle(picker)


def test_the_subset_hint_is_honoured_and_503_when_it_leaves_nothing(picker: Running):
    allowed = REPLICAS["llm-2"]

    async def pick(subset: list[str], conversation: str) -> pb.ProcessingResponse:
        async with secure_channel(picker.listen) as channel:
            x = Exchange(channel)
            await x.send(first_message(CHAT, Mode.FULL_DUPLEX_STREAMED, subset=subset, x_conversation_id=conversation))
            await x.body(chat(f"subset {conversation}"), True)
            answer = await x.answer()
            await x.call.done_writing()
            return answer

    for i in range(6):  # conversations whose ring home is elsewhere too
        answer = run(pick([allowed, "10.200.0.1:8080"], f"subset-{i}"))
        assert set_headers(answer)["x-gateway-destination-endpoint"] == allowed
        assert "x-gateway-destination-endpoint-fallback" not in lb(answer)  # nothing else is allowed
    refused = run(pick(["10.200.0.1:8080"], "subset-none"))
    assert refused.immediate_response.status.code == 503
    eventually_idle(picker)


def test_an_agent_session_header_names_the_conversation(picker: Running):
    """OpenCode's x-session-affinity, alone or with x-conversation-id (which comes later in
    service.session_ids): the conversation is the session's."""
    async def pick(**session: str) -> None:
        async with secure_channel(picker.listen) as channel:
            x = Exchange(channel)
            await x.send(first_message(CHAT, Mode.FULL_DUPLEX_STREAMED, **session))
            await x.body(chat("an agent's turn"), True)
            await x.answer()
            await x.answer()
            await x.call.done_writing()

    run(pick(x_session_affinity="opencode-1"))
    run(pick(x_session_affinity="opencode-2", x_conversation_id="ignored-2"))
    eventually_idle(picker)
    conversations = {r["conversation"] for r in decisions(picker)}
    assert {"opencode-1", "opencode-2"} <= conversations and "ignored-2" not in conversations


def test_a_fallback_that_served_is_remembered_and_a_cancelled_stream_is_released(picker: Running):
    async def exchange(conversation: str, served: str, cancel: bool) -> str:
        async with secure_channel(picker.listen) as channel:
            x = Exchange(channel)
            await x.send(first_message(CHAT, Mode.FULL_DUPLEX_STREAMED, x_conversation_id=conversation))
            await x.body(chat(conversation), True)
            pick = await x.answer()
            await x.answer()
            await x.response_headers(served=served(set_headers(pick)["x-gateway-destination-endpoint"]))
            if cancel:  # the client hung up mid-answer: Envoy resets the stream
                await x.body(b'{"choices": [', False, response=True)
                await x.answer()
                x.call.cancel()
                return ""
            await x.body(json.dumps(ANSWER).encode(), True, response=True)
            await x.answer()
            await x.call.done_writing()
            return set_headers(pick)["x-gateway-destination-endpoint"]

    def other(endpoint: str) -> str:
        return next(e for e in REPLICAS.values() if e != endpoint)

    first = run(exchange("served-1", other, cancel=False))
    eventually_idle(picker)
    record = next(r for r in decisions(picker) if r["conversation"] == "served-1")
    assert record["outcome"] == "failed_over" and record["served"] == other(first)
    run(exchange("cut-1", lambda endpoint: "", cancel=True))
    eventually_idle(picker)
    assert next(r for r in decisions(picker) if r["conversation"] == "cut-1")["outcome"] == "abandoned"


def answer_to(picker: Running, method: str, path: str) -> pb.ProcessingResponse:
    """The picker's answer to a request's headers (no body), alone on its stream."""
    async def exchange() -> pb.ProcessingResponse:
        async with secure_channel(picker.listen) as channel:
            x = Exchange(channel)
            await x.send(first_message(path, Mode.FULL_DUPLEX_STREAMED, end_of_stream=True, method=method))
            answer = await x.answer()
            await x.call.done_writing()
            return answer

    return run(exchange())


def test_the_gateway_answers_read_only_requests_itself_untracked(picker: Running):
    before = len(decisions(picker))
    for path in ("/v1/models", "/models", "/health", "/v1/health"):
        answer = answer_to(picker, "GET", path)
        assert answer.immediate_response.status.code == 200, path
        assert json.loads(answer.immediate_response.body), path  # a JSON document, no replica asked
    assert in_flight(picker) == 0 and len(decisions(picker)) == before


@pytest.mark.parametrize("path", ["/slots", "/slots/0?action=erase", "/lora-adapters", "/props", "/metrics",
                                  "/v1/embeddings", "/tokenize", "/infill", "//v1/chat/completions",
                                  "/v1/chat/completions/../../slots", "/V1/CHAT/COMPLETIONS", "/%73lots", ""])
@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_every_other_path_is_refused_by_the_picker_itself(picker: Running, method: str, path: str):
    answer = answer_to(picker, method, path)
    assert answer.immediate_response.status.code == 404, (method, path)
    assert error_message(json.loads(answer.immediate_response.body))
    assert in_flight(picker) == 0


def test_the_picker_port_serves_tls_and_health_but_neither_the_admin_api_nor_the_access_log(picker: Running):
    """No access log behind an InferencePool gateway: its service is not served at all, so
    nothing that reaches the port can end or time a request (test_access_log_port.py)."""
    with grpc.secure_channel(picker.listen, credentials(picker.listen),
                             options=[("grpc.ssl_target_name_override", "localhost")]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary("/llmring.admin.v1.Admin/GetState")(b"", timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as refused:
            channel.stream_unary(f"/{ACCESS_LOG_SERVICE}/StreamAccessLogs")(iter([b""]), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with grpc.insecure_channel(picker.listen) as plain, pytest.raises(grpc.RpcError):
        health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=2)
    assert in_flight(picker) == 0  # the Admin API answers on admin_listen


def test_the_metrics_port_answers_the_kubelets_http_probes(picker: Running):
    started = next(json.loads(line) for line in picker.log_path.read_text().splitlines() if "service_started" in line)
    metrics = started["metrics"]
    assert httpx.get(f"http://{metrics}/livez", timeout=5).status_code == 200
    assert httpx.get(f"http://{metrics}/readyz", timeout=5).status_code == 200  # replicas are known
    assert "llm_ring_decisions_total" in httpx.get(f"http://{metrics}/metrics", timeout=5).text


def test_a_tls_folder_without_its_files_stops_the_service_in_one_line(tmp_path: Path):
    env = service_env(f"127.0.0.1:{free_port()}", Path(""), static_discovery(REPLICAS), tls=f'"{tmp_path}"')
    done = subprocess.run([sys.executable, "-m", "extproc.cli", "serve", "--config", str(ROUTER_REFERENCE)],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    missing = tmp_path / "tls.key"
    assert done.stderr.strip() == f"llm-ring serve: service.tls: cannot read {missing}: No such file or directory"


@pytest.mark.parametrize("mode", [Mode.BUFFERED, Mode.FULL_DUPLEX_STREAMED])
def test_a_generation_without_a_body_is_refused_on_its_headers(picker: Running, mode: int):
    async def exchange() -> pb.ProcessingResponse:
        async with secure_channel(picker.listen) as channel:
            x = Exchange(channel)
            await x.send(first_message(CHAT, mode, end_of_stream=True))
            answer = await x.answer()
            await x.call.done_writing()
            return answer

    answer = run(exchange())  # a POST without a body; not a "continue" first: the request would go upstream at once
    assert answer.immediate_response.status.code == 400
    assert in_flight(picker) == 0
