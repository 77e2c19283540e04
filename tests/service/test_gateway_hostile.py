"""Hostile and careless input, without gRPC or Envoy: every input the gateway reads is
validated before it can raise, request ids are the service's own, numbers are bounded, and a
pick Envoy never applied is not blamed on a replica."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from extproc.routing import Router
from extproc.service.admin import AdminService
from extproc.service.bodies import BadRequest, BodyLimits, parse_request
from extproc.service.bounds import bounded
from extproc.service.dataplanes.own_envoy import ATTRIBUTES, OWN_ENVOY
from extproc.service.gateway import Gateway
from extproc.service.metrics import Metrics
from extproc.service.wire import decode_tolerant
from extproc.settings import load_settings
from tests.service.gateway_support import error_message

SETTINGS = load_settings(Path(__file__).parents[2] / "extproc" / "service" / "router.toml")
ENDPOINTS = {"llm-0": "127.0.0.1:9000", "llm-1": "127.0.0.1:9001"}
CHAT = "/v1/chat/completions"
LIMITS = BodyLimits(max_messages=4, max_prompt_chars=100, max_output_tokens=4096)


def make_gateway() -> Gateway:
    gateway = Gateway(Router(SETTINGS.routing), SETTINGS.service, Metrics())
    gateway.set_replicas(ENDPOINTS)
    return gateway


def decide(
    gateway: Gateway, body: Any, request_id: str = "client-id", conversation_id: str = "c"
) -> tuple[bytes, bool]:
    return gateway.route_request(
        shape=OWN_ENVOY, path=CHAT,
        content_type="application/json",
        session_headers={"x-conversation-id": conversation_id},
        turn="1",
        request_id=request_id,
        body=orjson.dumps(body),
    )


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hello"}], **extra}


def immediate_status(answer: bytes) -> tuple[int, dict[str, Any]]:
    response = pb.ProcessingResponse.FromString(answer)
    return response.immediate_response.status.code, json.loads(response.immediate_response.body)


# ---------------------------------------------------------------- bytes that are not UTF-8


def _with_bad_utf8(message: bytes, good: bytes) -> bytes:
    """The serialized message with one string's bytes swapped for invalid UTF-8 of the same length."""
    assert message.count(good) == 1
    return message.replace(good, good[:-1] + b"\xff")


def test_a_non_utf8_header_attribute_still_decodes() -> None:
    attributes = struct_pb2.Struct()
    attributes.update({"request.headers['x-conversation-id']": "conv-A", "request.url_path": CHAT})
    message = pb.ProcessingRequest(request_headers=pb.HttpHeaders(end_of_stream=False))
    message.attributes[ATTRIBUTES].CopyFrom(attributes)
    raw = _with_bad_utf8(message.SerializeToString(), b"conv-A")
    decoded = decode_tolerant(pb.ProcessingRequest, raw, Metrics())
    fields = decoded.attributes[ATTRIBUTES].fields
    assert fields["request.headers['x-conversation-id']"].string_value == "conv-\ufffd"
    assert fields["request.url_path"].string_value == CHAT


def test_an_access_log_message_with_a_non_utf8_request_id_loses_no_entry() -> None:
    entries = [
        accesslog_pb2.HTTPAccessLogEntry(request=accesslog_pb2.HTTPRequestProperties(request_id=f"id-{i}"))
        for i in range(5)
    ]
    entries[2].request.user_agent = "agent-X"
    message = als_pb2.StreamAccessLogsMessage(
        http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(log_entry=entries)
    )
    raw = _with_bad_utf8(message.SerializeToString(), b"agent-X")
    decoded = decode_tolerant(als_pb2.StreamAccessLogsMessage, raw, Metrics())
    assert [entry.request.request_id for entry in decoded.http_logs.log_entry] == [f"id-{i}" for i in range(5)]


@given(st.binary(max_size=200))
def test_any_bytes_decode_to_some_message_without_raising(raw: bytes) -> None:
    metrics = Metrics()
    decode_tolerant(pb.ProcessingRequest, raw, metrics)
    decode_tolerant(als_pb2.StreamAccessLogsMessage, raw, metrics)


# ---------------------------------------------------------------- wrong JSON types


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}', "messages[0].content[0].text"),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": null}]}]}',
            "messages[0].content[0].text",
        ),
        (b'{"messages": [{"role": "user", "content": [{"text": ["a"]}]}]}', "messages[0].content[0].text"),
        (b'{"messages": [{"role": "user", "content": ["plain"]}]}', "messages[0].content[0]"),
        (b'{"messages": [{"role": 7, "content": "x"}]}', "messages[0].role"),
        (b'{"messages": {"role": "user"}}', "'messages'"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}', "'max_tokens'"),
    ],
)
def test_wrong_json_types_are_refused_naming_the_field(body: bytes, says: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_request(CHAT, "application/json", body)
    assert caught.value.status == 400 and says in caught.value.message
    answer, routed = make_gateway().route_request(shape=OWN_ENVOY,
                                                  path=CHAT, content_type="application/json", session_headers={},
                                                  turn="", request_id="r", body=body)
    status, document = immediate_status(answer)
    assert not routed and status == 400 and says in error_message(document)  # in OpenAI's shape, the field named
    assert document["error"]["param"] == says.strip("'")


@given(st.binary(max_size=200) | st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
        ["messages", "role", "content", "text", "prompt", "max_tokens", "model", "stream"]), inner, max_size=4),
    max_leaves=12).map(lambda value: json.dumps(value).encode()))
def test_every_refusal_of_a_body_is_an_error_in_openais_shape(body: bytes) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/completion"):
        answer, routed = make_gateway().route_request(shape=OWN_ENVOY, path=path, content_type="application/json",
                                                      session_headers={}, turn="", request_id="r", body=body)
        if not routed:
            status, document = immediate_status(answer)
            assert 400 <= status < 500 and error_message(document), (path, body)


# ---------------------------------------------------------------- bounded numbers and work


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n_predict"])
@pytest.mark.parametrize("value", [4097, 8192, 2**63 - 1, 2**64 - 1])
def test_output_tokens_over_a_slot_are_charged_as_a_slot_not_refused(field: str, value: int) -> None:
    """A chat front end's 8192 is an ordinary request: a replica stops at its slot's context anyway."""
    parsed = parse_request(CHAT, "", json.dumps(chat(**{field: value})).encode(), LIMITS)
    assert parsed.max_tokens == LIMITS.max_output_tokens


OUTPUT_VALUES = st.one_of(st.none(), st.just(-1), st.integers(1, 2**64 - 1))  # JSON integers as parsed: 64 bits


@given(max_tokens=OUTPUT_VALUES, max_completion_tokens=OUTPUT_VALUES, n_predict=OUTPUT_VALUES)
def test_every_output_field_is_read_and_the_largest_is_charged(
    max_tokens: int | None, max_completion_tokens: int | None, n_predict: int | None
) -> None:
    given_fields = {"max_tokens": max_tokens, "max_completion_tokens": max_completion_tokens, "n_predict": n_predict}
    present = {name: value for name, value in given_fields.items() if value is not None}
    parsed = parse_request(CHAT, "", json.dumps(chat(**present)).encode(), LIMITS)
    values = list(present.values())
    if not values:
        assert parsed.max_tokens is None
    elif -1 in values:
        assert parsed.max_tokens == LIMITS.max_output_tokens
    else:
        assert parsed.max_tokens == min(max(values), LIMITS.max_output_tokens)
        assert parsed.max_tokens >= min(*values, LIMITS.max_output_tokens)  # never less than a field allows


def test_minus_one_means_until_the_context_ends_and_is_charged_as_the_maximum() -> None:
    body = json.dumps({"prompt": "x", "n_predict": -1}).encode()
    assert parse_request("/completion", "", body, LIMITS).max_tokens == LIMITS.max_output_tokens


@pytest.mark.parametrize("value", [0, -2, -(2**63)])
def test_other_non_positive_output_tokens_are_refused(value: int) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_request("/completion", "", json.dumps({"prompt": "x", "n_predict": value}).encode(), LIMITS)
    assert "'n_predict'" in caught.value.message


def test_too_many_messages_or_characters_are_refused_naming_the_limit() -> None:
    many = [{"role": "user", "content": "x"}] * 5
    with pytest.raises(BadRequest) as caught:
        parse_request(CHAT, "", json.dumps({"messages": many}).encode(), LIMITS)
    assert caught.value.status == 413 and "service.max_messages" in caught.value.message
    with pytest.raises(BadRequest) as caught:
        parse_request(CHAT, "", json.dumps({"messages": [{"role": "user", "content": "y" * 101}]}).encode(), LIMITS)
    assert caught.value.status == 413 and "service.max_prompt_chars" in caught.value.message
    with pytest.raises(BadRequest) as caught:
        parse_request("/completion", "", json.dumps({"prompt": list(range(101))}).encode(), LIMITS)
    assert caught.value.status == 413 and "service.max_prompt_chars" in caught.value.message


def test_the_service_applies_its_limits_and_admin_state_stays_representable() -> None:
    gateway = make_gateway()
    for asked in (2**63 - 1, -1):
        answer, routed = decide(gateway, chat(max_tokens=asked))
        assert routed
        assert gateway.requests.pending[routed].request.max_tokens == SETTINGS.service.max_output_tokens
    assert AdminService(gateway).state().in_flight_requests == 2


# ---------------------------------------------------------------- ids and log fields


def test_pending_requests_are_keyed_on_the_services_own_ids() -> None:
    gateway = make_gateway()
    for _ in range(3):
        answer, routed = decide(gateway, chat(), request_id="same-client-id")
        assert routed
    assert len(gateway.requests.pending) == 3 and "same-client-id" not in gateway.requests.pending
    header_ids = {
        header.header.raw_value.decode()
        for answer in [decide(gateway, chat(), request_id="x")[0]]
        for header in pb.ProcessingResponse.FromString(answer).request_headers.response.header_mutation.set_headers
        if header.header.key == "x-request-id"
    }
    assert header_ids and header_ids <= set(gateway.requests.pending)


def test_long_client_ids_are_bounded_in_state_and_logs() -> None:
    gateway = make_gateway()
    huge = "c" * 60_000
    with capture_logs() as logs:
        decide(gateway, chat(), request_id="r" * 10_000, conversation_id=huge)
        (our_id,) = gateway.requests.pending
        endpoint = gateway.requests.pending[our_id].endpoint
        gateway.requests.access_logged(our_id, 200, endpoint, cut_off=False, timings=None)
    (record,) = [entry for entry in logs if entry["event"] == "route_decision"]
    assert len(orjson.dumps(record)) < 4096
    assert record["conversation"] == bounded(huge) and len(record["conversation"]) <= 64
    assert bounded(huge) != bounded(huge[:-1] + "d")  # the hash keeps distinct ids distinct
    assert bounded("short") == "short"


# ---------------------------------------------------------------- finding 8


def test_a_pick_envoy_never_applied_is_released_without_blaming_the_replica() -> None:
    """Fail-open past ext_proc's timeout: Envoy served the request round robin, with its own id
    (the service's answer, which renames the request, never landed)."""
    gateway = make_gateway()
    with capture_logs() as logs:
        decide(gateway, chat(), request_id="envoy-id")
        (pending,) = gateway.requests.pending.values()
        other = next(endpoint for endpoint in ENDPOINTS.values() if endpoint != pending.endpoint)
        gateway.requests.access_logged("envoy-id", 200, other, cut_off=False, timings=None)
    assert not gateway.fleet.unhealthy
    assert not gateway.requests.pending and gateway.router.ledger.total_requests() == 0
    (record,) = [entry for entry in logs if entry["event"] == "route_decision"]
    assert record["outcome"] == "not_applied"


# ---------------------------------------------------------------- large bodies off the loop


def test_large_bodies_are_parsed_in_the_worker_with_the_same_result() -> None:
    from extproc.service.offload import MAX_WAITING, OFFLOAD_BYTES, BodyParser

    async def scenario() -> None:
        parser = BodyParser(LIMITS)
        try:
            big = json.dumps({"prompt": "p" * 50, "n_predict": 3, "padding": "x" * OFFLOAD_BYTES}).encode()
            assert parser.takes(big) and not parser.takes(big[: OFFLOAD_BYTES - 1])
            assert await parser.parse("/completion", "", big) == parse_request("/completion", "", big, LIMITS)
            refused = await parser.parse(CHAT, "", json.dumps({"messages": [{"role": "user"}] * 5}).encode())
            assert isinstance(refused, BadRequest) and refused.status == 413
            parser.waiting = MAX_WAITING  # as if that many were queued
            busy = await parser.parse(CHAT, "", big)
            assert isinstance(busy, BadRequest) and busy.status == 503
        finally:
            parser.close()

    asyncio.run(scenario())


def test_the_gateway_decides_on_a_result_parsed_elsewhere() -> None:
    gateway = make_gateway()
    refusal = BadRequest(413, "'messages': too many", "request_too_large", "messages")
    answer, routed = gateway.route_request(shape=OWN_ENVOY,
                                    path=CHAT, content_type="", session_headers={}, turn="", request_id="r",
                                    body=b"never parsed here", parsed_elsewhere=refusal)  # fmt: skip
    assert not routed and immediate_status(answer) == (413, {"error": {
        "message": "'messages': too many", "type": "invalid_request_error", "param": "messages",
        "code": "request_too_large"}})


@given(
    messages=st.integers(1, 12),
    role_values=st.integers(0, 3),
    text=st.text(max_size=30),
)
def test_counting_roles_in_the_bytes_never_refuses_a_body_within_the_limit(
    messages: int, role_values: int, text: str
) -> None:
    """The pre-parse count refuses only bodies whose parse would be refused too (or that carry
    more than max_messages strings "role" elsewhere)."""
    from extproc.service.bodies import too_many_messages

    body = json.dumps(
        {"messages": [{"role": "user", "content": f'"role" {text}'}] * messages, "x": ["role"] * role_values}
    ).encode()
    refused = too_many_messages(body, LIMITS)
    if messages + role_values <= 2 * LIMITS.max_messages:
        assert refused is None
    if refused is not None:
        with pytest.raises(BadRequest):
            parse_request(CHAT, "", body, LIMITS)


@pytest.mark.parametrize("stream", ["route", "picker"])
def test_a_bug_of_ours_fails_open_with_one_bounded_line_and_a_count(stream: str) -> None:
    """Both kinds of stream: our own Envoy's (CEL attributes) and an Endpoint Picker gateway's."""
    import grpc

    from extproc.service.processor import Processor

    class Context:
        def __init__(self, messages: list[pb.ProcessingRequest]) -> None:
            self.messages, self.aborted = messages, None

        async def read(self) -> pb.ProcessingRequest:
            return self.messages.pop(0)

        async def write(self, _answer: bytes) -> None:
            raise AssertionError("a failed stream answers nothing")

        async def abort(self, code: grpc.StatusCode, _details: str) -> None:
            self.aborted = code

    gateway = make_gateway()
    gateway.route_request = lambda **_: (_ for _ in ()).throw(KeyError("x" * 10_000))  # type: ignore[method-assign]
    sent = [base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
            base_pb2.HeaderValue(key=":path", raw_value=CHAT.encode())]
    headers = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=sent)))
    if stream == "route":
        headers.attributes[ATTRIBUTES].update({"request.url_path": CHAT})
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=orjson.dumps(chat()), end_of_stream=True))
    context = Context([headers, body])
    with capture_logs() as logs:
        asyncio.run(Processor(gateway, own_envoy=True).process(None, context))  # type: ignore[arg-type]
    (line,) = logs
    assert line["event"] == "ext_proc_stream_failed" and line["error"] == "KeyError"
    assert "exc_info" not in line and len(orjson.dumps(line)) < 400
    assert context.aborted == grpc.StatusCode.INTERNAL  # Envoy applies fail_open
    assert gateway.metrics.stream_failures[stream] == 1
