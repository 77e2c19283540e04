"""The Endpoint Picker's stream: llm-ring behind a Gateway API Inference Extension gateway.

Such a gateway (Envoy AI Gateway, kgateway, Istio, ...) configures the ext_proc filter itself
(docs/inference-gateway.md): no CEL attributes, no access log, often every phase sent and the
bodies FULL_DUPLEX_STREAMED or BUFFERED. So one stream carries one whole HTTP request:

  request headers (path, content type, ids and session headers read from the header map; the subset hint from the
  metadata context) -> the body, read whole (chunks in full-duplex mode, one message buffered)
  -> the pick (answers.py, the protocol's shape), answering the headers, or the body when
  Envoy waits for the headers' answer before it sends a buffered body -> the body given back:
  each chunk as a streamed_response in full-duplex mode -> trailers answered -> the response
  headers (status, the endpoint that served it from ``envoy.lb``) and every body chunk,
  answered as they come (an SSE stream is never held) and watched for the answer's end and
  its timings -> the stream closes: the request is over (``PendingRequests.stream_ended``, lifecycle.py).

A request that is no generation is answered by the gateway itself (surface.py: the fleet's
models, its health, CORS preflights, 404/405 for the rest): nothing else reaches a replica.
The protocol's modes come with the first message (``protocol_config``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.envoy.contract import LB_NAMESPACE, SERVED, SUBSET, SUBSET_NAMESPACE
from extproc.envoy.surface import Generation, Preflight, ReadOnly, Refused, classify
from extproc.service.answers import (
    REPLICA_CORS_REMOVED,
    Phase,
    header_option,
    immediate,
    immediate_headers,
    more_headers,
    response_headers,
)
from extproc.service.gateway import Gateway
from extproc.service.offload import BodyParser
from extproc.service.waiting_room import HeldReads, WaitingRoom

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


def header_values(headers: pb.HttpHeaders, wanted: Iterable[str]) -> dict[str, str]:
    """The wanted headers of an ext_proc header map (values in raw_value since Envoy 1.27, else value)."""
    names = set(wanted)
    return {
        header.key: header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        for header in headers.headers.headers
        if header.key in names
    }


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


async def route_body(gateway: Gateway, parser: BodyParser | None, room: WaitingRoom | None, stream: Any,
                     tenant: str, objective: str, **request: Any) -> tuple[bytes, str | None]:
    """Gateway.route_request (or route_shared, with a store) for a whole body, or through flow
    control's waiting room when it is on (``stream``: the request's ext_proc stream; ``tenant``,
    ``objective``: its flow headers' values); a large body is parsed off the event loop first
    (offload.py). Both kinds of stream decide through here. An empty answer (waiting_room.LEFT):
    the client went away while its request waited, nothing is to be said."""
    body, path, content_type = request["body"], request["path"], request["content_type"]
    if parser is not None and parser.takes(body):
        block_chars = gateway.router.policy.prefix_block_chars
        request["parsed_elsewhere"] = await parser.parse(path, content_type, body, block_chars,
                                                         gateway.sessions.fields)
    if room is not None:
        return await room.route(stream, tenant=tenant, objective=objective, **request)
    if gateway.store is None:
        return gateway.route_request(**request)
    return await gateway.route_shared(**request)  # one round trip to the shared store first


class PickerStream:
    """One HTTP request's ext_proc stream from an Endpoint Picker's gateway (module docstring)."""

    def __init__(self, gateway: Gateway, parser: BodyParser | None, room: WaitingRoom | None,
                 context: HeldReads) -> None:
        self.gateway = gateway
        self.parser = parser
        self.room = room  # flow control's, when on
        self.wanted = WANTED + (room.headers if room is not None else ())
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
        values = header_values(first.request_headers, (*self.wanted, *self.gateway.sessions.headers))
        asked = classify(values.get(":method", ""), values.get(":path", ""))
        self.cors = self.gateway.cors.answer_headers(values.get("origin", ""))
        if not isinstance(asked, Generation):
            await self.context.write(self._answer_locally(asked, values))
            return False
        subset = subset_hint(first)
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
        phase: Phase = "body" if waits else "headers"
        answer, self.request_id = await self._route(values, asked.path, b"".join(chunks), phase, subset)
        if not answer:  # the client went away while its request waited
            return False
        if self.request_id is None:  # refused: Envoy answers the client itself
            await self.context.write(answer + immediate_headers(self.cors) if self.cors else answer)
            return False
        if asked.rewritten:  # the replica gets the path it serves (no trailing slash)
            answer += more_headers([header_option(":path", asked.path)], phase)
        await self.context.write(answer)
        if not waits and self.request_mode != NO_BODY:
            for index, chunk in enumerate(chunks):
                last = index == len(chunks) - 1 and not trailers
                await self.context.write(request_body_answer(self.request_mode, chunk, last))
        if trailers:
            await self.context.write(REQUEST_TRAILERS_CONTINUE)
        return True

    def _answer_locally(self, asked: ReadOnly | Preflight | Refused, values: dict[str, str]) -> bytes:
        cors = self.cors
        if isinstance(asked, ReadOnly):
            return self.gateway.answer_locally(asked, cors)
        if isinstance(asked, Preflight) and cors:
            return self.gateway.preflight(cors, values.get("access-control-request-headers", ""))
        return self.gateway.refuse(asked if isinstance(asked, Refused) else NO_PREFLIGHT, cors)

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

    async def _route(
        self, values: dict[str, str], path: str, body: bytes, phase: Phase, subset: frozenset[str] | None
    ) -> tuple[bytes, str | None]:
        room = self.room
        tenant, objective = (values.get(room.headers[0], ""), values.get(room.headers[1], "")) \
            if room is not None else ("", "")
        return await route_body(
            self.gateway, self.parser, room, self.context, tenant, objective, path=path,
            content_type=values.get("content-type", ""), session_headers=values, turn=values.get("x-turn", ""),
            request_id=values.get("x-request-id", ""), body=body, phase=phase, subset=subset,
        )  # fmt: skip

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
