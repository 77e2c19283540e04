"""The Endpoint Picker's stream: llm-ring behind a Gateway API Inference Extension gateway.

Such a gateway (Envoy AI Gateway, kgateway, Istio, ...) configures the ext_proc filter itself
(docs/inference-gateway.md): no CEL attributes, no access log, often every phase sent and the
bodies FULL_DUPLEX_STREAMED or BUFFERED. So one stream carries one whole HTTP request:

  request headers (path, content type, ids and session headers read from the header map; the subset hint from the
  metadata context) -> the body, read whole (chunks in full-duplex mode, one message buffered)
  -> the pick (``PickerAnswers``), answering the headers, or the body when
  Envoy waits for the headers' answer before it sends a buffered body -> the body given back:
  each chunk as a streamed_response in full-duplex mode -> trailers answered -> the response
  headers (status, the endpoint that served it from ``envoy.lb``) and every body chunk,
  answered as they come (an SSE stream is never held) and watched for the answer's end and
  its timings -> the stream closes: the request is over (``PendingRequests.stream_ended``, lifecycle.py).

A request that is no generation is answered by the gateway itself (surface.py: the fleet's
models, its health, CORS preflights, 404/405 for the rest): nothing else reaches a replica.
The protocol's modes come with the first message (``protocol_config``).

The pick's shape (``PickerAnswers``) answers the request headers or, when Envoy waits for that
answer before it sends a BUFFERED body, the request body: ONE endpoint in the header and in
``envoy.lb`` (an ORIGINAL_DST cluster reading the header answers 503 to a list), the next one as
``x-gateway-destination-endpoint-fallback`` in ``envoy.lb``. No id of ours is set: the gateway's
own is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.envoy.contract import DESTINATION, DESTINATION_FALLBACK, LB_NAMESPACE, SERVED, SUBSET, SUBSET_NAMESPACE
from extproc.envoy.surface import Generation, Preflight, ReadOnly, Refused, classify
from extproc.service.answers import (
    REPLICA_CORS_REMOVED,
    answer_to,
    header_option,
    immediate,
    immediate_headers,
    more_headers,
    pick_headers,
    response_headers,
)
from extproc.service.dataplanes.plane import Serving, header_values
from extproc.service.waiting_room import HeldReads

Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = Mode.FULL_DUPLEX_STREAMED
BUFFERED = Mode.BUFFERED
NO_BODY = Mode.NONE
WANTED = (":method", ":path", "content-type", "x-turn", "x-request-id", "origin", "access-control-request-headers")

NO_PREFLIGHT = Refused(405, "CORS is not enabled for this origin (service.cors_origins)", "method_not_allowed",
                       "GET, POST")
HEADERS_CONTINUE = pb.ProcessingResponse(request_headers=pb.HeadersResponse()).SerializeToString()
REQUEST_BODY_CONTINUE = pb.ProcessingResponse(request_body=pb.BodyResponse()).SerializeToString()
REQUEST_TRAILERS_CONTINUE = pb.ProcessingResponse(request_trailers=pb.TrailersResponse()).SerializeToString()
RESPONSE_BODY_CONTINUE = pb.ProcessingResponse(response_body=pb.BodyResponse()).SerializeToString()
RESPONSE_TRAILERS_CONTINUE = pb.ProcessingResponse(response_trailers=pb.TrailersResponse()).SerializeToString()


def request_body_answer(mode: int, chunk: bytes, end_of_stream: bool) -> bytes:
    """Full-duplex mode: Envoy forwards only what the processor streams back; else: continue."""
    if mode != FULL_DUPLEX:
        return REQUEST_BODY_CONTINUE
    return pb.ProcessingResponse(request_body=_streamed(chunk, end_of_stream)).SerializeToString()


def response_body_answer(mode: int, chunk: bytes, end_of_stream: bool) -> bytes:
    if mode != FULL_DUPLEX:
        return RESPONSE_BODY_CONTINUE
    return pb.ProcessingResponse(response_body=_streamed(chunk, end_of_stream)).SerializeToString()


def _streamed(chunk: bytes, end_of_stream: bool) -> pb.BodyResponse:
    mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream))
    return pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))


def subset_hint(message: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the gateway allows (``envoy.lb.subset_hint``), or None when it names none."""
    namespace = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    value = namespace.fields.get(SUBSET) if namespace is not None else None
    if value is None:
        return None
    if value.WhichOneof("kind") == "list_value":
        return frozenset(item.string_value for item in value.list_value.values if item.string_value)
    return frozenset(part.strip() for part in value.string_value.split(",") if part.strip())


def served_endpoint(message: pb.ProcessingRequest) -> str:
    """``envoy.lb`` / ``x-gateway-destination-endpoint-served``, when the gateway reports it."""
    namespace = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
    value = namespace.fields.get(SERVED) if namespace is not None else None
    return value.string_value if value is not None else ""


@dataclass(frozen=True, slots=True)
class PickerAnswers:
    """The pick's shape for an Endpoint Picker's gateway (module docstring)."""

    to_body: bool  # the answer to a BUFFERED body Envoy sent once the headers were answered

    access_logged = False  # the stream's end says when the request is over
    waits_announced = False  # a gateway keeps its own message timeout (docs/flow-control.md)

    def pick(self, destination: str, replica: str, reason: str, streamed: bool, routing_headers: bool,
             replica_key: str) -> bytes:
        endpoint, _, fallbacks = destination.partition(",")
        # llama.cpp closes a connection right after a streamed answer, unannounced: a gateway's
        # pool cluster (keep-alive) would send the next turn on it and get a 503. Asked to close,
        # it says so, and Envoy opens a fresh connection (docs/inference-gateway.md)
        own = [header_option(DESTINATION, endpoint), *([header_option("connection", "close")] if streamed else [])]
        metadata = struct_pb2.Struct()
        lb = metadata.get_or_create_struct(LB_NAMESPACE)
        lb[DESTINATION] = endpoint
        if fallbacks:
            lb[DESTINATION_FALLBACK] = fallbacks.partition(",")[0]
        headers = pick_headers(replica, reason, routing_headers, replica_key, *own)
        common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=headers), clear_route_cache=True)
        return answer_to(common, self.to_body, dynamic_metadata=metadata)

    def headers(self, headers: list[base_pb2.HeaderValueOption]) -> bytes:
        return more_headers(headers, self.to_body)

    def named(self, request_id: str) -> bytes:
        return b""


TO_HEADERS = PickerAnswers(to_body=False)
TO_BODY = PickerAnswers(to_body=True)


class EndpointPicker:
    """The Endpoint Picker protocol: any stream opened by request headers that no other mode claims."""

    name = "endpoint-picker"

    def claims(self, first: pb.ProcessingRequest, own_envoy: bool) -> str:
        return "picker" if first.WhichOneof("request") == "request_headers" else ""

    async def serve(self, first: pb.ProcessingRequest, stream: HeldReads, serving: Serving) -> None:
        await PickerStream(serving, stream).serve(first)


class PickerStream:
    """One HTTP request's ext_proc stream from an Endpoint Picker's gateway (module docstring)."""

    def __init__(self, serving: Serving, context: HeldReads) -> None:
        self.serving = serving
        self.gateway = serving.gateway
        self.wanted = WANTED + serving.headers_read()
        self.context = context
        self.request_mode = NO_BODY
        self.response_mode = NO_BODY
        self.request_id: str | None = None  # ours, while the request is tracked
        self.cors: list[tuple[str, str]] = []  # the answer's CORS headers, when its origin is allowed

    async def serve(self, first: pb.ProcessingRequest) -> None:
        self.request_mode = first.protocol_config.request_body_mode
        self.response_mode = first.protocol_config.response_body_mode
        try:
            if await self._request(first):
                await self._rest()
        finally:  # whatever ended the stream (its close, a cancel, a reset) ends the request
            if self.request_id is not None:
                self.gateway.requests.stream_ended(self.request_id)

    async def _request(self, first: pb.ProcessingRequest) -> bool:
        """Answer the request's headers and body; False when the answer ended the request."""
        values = header_values(first.request_headers, self.wanted)
        asked = classify(values.get(":method", ""), values.get(":path", ""))
        self.cors = self.gateway.cors.answer_headers(values.get("origin", ""))
        if not isinstance(asked, Generation):
            await self.context.write(self._answer_locally(asked, values))
            return False
        # BUFFERED: Envoy sends the body only once the headers are answered (unless told not to wait);
        # a request without a body is decided on its headers (it is refused: a generation has a body)
        config, headers_end = first.protocol_config, first.request_headers.end_of_stream
        waits = (self.request_mode == BUFFERED and not config.send_body_without_waiting_for_header_response
                 and not headers_end)
        if waits:
            await self.context.write(HEADERS_CONTINUE)
        chunks, trailers = await self._read_body(headers_end)
        if chunks is None:
            return False
        shape = TO_BODY if waits else TO_HEADERS
        answer, self.request_id = await self.serving.route(
            self.context, shape, values, path=asked.path, content_type=values.get("content-type", ""),
            session_headers=values, turn=values.get("x-turn", ""), request_id=values.get("x-request-id", ""),
            body=b"".join(chunks), subset=subset_hint(first),
        )  # fmt: skip
        if not answer:  # the client went away while its request waited
            return False
        if self.request_id is None:  # refused: Envoy answers the client itself
            await self.context.write(answer + immediate_headers(self.cors) if self.cors else answer)
            return False
        if asked.rewritten:  # the replica gets the path it serves (no trailing slash)
            answer += shape.headers([header_option(":path", asked.path)])
        await self.context.write(answer)
        if not waits and self.request_mode != NO_BODY:
            for index, chunk in enumerate(chunks):
                last = index == len(chunks) - 1 and not trailers
                await self.context.write(request_body_answer(self.request_mode, chunk, last))
        if trailers:
            await self.context.write(REQUEST_TRAILERS_CONTINUE)
        return True

    def _answer_locally(self, asked: ReadOnly | Preflight | Refused, values: dict[str, str]) -> bytes:
        cors, local = self.cors, self.gateway.local
        if isinstance(asked, ReadOnly):
            return local.answer(asked, cors)
        if isinstance(asked, Preflight) and cors:
            return local.preflight(cors, values.get("access-control-request-headers", ""))
        return local.refuse(asked if isinstance(asked, Refused) else NO_PREFLIGHT, cors)

    def _cors_answer(self) -> bytes:
        """The answer's CORS headers, the replica's own removed (response_headers: merged into the answer)."""
        if not self.cors:
            return REPLICA_CORS_REMOVED
        return response_headers(self.cors, self.gateway.cors.replica_headers_removed(self.cors))

    async def _read_body(self, headers_end: bool) -> tuple[list[bytes] | None, bool]:
        """(the body's chunks, whether it ended with trailers); None when refused (413, or the stream ended)."""
        chunks: list[bytes] = []
        size, limit = 0, self.gateway.settings.max_body_bytes
        if headers_end or self.request_mode == NO_BODY:
            return chunks, False
        while True:
            message = await self.context.read()
            if message is grpc.aio.EOF:
                return None, False
            kind = message.WhichOneof("request")
            if kind == "request_trailers":
                return chunks, True
            if kind != "request_body":
                return None, False
            chunk = message.request_body.body
            size += len(chunk)
            if size > limit:
                self.gateway.metrics.errors["bad_request"] += 1
                await self.context.write(immediate(413, f"request body over {limit} bytes (service.max_body_bytes)",
                                                   "request_too_large"))
                return None, False
            chunks.append(chunk)
            if message.request_body.end_of_stream:
                return chunks, False

    async def _rest(self) -> None:
        """Every later phase, answered as it comes; the response watched for its end. A response
        phase is watched before it is answered: the answer lets Envoy pass it on, and a client that
        hangs up once it has read [DONE] ends this stream (cancelled) in the middle of a write."""
        requests, context = self.gateway.requests, self.context
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                return
            kind = message.WhichOneof("request")
            tracked = self.request_id
            if kind == "request_body":  # a passed-through request's body
                body = message.request_body
                await context.write(request_body_answer(self.request_mode, body.body, body.end_of_stream))
            elif kind == "request_trailers":
                await context.write(REQUEST_TRAILERS_CONTINUE)
            elif kind == "response_headers":
                headers = message.response_headers
                answer = requests.response_headers_answer(tracked)
                if tracked is not None:
                    status = header_values(headers, (":status",)).get(":status", "")
                    requests.observe_start(tracked, int(status) if status.isdigit() else 0, served_endpoint(message))
                    if headers.end_of_stream:
                        requests.observe_body(tracked, b"", True)
                await context.write(answer + self._cors_answer())
            elif kind == "response_body":
                body = message.response_body
                if tracked is not None:
                    requests.observe_body(tracked, body.body, body.end_of_stream)
                await context.write(response_body_answer(self.response_mode, body.body, body.end_of_stream))
            elif kind == "response_trailers":
                if tracked is not None:
                    requests.observe_body(tracked, b"", True)
                await context.write(RESPONSE_TRAILERS_CONTINUE)


PLANE = EndpointPicker()
