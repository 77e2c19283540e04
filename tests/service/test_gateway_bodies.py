"""What the gateway reads from request and response bodies (pure functions)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from extproc.service.bodies import (
    RESPONSE_METADATA,
    BadRequest,
    Timings,
    parse_request,
    parse_timings,
    timings_from_metadata,
)

CHAT = "/v1/chat/completions"
text = st.text(min_size=1, max_size=200)


def chat_body(messages: list[dict], **extra: object) -> bytes:
    return json.dumps({"messages": messages, **extra}).encode()


@given(system=text, first=text, later=st.lists(st.tuples(text, text), max_size=5))
def test_the_opening_key_survives_later_turns(system: str, first: str, later: list[tuple[str, str]]) -> None:
    opening = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    turn1 = parse_request(CHAT, "application/json", chat_body(opening))
    history = opening + [
        m for a, u in later for m in ({"role": "assistant", "content": a}, {"role": "user", "content": u})
    ]
    turn_n = parse_request(CHAT, "application/json", chat_body(history))
    assert turn1.opening_key == turn_n.opening_key
    assert turn_n.prompt_chars == sum(len(m["content"]) for m in history)


@given(a=text, b=text)
def test_different_first_questions_get_different_keys(a: str, b: str) -> None:
    key = lambda q: parse_request(CHAT, "", chat_body([{"role": "user", "content": q}])).opening_key  # noqa: E731
    assert (key(a) == key(b)) == (a == b)


def test_chat_fields() -> None:
    parts = [{"type": "text", "text": "ab"}, {"type": "image_url", "image_url": {"url": "x"}}]
    parsed = parse_request(
        CHAT,
        "application/json; charset=utf-8",
        chat_body([{"role": "user", "content": parts}], max_tokens=7, stream=True),
    )
    assert (parsed.prompt_chars, parsed.max_tokens, parsed.stream) == (2, 7, True)
    assert (
        parse_request(CHAT, "", chat_body([{"role": "user", "content": "x"}], max_completion_tokens=9)).max_tokens == 9
    )
    assert parse_request(CHAT, "", chat_body([{"role": "user", "content": "x"}])).max_tokens is None


def test_completion_fields() -> None:
    parsed = parse_request("/completion", "", json.dumps({"prompt": "hello world", "n_predict": 5}).encode())
    assert (parsed.prompt_chars, parsed.max_tokens, parsed.prompt_token_ids) == (11, 5, 0)
    assert parse_request("/completion", "", b'{"prompt": "x", "n_predict": -1}').max_tokens is None
    ids = parse_request("/v1/completions", "", b'{"prompt": [1, 2, 3], "max_tokens": 2}')
    assert (ids.prompt_token_ids, ids.max_tokens) == (3, 2)
    long_a = parse_request("/completion", "", json.dumps({"prompt": "p" * 600 + "a"}).encode())
    long_b = parse_request("/completion", "", json.dumps({"prompt": "p" * 600 + "b"}).encode())
    assert long_a.opening_key == long_b.opening_key  # the first 512 characters decide


@pytest.mark.parametrize(
    ("path", "content_type", "body", "status", "says"),
    [
        (CHAT, "application/json", b"", 400, "empty body"),
        (CHAT, "text/plain", b"{}", 415, "text/plain"),
        (CHAT, "", b"{nope", 400, "not valid JSON"),
        (CHAT, "", b"\xff\xfe", 400, "not valid JSON"),
        (CHAT, "", b"[]", 400, "JSON object"),
        (CHAT, "", b'{"messages": "hi"}', 400, "'messages'"),
        (CHAT, "", b'{"messages": ["hi"]}', 400, "messages[0]"),
        (CHAT, "", b'{"messages": [{"role": "user", "content": 3}]}', 400, "messages[0].content"),
        (CHAT, "", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": true}', 400, "'max_tokens'"),
        ("/completion", "", b'{"prompt": ""}', 400, "'prompt'"),
        ("/completion", "", b'{"prompt": [1, "a"]}', 400, "'prompt'"),
        ("/v1/embeddings", "", b"{}", 404, "unknown path"),
    ],
)
def test_bad_requests_say_what_is_wrong(path: str, content_type: str, body: bytes, status: int, says: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_request(path, content_type, body)
    assert caught.value.status == status and says in caught.value.message


def test_timings_from_json_and_from_the_last_sse_event() -> None:
    timings = {"cache_n": 40, "prompt_n": 12, "prompt_ms": 30.5, "predicted_n": 8, "predicted_ms": 60.0}
    assert parse_timings(json.dumps({"content": "x", "timings": timings}).encode(), False).as_dict() == timings
    sse = (
        b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
        + b"data: "
        + json.dumps({"choices": [], "timings": timings}).encode()
        + b"\n\n"
        + b"data: [DONE]\n\n"
    )
    assert parse_timings(sse, True).as_dict() == timings
    usage = {"usage": {"prompt_tokens": 50, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 38}}}
    assert parse_timings(json.dumps(usage).encode(), False).as_dict() == {
        "cache_n": 38,
        "prompt_n": 12,
        "predicted_n": 4,
    }
    assert parse_timings(b'{"content": "no timings"}', False) is None
    assert parse_timings(b"data: {broken\n\n", True) is None
    assert parse_timings(b"<html>", False) is None


@pytest.mark.parametrize(
    "body",
    [
        {
            "content": "x",
            "timings": {"cache_n": 7, "prompt_n": 3, "prompt_ms": 2.5, "predicted_n": 4, "predicted_ms": 9.0},
        },
        {"usage": {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 6}}},
        {"content": "no timings"},
    ],
)
def test_timings_from_envoys_metadata_equal_those_read_from_the_body(body: dict) -> None:
    """What json_to_metadata copies (RESPONSE_METADATA paths; numbers become floats in a
    protobuf Struct) gives the same Timings as parsing the JSON body itself."""
    extracted = {}
    for key, path in RESPONSE_METADATA.items():
        node = body
        for step in path:
            node = node.get(step, {}) if isinstance(node, dict) else {}
        if isinstance(node, int | float):
            extracted[key] = float(node)
    assert timings_from_metadata(extracted) == parse_timings(json.dumps(body).encode(), event_stream=False)


# A whole float (3.0) is left out: in Envoy's Struct it cannot be told from the integer 3.
fraction = st.floats(-10.0, 1e6, allow_nan=False).filter(lambda x: not x.is_integer())
number = st.one_of(st.integers(-5, 10**6), fraction, st.booleans(), st.text(max_size=3))


@given(
    timings=st.none()
    | st.dictionaries(st.sampled_from(["cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms"]), number),
    usage=st.none()
    | st.fixed_dictionaries(
        {},
        optional={
            "prompt_tokens": number,
            "completion_tokens": number,
            "prompt_tokens_details": st.fixed_dictionaries({}, optional={"cached_tokens": number}),
        },
    ),
)
def test_timings_from_metadata_agree_with_the_body_for_any_numbers(timings: dict | None, usage: dict | None) -> None:
    body = {key: value for key, value in (("timings", timings), ("usage", usage)) if value is not None}
    extracted = {}
    for key, path in RESPONSE_METADATA.items():
        node: object = body
        for step in path:
            node = node.get(step) if isinstance(node, dict) else None
        if isinstance(node, int | float) and not isinstance(node, bool):  # Envoy: number_value only
            extracted[key] = float(node)
    # a timings object without a single number is not a llama.cpp answer: Envoy copies nothing of it
    assume(timings is None or any(key in extracted for key in timings))
    assert timings_from_metadata(extracted) == parse_timings(json.dumps(body).encode(), event_stream=False)


def test_every_timing_field_reaches_the_log_in_declaration_order() -> None:
    values = {field.name: index + 1 for index, field in enumerate(dataclasses.fields(Timings))}
    assert Timings(**values).as_dict() == values and list(Timings(**values).as_dict()) == list(values)
    assert Timings(cache_n=0, prompt_ms=2.5).as_dict() == {"cache_n": 0, "prompt_ms": 2.5}
