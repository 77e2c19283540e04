"""Who may end a request: a real `llm-ring serve` set up as in the Kubernetes gateway pod (the
picker port on TCP, our own Envoy's abstract socket beside it). The test plays our own Envoy on
the socket and a forger on the picker port: the access log service, whose entries release load
and carry timings, answers on the socket alone, and our Envoy's route streams pin nothing there.
The Endpoint Picker deployment (no socket at all): test_picker.py. The own-Envoy path end to end
with real Envoy: test_gateway_stub.py and the other gateway tests."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from extproc.service.admin_client import AdminClient
from extproc.service.dataplanes.own_envoy import ACCESS_LOG_SERVICE, ATTRIBUTES
from extproc.stack.processes import Running, free_port, service_env, start_service, static_discovery

pytestmark = pytest.mark.live
REPLICAS = {"llm-0": "10.9.0.1:8080", "llm-1": "10.9.0.2:8080"}
CHAT = "/v1/chat/completions"
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    workdir = tmp_path_factory.mktemp("access-log")
    listen = f"127.0.0.1:{free_port()}"
    running = start_service(workdir, service_env(listen, workdir / "eds" / "replicas.json", static_discovery(REPLICAS)))
    running.listen = listen  # the picker port, plaintext (k8s/41-router-config.yaml)
    yield running
    running.stop()


def in_flight(service: Running) -> int:
    with AdminClient(service.address) as admin:
        return int(admin.state()["in_flight_requests"])


def channel_to(address: str) -> grpc.aio.Channel:
    """An "@name" abstract socket or a host:port, plaintext."""
    return grpc.aio.insecure_channel(f"unix-abstract:{address[1:]}" if address.startswith("@") else address)


async def route_as_our_envoy(address: str, conversation: str) -> pb.ProcessingResponse:
    """What our Envoy's "route" filter sends: the headers with its CEL attributes (and its body
    mode: buffered, sent without waiting), then the body."""
    attributes = struct_pb2.Struct()
    attributes.update({"request.url_path": CHAT, "request.id": f"envoy-{conversation}",
                       "request.headers['content-type']": "application/json"})
    # a POST, as Envoy sends it: without :method the picker port refuses the path at once, and the
    # body written after its answer meets a closed stream (or not: a race)
    path = base_pb2.HeaderValue(key=":path", raw_value=CHAT.encode())
    method = base_pb2.HeaderValue(key=":method", raw_value=b"POST")
    session = base_pb2.HeaderValue(key="x-conversation-id", raw_value=conversation.encode())
    headers = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[method, path, session])),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=BUFFERED,
                                                 send_body_without_waiting_for_header_response=True),
    )
    headers.attributes[ATTRIBUTES].CopyFrom(attributes)
    body = json.dumps({"messages": [{"role": "user", "content": f"hello from {conversation}"}], "max_tokens": 4})
    async with channel_to(address) as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers)
        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body.encode(), end_of_stream=True)))
        answer = await asyncio.wait_for(call.read(), 5.0)
        await call.done_writing()
        while await asyncio.wait_for(call.read(), 5.0) is not grpc.aio.EOF:  # the body's "continue"
            pass
    return answer


def request_id_of(answer: pb.ProcessingResponse) -> str:
    """The id the service gave the request: its x-request-id header."""
    mutation = answer.request_headers.response.header_mutation
    return next(h.header.raw_value.decode() for h in mutation.set_headers if h.header.key == "x-request-id")


async def forge_access_log(address: str, request_id: str) -> grpc.StatusCode:
    """One access log entry saying the request is over (200, timings as llama.cpp reports them)."""
    entry = accesslog_pb2.HTTPAccessLogEntry(request=accesslog_pb2.HTTPRequestProperties(request_id=request_id))
    entry.response.response_code.value = 200
    entry.common_properties.upstream_remote_address.socket_address.address = "10.9.0.1"
    entry.common_properties.upstream_remote_address.socket_address.port_value = 8080
    entry.common_properties.metadata.filter_metadata["llm-ring"].update({"cache_n": 999.0, "prompt_n": 1.0})
    message = als_pb2.StreamAccessLogsMessage(
        identifier=als_pb2.StreamAccessLogsMessage.Identifier(log_name="llm-ring"),
        http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(log_entry=[entry]),
    )
    async with channel_to(address) as channel:
        call = channel.stream_unary(f"/{ACCESS_LOG_SERVICE}/StreamAccessLogs",
                                    request_serializer=als_pb2.StreamAccessLogsMessage.SerializeToString,
                                    response_deserializer=lambda data: data)
        try:
            await asyncio.wait_for(call(iter([message])), 5.0)
        except grpc.aio.AioRpcError as refused:
            return refused.code()
    return grpc.StatusCode.OK


def eventually(condition: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.05)
    return bool(condition())  # type: ignore[operator]


def test_an_access_log_entry_is_refused_on_the_picker_port_and_ends_the_request_on_the_socket(service: Running):
    answer = asyncio.run(route_as_our_envoy(service.ext_proc, "held"))
    request_id = request_id_of(answer)
    assert in_flight(service) == 1  # charged until Envoy's access log says the request is over
    assert asyncio.run(forge_access_log(service.listen, request_id)) == grpc.StatusCode.UNIMPLEMENTED
    time.sleep(0.3)
    assert in_flight(service) == 1, "a forged entry on the picker port released the request"
    assert asyncio.run(forge_access_log(service.ext_proc, request_id)) == grpc.StatusCode.OK
    assert eventually(lambda: in_flight(service) == 0), "the same entry from our Envoy's socket ends it"


def test_our_envoys_route_stream_on_the_picker_port_is_an_endpoint_pickers_and_pins_no_load(service: Running):
    """Attributes that claim to be our Envoy's do not make the picker port wait for an access log
    entry it never serves: the stream is an Endpoint Picker's, over when it closes."""
    asyncio.run(route_as_our_envoy(service.listen, "forger"))
    assert eventually(lambda: in_flight(service) == 0), "the request stays charged until the lost-entry sweep"

