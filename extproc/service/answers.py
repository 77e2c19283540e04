"""The service's answers to Envoy, as serialized ProcessingResponses (the wire encoding).

The hot path builds few protobufs: a pick's answer is cached per (replica, reason, streamed,
phase) and the per-request headers (the predicted cached tokens, the request id) are appended
as bytes. Protobuf merges repeated fields of concatenated messages, so cached answer + a
headers-only message of the same phase = the answer with those headers added.

Two shapes of pick (``Phase``): "own", for the Envoy llm-ring renders (the endpoint list
"pick,fallback,..." in header and metadata, which its cluster reads with Override Host; the
streamed-answer mark; our request id), and the Endpoint Picker protocol's, answering the
request headers ("headers") or, in BUFFERED body mode, the request body ("body"): ONE endpoint
in the header and in ``envoy.lb`` (an ORIGINAL_DST cluster reading the header answers 503 to
a list), the next one as ``x-gateway-destination-endpoint-fallback`` in ``envoy.lb``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, Literal

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from extproc.envoy.contract import (
    DESTINATION,
    DESTINATION_FALLBACK,
    LB_NAMESPACE,
    OBSERVE,
    PREDICTED_CACHED,
    QUEUE_WAIT,
    REPLICA_KEY_HEADER,
    REQUEST_ID,
    ROUTE_REASON,
    ROUTED_TO,
)
from extproc.envoy.cors import REPLICA_CORS_HEADERS
from extproc.envoy.surface import error_document

NUMBER_HEADERS_KEPT = 1 << 16  # serialized x-route-predicted-cached-tokens and queue-wait values kept

# The body passes unchanged (the answer to the request body, after the headers' answer).
BODY_CONTINUE = pb.ProcessingResponse(request_body=pb.BodyResponse()).SerializeToString()


Phase = Literal["own", "headers", "body"]


def route_answer(
    destination: str, replica: str, reason: str, streamed: bool, phase: Phase = "own", routing_headers: bool = True,
    replica_key: str = "",
) -> bytes:
    """Envoy's answer for a pick. ``destination``: the endpoint, then its fallbacks,
    comma-separated. Our own Envoy gets the whole list in header and metadata, and a streamed
    answer is marked to be observed (its config routes on that header); an Endpoint Picker's
    gateway gets the shape of the protocol (module docstring). routing_headers
    (service.routing_headers): the replica and the reason too, which reach the response (a header
    left unset is not added: docs/security.md). replica_key: the replicas' API key, set as
    ``authorization: Bearer <key>`` over whatever the client sent ("": none)."""
    endpoint, _, fallbacks = destination.partition(",")
    metadata = struct_pb2.Struct()
    lb = metadata.get_or_create_struct(LB_NAMESPACE)
    headers = [header_option(ROUTED_TO, replica), header_option(ROUTE_REASON, reason)] if routing_headers else []
    if phase == "own":
        headers.append(header_option(DESTINATION, destination))
        headers += [header_option(OBSERVE, "1")] if streamed else []
        lb[DESTINATION] = destination
    else:
        headers.append(header_option(DESTINATION, endpoint))
        # llama.cpp closes a connection right after a streamed answer, unannounced: a gateway's
        # pool cluster (keep-alive) would send the next turn on it and get a 503. Asked to close,
        # it says so, and Envoy opens a fresh connection (docs/inference-gateway.md)
        headers += [header_option("connection", "close")] if streamed else []
        lb[DESTINATION] = endpoint
        if fallbacks:
            lb[DESTINATION_FALLBACK] = fallbacks.partition(",")[0]
    headers += [header_option(REPLICA_KEY_HEADER, f"Bearer {replica_key}")] if replica_key else []
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=headers), clear_route_cache=True)
    return _answer(common, phase, dynamic_metadata=metadata)


RESPONSE_HEADERS_CONTINUE = pb.ProcessingResponse(response_headers=pb.HeadersResponse()).SerializeToString()
# Appended to every answer to a replica's response headers (an Endpoint Picker's gateway): the
# replica's CORS headers removed; Envoy removes before it sets, so the gateway's own CORS
# headers, appended after, stay.
REPLICA_CORS_REMOVED = pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse(
    header_mutation=pb.HeaderMutation(remove_headers=REPLICA_CORS_HEADERS)))).SerializeToString()


def response_route_headers(replica: str, reason: str) -> bytes:
    """The answer to a picked request's response headers: the client sees where it went and why."""
    return response_headers([(ROUTED_TO, replica), (ROUTE_REASON, reason)])


def response_headers(headers: Sequence[tuple[str, str]], removed: Sequence[str] = ()) -> bytes:
    """An answer to the response headers that sets ``headers`` and removes ``removed`` (appended to
    another such answer, it adds them: protobuf merges the two)."""
    mutation = pb.HeaderMutation(set_headers=[header_option(*pair) for pair in headers], remove_headers=removed)
    return pb.ProcessingResponse(
        response_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation))
    ).SerializeToString()


def immediate_headers(headers: Sequence[tuple[str, str]]) -> bytes:
    """Headers added to an immediate answer it is appended to (protobuf merges the two)."""
    mutation = pb.HeaderMutation(set_headers=[header_option(*pair) for pair in headers])
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(headers=mutation)).SerializeToString()


def wait_longer(seconds: int) -> bytes:
    """Asks Envoy to wait ``seconds`` for the answer to the message it sent (ext_proc's
    override_message_timeout; our own Envoy allows it up to its max_message_timeout): the request
    waits in the router's queue."""
    return pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(seconds=seconds)).SerializeToString()


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


def _answer(common: pb.CommonResponse, phase: Phase, **extra: Any) -> bytes:
    """A ProcessingResponse carrying ``common`` as the answer to the request headers or body."""
    if phase == "body":
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), **extra).SerializeToString()
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), **extra).SerializeToString()


def immediate(status: int, message: str, code: str, param: str | None = None,
              headers: Sequence[tuple[str, str]] = ()) -> bytes:
    """Envoy answers the client itself with this status and an error in OpenAI's shape."""
    return local_answer(status, orjson.dumps(error_document(status, message, code, param)), headers,
                        f"llm_ring_{status}")


def local_answer(status: int, body: bytes, headers: Sequence[tuple[str, str]] = (), details: str = "") -> bytes:
    """Envoy answers the client itself: ``status``, a JSON ``body`` (empty: none) and ``headers``."""
    content = [("content-type", "application/json")] if body else []
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=[header_option(*pair) for pair in (*content, *headers)]),
            body=body,
            details=details or f"llm_ring_{status}",
        )
    ).SerializeToString()


def header_option(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def more_headers(headers: list[base_pb2.HeaderValueOption], phase: Phase = "own") -> bytes:
    """A serialized ProcessingResponse that only sets headers (appended to a cached answer of
    the same phase: the answer's oneof must not change)."""
    return _answer(pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=headers)), phase)


class AnswerCache:
    """Serialized answers kept for reuse: a pick's answer per (replica, reason, streamed, phase),
    valid until the replica set or its health changes (``forget_routes``), and the
    predicted-cached-tokens and queue-wait headers per (value, phase) seen (at most
    NUMBER_HEADERS_KEPT)."""

    def __init__(self, routing_headers: bool = True, replica_key: str = "") -> None:
        self.routing_headers = routing_headers
        self.replica_key = replica_key
        self._routes: dict[tuple[str, str, bool, Phase], bytes] = {}
        self._numbers: dict[tuple[str, int, Phase], bytes] = {}
        self._responses: dict[tuple[str, str], bytes] = {}

    def route(
        self, replica: str, reason: str, streamed: bool, destination: Callable[[str], str], phase: Phase = "own"
    ) -> bytes:
        """The answer for a pick; ``destination(replica)`` gives its endpoints when not cached."""
        key = (replica, reason, streamed, phase)
        answer = self._routes.get(key)
        if answer is None:
            answer = self._routes[key] = route_answer(
                destination(replica), replica, reason, streamed, phase, self.routing_headers, self.replica_key
            )
        return answer

    def response(self, replica: str, reason: str) -> bytes:
        """response_route_headers, kept per (replica, reason); a plain continue without routing headers."""
        if not self.routing_headers:
            return RESPONSE_HEADERS_CONTINUE
        answer = self._responses.get((replica, reason))
        if answer is None:
            answer = self._responses[replica, reason] = response_route_headers(replica, reason)
        return answer

    def forget_routes(self) -> None:
        self._routes.clear()
        self._responses.clear()

    def predicted_cached(self, tokens: int, phase: Phase = "own") -> bytes:
        return self._number_header(PREDICTED_CACHED, tokens, phase)

    def queue_wait(self, seconds: float, phase: Phase = "own") -> bytes:
        """The x-route-queue-wait-ms header: how long flow control held the request."""
        return self._number_header(QUEUE_WAIT, round(seconds * 1000), phase)

    def _number_header(self, name: str, value: int, phase: Phase) -> bytes:
        key = (name, value, phase)
        header = self._numbers.get(key)
        if header is None:
            if len(self._numbers) >= NUMBER_HEADERS_KEPT:
                self._numbers.clear()
            header = self._numbers[key] = more_headers([header_option(name, str(value))], phase)
        return header
