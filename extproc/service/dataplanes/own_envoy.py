"""Our own Envoy (own_envoy_config.py renders it): a route stream per request, an observe
stream per streamed answer, and the access log that ends each request. Served only where that
Envoy alone connects, the abstract socket (``own_envoy``), so nothing else that reaches the
service can release, time or pin another's load.

One HTTP request meets the service on:
  - the *route* stream: the request headers with CEL attributes (path, id, content type,
    x-turn), the session and flow headers from the header map, and the whole body (Envoy's buffer
    filter comes first: one chunk) -> the gateway's pick, answering the headers; the body passes
    unchanged, and the stream ends there (fewer gRPC operations than waiting for Envoy to end it);
  - the *observe* stream (``observability_mode``: never answered) for a streamed answer: the
    response body chunks, the first carrying status and upstream as attributes;
  - Envoy's access log entry, which says when the HTTP request is over (lifecycle.py).

The pick's shape (``OWN_ENVOY``): the endpoint list "pick,fallback,..." in header and metadata,
which Envoy's cluster reads with Override Host; the streamed-answer mark (its config routes on
that header to the observe filter); our request id as ``x-request-id``, which the access log
entry brings back.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.envoy.contract import DESTINATION, LB_NAMESPACE, METADATA_NAMESPACE, OBSERVE, REQUEST_ID
from extproc.envoy.surface import generation_path, read_only_path
from extproc.service.answers import BODY_CONTINUE, answer_to, header_option, immediate, more_headers, pick_headers
from extproc.service.bodies import timings_from_metadata
from extproc.service.dataplanes.plane import Serving, as_bytes, header_values, stream_failed, tolerant
from extproc.service.gateway import Gateway
from extproc.service.waiting_room import HeldReads

ACCESS_LOG_SERVICE = "envoy.service.accesslog.v3.AccessLogService"
ATTRIBUTES = "envoy.filters.http.ext_proc"  # the key Envoy files CEL attributes under
EMPTY_BODY = immediate(400, "empty body: expected a JSON object", "empty_body")


class OwnEnvoyAnswers:
    """The pick's shape for our own Envoy (module docstring)."""

    access_logged = True
    waits_announced = True  # its max_message_timeout allows the override (own_envoy_config.py)

    def pick(self, destination: str, replica: str, reason: str, streamed: bool, routing_headers: bool,
             replica_key: str) -> bytes:
        own = [header_option(DESTINATION, destination), *([header_option(OBSERVE, "1")] if streamed else [])]
        headers = pick_headers(replica, reason, routing_headers, replica_key, *own)
        metadata = struct_pb2.Struct()
        metadata.get_or_create_struct(LB_NAMESPACE)[DESTINATION] = destination
        common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=headers), clear_route_cache=True)
        return answer_to(common, False, dynamic_metadata=metadata)

    def headers(self, headers: list[base_pb2.HeaderValueOption]) -> bytes:
        return more_headers(headers)

    def named(self, request_id: str) -> bytes:
        return request_id_header(request_id)


OWN_ENVOY = OwnEnvoyAnswers()


def request_id_header(request_id: str) -> bytes:
    """The answer's x-request-id header (a more_headers message): the id spliced into the
    serialized message of an id of its length, the same bytes without building five protobufs
    per request (protobuf's encoding of the rest depends only on the value's length)."""
    value = request_id.encode()
    head, tail = _request_id_around(len(value))
    return head + value + tail


@lru_cache(maxsize=64)  # our ids: a fixed prefix and a hex sequence, a few lengths
def _request_id_around(length: int) -> tuple[bytes, bytes]:
    marker = "~" * length
    serialized = more_headers([header_option(REQUEST_ID, marker)])
    assert serialized.count(marker.encode()) == 1, "the marker is found in the message's framing"
    head, _, tail = serialized.partition(marker.encode())
    return head, tail


class OwnEnvoy:
    """Our own Envoy's route and observe streams (module docstring)."""

    name = "own-envoy"

    def claims(self, first: pb.ProcessingRequest, own_envoy: bool) -> str:
        if not own_envoy:
            return ""
        if first.observability_mode:
            return "observe"
        return "route" if first.WhichOneof("request") == "request_headers" and ATTRIBUTES in first.attributes else ""

    async def serve(self, first: pb.ProcessingRequest, stream: HeldReads, serving: Serving) -> None:
        if first.observability_mode:
            await _observe(first, stream, serving.gateway)
        else:
            await _route(first, stream, serving)


async def _route(message: pb.ProcessingRequest, stream: HeldReads, serving: Serving) -> None:
    """The headers get the pick, the body passes unchanged. Envoy's routes (own_envoy_config.py, from
    surface.py) send here only a POST on a generation path or a GET on a read-only one, which
    the gateway answers itself."""
    attributes = message.attributes[ATTRIBUTES].fields
    path = _text(attributes, "request.url_path")
    read_only = read_only_path(path)
    if read_only is not None:
        await stream.write(serving.gateway.local.answer(read_only))
        return
    if message.request_headers.end_of_stream:  # a POST without a body
        await stream.write(EMPTY_BODY)
        return
    # the session headers, and flow control's (read here: no attributes for Envoy to evaluate)
    values = header_values(message.request_headers, serving.headers_read())
    chunks: list[bytes] = []
    while True:
        message = await stream.read()
        if message is grpc.aio.EOF or message.WhichOneof("request") != "request_body":
            return
        chunks.append(message.request_body.body)
        if message.request_body.end_of_stream:
            break
    generation = generation_path(path)
    answer, routed_id = await serving.route(
        stream, OWN_ENVOY, values,
        path=generation.path if generation is not None else path,
        content_type=_text(attributes, "request.headers['content-type']"), session_headers=values,
        turn=_text(attributes, "request.headers['x-turn']"), request_id=_text(attributes, "request.id"),
        body=chunks[0] if len(chunks) == 1 else b"".join(chunks),
    )  # fmt: skip
    if not answer:  # the client went away while its request waited
        return
    await stream.write(answer)
    if routed_id is None:  # Envoy answers the client itself: nothing more to say
        return
    for _ in chunks:  # each streamed chunk is answered, in order: pass it on unchanged
        await stream.write(BODY_CONTINUE)


async def _observe(message: Any, stream: HeldReads, gateway: Gateway) -> None:
    """Response body chunks, never answered; the first one carries the attributes."""
    if message.WhichOneof("request") != "response_body":
        return
    requests = gateway.requests
    attributes = message.attributes[ATTRIBUTES].fields
    code = attributes.get("response.code")
    request_id = requests.observe_start(
        _text(attributes, "request.id"),
        int(code.number_value) if code is not None else 0,
        _text(attributes, "upstream.address"),
    )
    if request_id is None:
        return
    while True:
        body = message.response_body
        requests.observe_body(request_id, body.body, body.end_of_stream)
        if body.end_of_stream:
            return
        message = await stream.read()
        if message is grpc.aio.EOF:
            return


def _text(attributes: Any, name: str) -> str:
    value = attributes.get(name)
    return value.string_value if value is not None else ""


def access_log_handler(gateway: Gateway) -> grpc.GenericRpcHandler:
    """The access log service: one long-lived stream per Envoy worker, batched entries."""
    async def stream_access_logs(requests: Any, _context: grpc.aio.ServicerContext) -> bytes:
        async for message in requests:
            for entry in message.http_logs.log_entry:
                try:
                    _access_logged(gateway, entry)
                except Exception as exc:  # a bug of ours: this entry is lost (release_lost), not the stream
                    stream_failed(gateway, "access_log", exc)
        return b""  # an empty StreamAccessLogsResponse

    return grpc.method_handlers_generic_handler(
        ACCESS_LOG_SERVICE,
        {
            "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                stream_access_logs,
                request_deserializer=tolerant(als_pb2.StreamAccessLogsMessage, gateway),
                response_serializer=as_bytes,
            )
        },
    )


def _access_logged(gateway: Gateway, entry: accesslog_pb2.HTTPAccessLogEntry) -> None:
    common = entry.common_properties
    flags = common.response_flags
    status = entry.response.response_code.value
    # The client went away, or the upstream broke off an answer it had started.
    cut_off = (
        flags.downstream_connection_termination
        or flags.downstream_remote_reset
        or (200 <= status < 300 and (flags.upstream_connection_termination or flags.upstream_remote_reset))
    )
    upstream = common.upstream_remote_address.socket_address
    served = f"{upstream.address}:{upstream.port_value}" if upstream.address else ""
    extracted = common.metadata.filter_metadata.get(METADATA_NAMESPACE)
    timings = None
    if extracted is not None:
        timings = timings_from_metadata(
            {key: value.number_value for key, value in extracted.fields.items() if value.HasField("number_value")}
        )
    gateway.requests.access_logged(entry.request.request_id, status, served, bool(cut_off), timings)


PLANE = OwnEnvoy()
