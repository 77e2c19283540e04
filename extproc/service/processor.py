"""The gRPC servicer Envoy talks to: ExternalProcessor, one stream per HTTP request and filter.

Each stream goes to the data plane whose mode its first message shows (dataplanes/): our own
Envoy's route and observe streams, only where that Envoy alone connects (``own_envoy``), or an
Endpoint Picker's. Responses are written as pre-serialized bytes (the method's serializer
passes bytes through), so the hot path allocates no response protobufs.
"""

from __future__ import annotations

from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.service.dataplanes.plane import Serving, as_bytes, stream_failed, tolerant
from extproc.service.dataplanes.registry import choose
from extproc.service.gateway import Gateway
from extproc.service.offload import BodyParser
from extproc.service.waiting_room import HeldReads, WaitingRoom

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def handler(gateway: Gateway, parser: BodyParser | None, room: WaitingRoom | None = None, *,
            own_envoy: bool) -> grpc.GenericRpcHandler:
    """room: flow control's waiting room (None: off)."""
    processor = Processor(gateway, parser, room, own_envoy=own_envoy)
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Process": grpc.stream_stream_rpc_method_handler(
                processor.process,
                request_deserializer=tolerant(pb.ProcessingRequest, gateway),
                response_serializer=as_bytes,
            )
        },
    )


class Processor:
    def __init__(self, gateway: Gateway, parser: BodyParser | None = None, room: WaitingRoom | None = None, *,
                 own_envoy: bool) -> None:
        self.serving = Serving(gateway, parser, room)
        self.own_envoy = own_envoy  # our Envoy's route and observe streams too (module docstring)

    async def process(self, _requests: Any, context: grpc.aio.ServicerContext) -> None:
        stream = "route"
        try:
            message = await context.read()
            if message is grpc.aio.EOF:
                return
            chosen = choose(message, self.own_envoy)
            if chosen is None:
                return
            plane, stream = chosen
            held = HeldReads(context)  # a read started while the request waited is the next one
            try:
                await plane.serve(message, held, self.serving)
            finally:
                held.drop()
        except Exception as exc:  # a bug of ours: counted, and Envoy applies fail_open
            stream_failed(self.serving.gateway, stream, exc)
            await context.abort(grpc.StatusCode.INTERNAL, "llm-ring: routing failed")
