"""The service's answers to Envoy, as serialized ProcessingResponses (the wire encoding).

The hot path builds few protobufs: a pick's answer is cached per (replica, reason, streamed)
and the per-request headers (the predicted cached tokens, the request id) are appended as
bytes. Protobuf merges repeated fields of concatenated messages, so cached answer + a
headers-only message = the answer with those headers added.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from extproc.envoy.contract import DESTINATION, OBSERVE, PREDICTED_CACHED, REQUEST_ID, ROUTE_REASON, ROUTED_TO

PREDICTED_HEADERS_KEPT = 1 << 16  # serialized x-route-predicted-cached-tokens values kept

# The body passes unchanged (the answer to the request body, after the headers' answer).
BODY_CONTINUE = pb.ProcessingResponse(request_body=pb.BodyResponse()).SerializeToString()


def route_answer(destination: str, replica: str, reason: str, streamed: bool, routing_headers: bool = True) -> bytes:
    """Envoy's answer for a pick: ``destination`` (the endpoint, then its fallbacks,
    comma-separated) in header and metadata; a streamed answer is marked to be observed
    (the Envoy config routes on that header). routing_headers (service.routing_headers): the
    replica and the reason too, which Envoy copies into the response (a header left unset is
    not added: docs/security.md)."""
    headers = [header_option(DESTINATION, destination)]
    if routing_headers:
        headers += [header_option(ROUTED_TO, replica), header_option(ROUTE_REASON, reason)]
    mutation = pb.HeaderMutation(set_headers=headers + ([header_option(OBSERVE, "1")] if streamed else []))
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct("envoy.lb")[DESTINATION] = destination
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        ),
        dynamic_metadata=metadata,
    ).SerializeToString()


def request_id_header(request_id: str) -> bytes:
    return more_headers([header_option(REQUEST_ID, request_id)])


def immediate(status: int, message: str, **details: Any) -> bytes:
    """Envoy answers the client itself with this status and a JSON error body."""
    body = orjson.dumps({"error": message, **details})
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=[header_option("content-type", "application/json")]),
            body=body,
            details=f"llm_ring_{status}",
        )
    ).SerializeToString()


def header_option(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def more_headers(headers: list[base_pb2.HeaderValueOption]) -> bytes:
    """A serialized ProcessingResponse that only sets headers (appended to a cached answer)."""
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=headers))
        )
    ).SerializeToString()


class AnswerCache:
    """Serialized answers kept for reuse: a pick's answer per (replica, reason, streamed),
    valid until the replica set or its health changes (``forget_routes``), and the
    predicted-cached-tokens header per value seen (at most PREDICTED_HEADERS_KEPT)."""

    def __init__(self, routing_headers: bool = True) -> None:
        self.routing_headers = routing_headers
        self._routes: dict[tuple[str, str, bool], bytes] = {}
        self._predicted: dict[int, bytes] = {}

    def route(self, replica: str, reason: str, streamed: bool, destination: Callable[[str], str]) -> bytes:
        """The answer for a pick; ``destination(replica)`` gives its endpoints when not cached."""
        key = (replica, reason, streamed)
        answer = self._routes.get(key)
        if answer is None:
            answer = self._routes[key] = route_answer(destination(replica), replica, reason, streamed,
                                                             self.routing_headers)
        return answer

    def forget_routes(self) -> None:
        self._routes.clear()

    def predicted_cached(self, tokens: int) -> bytes:
        header = self._predicted.get(tokens)
        if header is None:
            if len(self._predicted) >= PREDICTED_HEADERS_KEPT:
                self._predicted.clear()
            header = self._predicted[tokens] = more_headers([header_option(PREDICTED_CACHED, str(tokens))])
        return header
