"""The ExternalProcessor gRPC servicer: one stream per HTTP request and filter.

Responses are written as pre-serialized bytes (the method's serializer passes bytes
through), so the hot path allocates no response protobufs. A stream whose first message is
in observability mode comes from the "observe" filter and is never answered.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.service.envoy import REQUEST_ID, SERVED
from extproc.service.gateway import CONTINUE_HEADERS, Gateway, immediate

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
ROUTE_HEADERS = frozenset({":path", ":method", "content-type", "x-conversation-id", "x-turn", REQUEST_ID})
RESPONSE_HEADERS = frozenset({":status", "content-type", REQUEST_ID, SERVED})
EMPTY_BODY = immediate(400, "empty body: expected a JSON object")


def handler(gateway: Gateway) -> grpc.GenericRpcHandler:
    processor = Processor(gateway)
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Process": grpc.stream_stream_rpc_method_handler(
                processor.process,
                request_deserializer=pb.ProcessingRequest.FromString,
                response_serializer=_as_bytes,
            )
        },
    )


def _as_bytes(message: bytes) -> bytes:
    return message


class Processor:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def process(self, _requests: Any, context: grpc.aio.ServicerContext) -> None:
        message = await context.read()
        if message is grpc.aio.EOF:
            return
        if message.observability_mode:
            await self._observe(message, context)
            return
        await self._route(message, context)

    async def _route(self, message: pb.ProcessingRequest, context: grpc.aio.ServicerContext) -> None:
        if message.WhichOneof("request") != "request_headers":
            return  # not a configuration of ours: nothing to do
        request_headers = message.request_headers
        if request_headers.end_of_stream:  # a POST without a body
            await context.write(EMPTY_BODY)
            return
        headers = _pick(request_headers.headers.headers, ROUTE_HEADERS)
        await context.write(CONTINUE_HEADERS)
        message = await context.read()
        if message is grpc.aio.EOF or message.WhichOneof("request") != "request_body":
            return
        request_id, answer = self.gateway.decide(headers, message.request_body.body)
        if request_id is None:
            await context.write(answer)
            return
        try:
            await context.write(answer)
            await context.read()  # Envoy ends the stream when the HTTP request is over
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass  # Envoy often ends by cancelling: the request is over all the same
        finally:
            self.gateway.route_ended(request_id)

    async def _observe(self, message: Any, context: grpc.aio.ServicerContext) -> None:
        gateway = self.gateway
        request_id = None
        while message is not grpc.aio.EOF:
            kind = message.WhichOneof("request")
            if kind == "response_body":
                if request_id is not None:
                    body = message.response_body
                    gateway.observe_body(request_id, body.body, body.end_of_stream)
                    if body.end_of_stream:
                        return
            elif kind == "response_headers":
                response_headers = message.response_headers
                headers = _pick(response_headers.headers.headers, RESPONSE_HEADERS)
                request_id = gateway.observe_headers(headers, response_headers.end_of_stream)
                if request_id is None or response_headers.end_of_stream:
                    return
            message = await context.read()


def _pick(headers: Any, wanted: frozenset[str]) -> dict[str, str]:
    return {h.key: h.raw_value.decode("latin-1") for h in headers if h.key in wanted}
