"""Where a conversation id comes from (service.session_ids): the first source of the list a
request carries, a session header or a body field; none: the conversation's opening. Decided
by the gateway without gRPC (the data planes' header reading: test_picker.py, test_gateway_llama.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from extproc.service.bodies import parse_request
from extproc.service.dataplanes.own_envoy import OWN_ENVOY
from extproc.service.sessions import SessionSources
from tests.service.test_gateway_lifecycle import SETTINGS, make_gateway

ORDER = SessionSources.parse(SETTINGS.service.session_ids)  # router.toml's


def test_router_toml_lists_the_agent_clients_sessions_before_x_conversation_id() -> None:
    assert ORDER.order == (("header", "x-claude-code-session-id"), ("header", "x-session-affinity"),
                           ("header", "session_id"), ("body", "prompt_cache_key"), ("header", "x-conversation-id"))
    assert ORDER.headers == ("x-claude-code-session-id", "x-session-affinity", "session_id", "x-conversation-id")
    assert ORDER.fields == ("prompt_cache_key",)


@pytest.mark.parametrize(
    ("headers", "fields", "expected"),
    [
        ({"x-conversation-id": "c", "x-claude-code-session-id": "claude"}, {}, "claude"),
        ({"x-conversation-id": "c", "session_id": "codex"}, {"prompt_cache_key": "key"}, "codex"),
        ({"x-conversation-id": "c"}, {"prompt_cache_key": "key"}, "key"),
        ({"x-conversation-id": "c", "x-session-affinity": ""}, {}, "c"),  # an empty header names nothing
        ({"x-turn": "1"}, {}, ""),
    ],
)
def test_the_first_source_a_request_carries_names_it(headers: dict[str, str], fields: dict[str, str],
                                                       expected: str) -> None:
    assert ORDER.pick(headers, fields) == expected


def conversation(headers: dict[str, str], **body: Any) -> str:
    """The conversation the gateway routes a chat under."""
    gateway = make_gateway()
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, **body}
    gateway.route_request(shape=OWN_ENVOY,
                          path="/v1/chat/completions", content_type="application/json", session_headers=headers,
                          turn="", request_id="", body=orjson.dumps(chat))
    return next(reversed(gateway.requests.pending.values())).request.conversation


def test_the_gateway_routes_under_the_first_source_carried() -> None:
    assert conversation({"x-conversation-id": "c-1", "session_id": "codex-1"}) == "codex-1"
    assert conversation({"x-conversation-id": "c-1"}, prompt_cache_key="cache-1") == "cache-1"
    assert conversation({}, prompt_cache_key="cache-1") == "cache-1"
    opening = parse_request("/v1/chat/completions", "", b'{"messages": [{"role": "user", "content": "hello"}]}')
    assert conversation({}) == opening.opening_key


@pytest.mark.parametrize("value", [7, ["a"], "a\x1fb", "tab\tted", ""])
def test_a_body_field_that_is_no_printable_string_names_nothing(value: object) -> None:
    """A control character could forge the separators of the router's keys (continuation.py)."""
    assert conversation({"x-conversation-id": "c-1"}, prompt_cache_key=value) == "c-1"
    fields = ("prompt_cache_key",)
    body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": value})
    assert parse_request("/v1/chat/completions", "", body, session_fields=fields).sessions == ()
