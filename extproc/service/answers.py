"""The service's answers to Envoy, as serialized ProcessingResponses (the wire encoding).

The hot path builds few protobufs: a pick's answer is cached per (replica, reason, streamed,
shape) and the per-request headers (the predicted cached tokens, the request id) are appended
as bytes. Protobuf merges repeated fields of concatenated messages, so cached answer + a
headers-only message answering the same message = the answer with those headers added.

Each data plane tells its Envoy a pick in its own shape (``AnswerShape``), defined with its
mode in service/dataplanes/.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2

from extproc.envoy.contract import (
    PREDICTED_CACHED,
    QUEUE_WAIT,
    REPLICA_KEY_HEADER,
    ROUTE_REASON,
    ROUTED_TO,
)
from extproc.envoy.cors import REPLICA_CORS_HEADERS
from extproc.envoy.surface import error_document
from extproc.routing import Decision
from extproc.routing.flow_control import Wait

NUMBER_HEADERS_KEPT = 1 << 16  # serialized x-route-predicted-cached-tokens and queue-wait values kept

# The body passes unchanged (the answer to the request body, after the headers' answer).
BODY_CONTINUE = pb.ProcessingResponse(request_body=pb.BodyResponse()).SerializeToString()


class AnswerShape(Protocol):
    """How a data plane is told a pick (service/dataplanes/: one shape per mode, hashable: the
    answers are kept per shape) and how the request's end is learnt there."""

    @property
    def access_logged(self) -> bool:
        """Envoy's access log entry ends the request (else the stream's own end: lifecycle.py)."""

    @property
    def waits_announced(self) -> bool:
        """Envoy is asked to wait longer while flow control holds the request (``wait_longer``)."""

    def pick(self, destination: str, replica: str, reason: str, streamed: bool, routing_headers: bool,
             replica_key: str) -> bytes:
        """Envoy's answer for a pick. ``destination``: the endpoint, then its fallbacks,
        comma-separated. routing_headers (service.routing_headers): the replica and the reason
        too, which reach the response (a header left unset is not added: docs/security.md).
        replica_key: the replicas' API key, set as ``authorization: Bearer <key>`` over whatever
        the client sent ("": none)."""

    def headers(self, headers: list[base_pb2.HeaderValueOption]) -> bytes:
        """A message that only sets ``headers``, appended to the pick (its oneof unchanged)."""

    def named(self, request_id: str) -> bytes:
        """What the answer adds to name the request by our id (b"": the data plane keeps its own)."""


def pick_headers(replica: str, reason: str, routing_headers: bool, replica_key: str,
                 *own: base_pb2.HeaderValueOption) -> list[base_pb2.HeaderValueOption]:
    """A pick's headers: the routing headers (when on), the data plane's ``own``, the replica key (when set)."""
    headers = [header_option(ROUTED_TO, replica), header_option(ROUTE_REASON, reason)] if routing_headers else []
    headers += own
    headers += [header_option(REPLICA_KEY_HEADER, f"Bearer {replica_key}")] if replica_key else []
    return headers


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


def answer_to(common: pb.CommonResponse, to_body: bool, **extra: Any) -> bytes:
    """A ProcessingResponse carrying ``common`` as the answer to the request headers or body."""
    if to_body:
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


def more_headers(headers: list[base_pb2.HeaderValueOption], to_body: bool = False) -> bytes:
    """A serialized ProcessingResponse that only sets headers (appended to a cached answer to the
    same message: the answer's oneof must not change)."""
    return answer_to(pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=headers)), to_body)


class AnswerCache:
    """Serialized answers kept for reuse: a pick's answer per (replica, reason, streamed, shape),
    valid until the replica set or its health changes (``forget_routes``), and the
    predicted-cached-tokens and queue-wait headers per (value, shape) seen (at most
    NUMBER_HEADERS_KEPT)."""

    def __init__(self, routing_headers: bool = True, replica_key: str = "") -> None:
        self.routing_headers = routing_headers
        self.replica_key = replica_key
        self._routes: dict[tuple[str, str, bool, AnswerShape], bytes] = {}
        self._numbers: dict[tuple[str, int, AnswerShape], bytes] = {}
        self._responses: dict[tuple[str, str], bytes] = {}

    def route(
        self, replica: str, reason: str, streamed: bool, destination: Callable[[str], str], shape: AnswerShape
    ) -> bytes:
        """The answer for a pick; ``destination(replica)`` gives its endpoints when not cached."""
        key = (replica, reason, streamed, shape)
        answer = self._routes.get(key)
        if answer is None:
            answer = self._routes[key] = self.pick(destination(replica), replica, reason, streamed, shape)
        return answer

    def pick(self, destination: str, replica: str, reason: str, streamed: bool, shape: AnswerShape) -> bytes:
        """The answer for a pick, built (not kept): with this service's routing headers and replica key."""
        return shape.pick(destination, replica, reason, streamed, self.routing_headers, self.replica_key)

    def for_pick(self, shape: AnswerShape, decision: Decision, streamed: bool, destination: Callable[[str], str],
                 keep: bool, predicted_cached: int, wait: Wait | None, request_id: str) -> bytes:
        """A routed request's whole answer: the pick (kept for reuse when ``keep``), with the routing
        headers the predicted cached tokens and the queue wait, and the id naming it."""
        replica, reason = decision.replica, decision.reason
        if keep:
            answer = self.route(replica, reason, streamed, destination, shape)
        else:
            answer = self.pick(destination(replica), replica, reason, streamed, shape)
        if self.routing_headers:
            answer += self.predicted_cached(predicted_cached, shape)
            if wait is not None:
                answer += self.queue_wait(wait.waited, shape)
        return answer + shape.named(request_id)

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

    def predicted_cached(self, tokens: int, shape: AnswerShape) -> bytes:
        return self._number_header(PREDICTED_CACHED, tokens, shape)

    def queue_wait(self, seconds: float, shape: AnswerShape) -> bytes:
        """The x-route-queue-wait-ms header: how long flow control held the request."""
        return self._number_header(QUEUE_WAIT, round(seconds * 1000), shape)

    def _number_header(self, name: str, value: int, shape: AnswerShape) -> bytes:
        key = (name, value, shape)
        header = self._numbers.get(key)
        if header is None:
            if len(self._numbers) >= NUMBER_HEADERS_KEPT:
                self._numbers.clear()
            header = self._numbers[key] = shape.headers([header_option(name, str(value))])
        return header
