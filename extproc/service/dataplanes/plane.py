"""What a data plane is (``DataPlane``) and what its streams route through (``Serving``).

A data plane is one way Envoy reaches the service over ext_proc: its module recognises the
first message of its streams, reads the request, answers it in its own shape (``AnswerShape``,
answers.py) and learns its end, handing each event to the gateway's ``requests`` (lifecycle.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.service.answers import AnswerShape
from extproc.service.bounds import bounded
from extproc.service.gateway import Gateway
from extproc.service.offload import BodyParser
from extproc.service.waiting_room import HeldReads, WaitingRoom
from extproc.service.wire import M, decode_tolerant

log = structlog.get_logger("extproc.service")


class DataPlane(Protocol):
    @property
    def name(self) -> str:
        """The mode's name (the registry's key)."""

    def claims(self, first: pb.ProcessingRequest, own_envoy: bool) -> str:
        """The name of the stream ``first`` opens (stream_failures' label) when it is one of this
        mode's, else "". own_envoy: the stream came where our own Envoy alone connects."""

    async def serve(self, first: pb.ProcessingRequest, stream: HeldReads, serving: Serving) -> None:
        """Read the request, answer it, and learn its end."""


@dataclass(frozen=True, slots=True)
class Serving:
    """The service a data plane's streams route through."""

    gateway: Gateway
    parser: BodyParser | None = None  # large bodies are parsed there (offload.py); None: all inline
    room: WaitingRoom | None = None  # flow control's waiting room (None: off)

    def headers_read(self) -> tuple[str, ...]:
        """The request headers the service reads: the session headers and flow control's."""
        flow = self.room.headers if self.room is not None else ()
        return (*self.gateway.reader.sessions.headers, *flow)

    async def route(self, stream: HeldReads, shape: AnswerShape, headers: Mapping[str, str],
                    **request: Any) -> tuple[bytes, str | None]:
        """Gateway.route_request (or route_shared, with a store) for a whole body, or through flow
        control's waiting room when it is on (``stream``: the request's ext_proc stream;
        ``headers``: the request's headers, flow control's among them); a large body is parsed off
        the event loop first (offload.py). An empty answer (waiting_room.LEFT): the client went
        away while its request waited, nothing is to be said."""
        gateway, parser, room = self.gateway, self.parser, self.room
        body, path, content_type = request["body"], request["path"], request["content_type"]
        if parser is not None and parser.takes(body):
            block_chars = gateway.router.policy.prefix_block_chars
            request["parsed_elsewhere"] = await parser.parse(path, content_type, body, block_chars,
                                                             gateway.reader.sessions.fields)
        if room is not None:
            tenant, objective = (headers.get(name, "") for name in room.headers)
            return await room.route(stream, shape=shape, tenant=tenant, objective=objective, **request)
        if gateway.store is None:
            return gateway.route_request(shape=shape, **request)
        return await gateway.route_shared(shape=shape, **request)  # one round trip to the shared store first


def header_values(headers: pb.HttpHeaders, wanted: Iterable[str]) -> dict[str, str]:
    """The wanted headers of an ext_proc header map (values in raw_value since Envoy 1.27, else value)."""
    names = set(wanted)
    return {
        header.key: header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        for header in headers.headers.headers
        if header.key in names
    }


def tolerant(message_class: type[M], gateway: Gateway) -> Callable[[bytes], M]:
    """A deserializer no client byte can make fail (wire.py): a failing one ends the stream."""
    return lambda data: decode_tolerant(message_class, data, gateway.metrics)


def as_bytes(message: bytes) -> bytes:
    """The serializer of pre-serialized answers: the hot path allocates no response protobufs."""
    return message


def stream_failed(gateway: Gateway, stream: str, exc: Exception) -> None:
    """One bounded line per failure, no traceback (a client could repeat it per request)."""
    gateway.metrics.stream_failures[stream] += 1
    log.error("ext_proc_stream_failed", stream=stream, error=type(exc).__name__, detail=bounded(str(exc), 200))
