"""The gRPC servicers Envoy talks to: ExternalProcessor (one stream per HTTP request and
filter) and the access log service (one long-lived stream per Envoy worker, batched entries).

Our own Envoy's protocol (route streams carrying CEL attributes, observe streams, the access
log that ends each request) is served only where that Envoy alone connects, the abstract
socket (``own_envoy``); the picker port speaks the Endpoint Picker protocol alone, whose
stream ends its request, so nothing that reaches it can release, time or pin another's load.

Responses are written as pre-serialized bytes (the method's serializer passes bytes
through), so the hot path allocates no response protobufs. A stream whose first message is
in observability mode comes from the "observe" filter and is never answered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import structlog
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.envoy.contract import METADATA_NAMESPACE
from extproc.envoy.surface import generation_path, read_only_path
from extproc.service.answers import BODY_CONTINUE, immediate
from extproc.service.bodies import timings_from_metadata
from extproc.service.gateway import Gateway, bounded
from extproc.service.offload import BodyParser
from extproc.service.picker import PickerStream, header_values, route_body
from extproc.service.waiting_room import HeldReads, WaitingRoom
from extproc.service.wire import M, decode_tolerant

log = structlog.get_logger("extproc.service")
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
ACCESS_LOG_SERVICE = "envoy.service.accesslog.v3.AccessLogService"
ATTRIBUTES = "envoy.filters.http.ext_proc"  # the key Envoy files CEL attributes under
EMPTY_BODY = immediate(400, "empty body: expected a JSON object", "empty_body")


def handler(gateway: Gateway, parser: BodyParser | None, room: WaitingRoom | None = None, *,
            own_envoy: bool) -> grpc.GenericRpcHandler:
    """room: flow control's waiting room (None: off)."""
    processor = Processor(gateway, parser, room, own_envoy=own_envoy)
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Process": grpc.stream_stream_rpc_method_handler(
                processor.process,
                request_deserializer=_tolerant(pb.ProcessingRequest, gateway),
                response_serializer=_as_bytes,
            )
        },
    )


def access_log_handler(gateway: Gateway) -> grpc.GenericRpcHandler:
    async def stream_access_logs(requests: Any, _context: grpc.aio.ServicerContext) -> bytes:
        async for message in requests:
            for entry in message.http_logs.log_entry:
                try:
                    _access_logged(gateway, entry)
                except Exception as exc:  # a bug of ours: this entry is lost (release_lost), not the stream
                    _stream_failed(gateway, "access_log", exc)
        return b""  # an empty StreamAccessLogsResponse

    return grpc.method_handlers_generic_handler(
        ACCESS_LOG_SERVICE,
        {
            "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                stream_access_logs,
                request_deserializer=_tolerant(als_pb2.StreamAccessLogsMessage, gateway),
                response_serializer=_as_bytes,
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


def _tolerant(message_class: type[M], gateway: Gateway) -> Callable[[bytes], M]:
    """A deserializer no client byte can make fail (wire.py): a failing one ends the stream."""
    return lambda data: decode_tolerant(message_class, data, gateway.metrics)


def _as_bytes(message: bytes) -> bytes:
    return message


def _stream_failed(gateway: Gateway, stream: str, exc: Exception) -> None:
    """One bounded line per failure, no traceback (a client could repeat it per request)."""
    gateway.metrics.stream_failures[stream] += 1
    log.error("ext_proc_stream_failed", stream=stream, error=type(exc).__name__, detail=bounded(str(exc), 200))


class Processor:
    def __init__(self, gateway: Gateway, parser: BodyParser | None = None, room: WaitingRoom | None = None, *,
                 own_envoy: bool) -> None:
        self.gateway = gateway
        self.parser = parser  # large bodies are parsed there (offload.py); None: all inline
        self.room = room  # flow control's waiting room (None: off)
        self.own_envoy = own_envoy  # our Envoy's route and observe streams too (module docstring)
        self.flow_headers = room.headers if room is not None else ()  # naming a request's tenant and objective

    async def process(self, _requests: Any, context: grpc.aio.ServicerContext) -> None:
        stream = "route"
        try:
            message = await context.read()
            if message is grpc.aio.EOF:
                return
            if self.own_envoy and message.observability_mode:
                stream = "observe"
                await self._observe(message, context)
            elif message.WhichOneof("request") == "request_headers":
                held = HeldReads(context)  # a read started while the request waited is the next one
                try:
                    if self.own_envoy and ATTRIBUTES in message.attributes:  # our Envoy (config.py) asks for them
                        await self._route(message, held)
                    else:  # an Endpoint Picker's gateway: one stream carries the whole request (picker.py)
                        stream = "picker"
                        await PickerStream(self.gateway, self.parser, self.room, held).serve(message)
                finally:
                    held.drop()
        except Exception as exc:  # a bug of ours: counted, and Envoy applies fail_open
            _stream_failed(self.gateway, stream, exc)
            await context.abort(grpc.StatusCode.INTERNAL, "llm-ring: routing failed")

    async def _route(self, message: pb.ProcessingRequest, context: HeldReads) -> None:
        """The headers (with attributes), then the body, sent without waiting (one chunk: Envoy's
        buffer filter comes first). The headers get the pick, the body passes unchanged, and the
        stream ends there: Envoy's access log entry says when the HTTP request is over. Envoy's
        routes (config.py, from surface.py) send here only a POST on a generation path or a GET
        on a read-only one, which the gateway answers itself."""
        attributes = message.attributes[ATTRIBUTES].fields
        path = _text(attributes, "request.url_path")
        read_only = read_only_path(path)
        if read_only is not None:
            await context.write(self.gateway.answer_locally(read_only))
            return
        if message.request_headers.end_of_stream:  # a POST without a body
            await context.write(EMPTY_BODY)
            return
        # the session headers, and flow control's (read here: no attributes for Envoy to evaluate)
        values = header_values(message.request_headers, (*self.gateway.sessions.headers, *self.flow_headers))
        chunks: list[bytes] = []
        while True:
            message = await context.read()
            if message is grpc.aio.EOF or message.WhichOneof("request") != "request_body":
                return
            chunks.append(message.request_body.body)
            if message.request_body.end_of_stream:
                break
        generation = generation_path(path)
        tenant_header, objective_header = self.room.headers if self.room is not None else ("", "")
        tenant, objective = values.get(tenant_header, ""), values.get(objective_header, "")
        answer, routed_id = await route_body(
            self.gateway, self.parser, self.room, context, tenant, objective,
            path=generation.path if generation is not None else path,
            content_type=_text(attributes, "request.headers['content-type']"),
            session_headers=values,
            turn=_text(attributes, "request.headers['x-turn']"), request_id=_text(attributes, "request.id"),
            body=chunks[0] if len(chunks) == 1 else b"".join(chunks),
        )  # fmt: skip
        if not answer:  # the client went away while its request waited
            return
        await context.write(answer)
        if routed_id is None:  # Envoy answers the client itself: nothing more to say
            return
        for _ in chunks:  # each streamed chunk is answered, in order: pass it on unchanged
            await context.write(BODY_CONTINUE)

    async def _observe(self, message: Any, context: grpc.aio.ServicerContext) -> None:
        """Response body chunks, never answered; the first one carries the attributes."""
        if message.WhichOneof("request") != "response_body":
            return
        requests = self.gateway.requests
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
            message = await context.read()
            if message is grpc.aio.EOF:
                return


def _text(attributes: Any, name: str) -> str:
    value = attributes.get(name)
    return value.string_value if value is not None else ""
