"""Hostile input through the real Envoy and the real service, in front of stub upstreams.

Generated bad requests of every class (bytes that are not UTF-8 in the headers the gateway
reads, wrong JSON types anywhere in a body, out-of-range numbers, bodies over the limits,
malformed JSON, forged routing headers, any method on any path), then the invariants: every
answer is routed (``x-routed-to``, or behind an InferencePool gateway the upstream address,
names a replica), answered by the gateway itself (a read-only path), or an error from the
gateway in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``); the service
logged no stream failure; nothing stays in flight; a valid chat is still routed.

Each runs through the gateway's own Envoy configuration and through an InferencePool
gateway's (Envoy AI Gateway's data plane, full duplex, the service as its TLS picker): no
request may fail open there either, and no load may stay charged; each once more with flow
control on (its tenant and objective headers fuzzed too).

Quick by default (FUZZ_EXAMPLES examples per class); LLM_RING_FUZZ_EXAMPLES=2000 runs long.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.bench.stub_upstream import RESPONSE, request_end
from extproc.bench.stubs import start_stub_upstream
from extproc.envoy.surface import (
    GENERATION_PATHS,
    HEALTH_PATHS,
    MODEL_PREFIX,
    MODELS_PATHS,
    generation_path,
    read_only_path,
)
from extproc.stack.processes import Running, free_port, static_discovery
from tests.service.gateway_support import Gateway, chat, error_message, gateway, inference_pool_gateway

pytestmark = pytest.mark.live
URL = "/v1/chat/completions"
FUZZ_EXAMPLES = int(os.environ.get("LLM_RING_FUZZ_EXAMPLES", "25"))
REPLICAS = {"llm-0", "llm-1"}
# small limits, so that "over the limit" is cheap to generate
LIMITS = {"max_messages": "16", "max_prompt_chars": "2000", "max_output_tokens": "512"}
OUTCOMES: Counter[tuple[str, str]] = Counter()  # (class, outcome) over the module: the report's figures


@pytest.fixture(scope="module", params=["own-envoy", "inference-pool", "own-envoy+flow", "inference-pool+flow"])
def gw(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    ports = [free_port() for _ in range(2)]
    stubs: Running = start_stub_upstream(ports, tmp_path_factory.mktemp("stubs"))
    replicas = {f"llm-{i}": f"127.0.0.1:{port}" for i, port in enumerate(ports)}
    workdir = tmp_path_factory.mktemp("gw")
    flow = {} if request.param.endswith("+flow") else None  # flow control on, router.toml's [flow]
    try:
        if request.param.startswith("own-envoy"):
            running = gateway(workdir, static_discovery(replicas), log_level='"info"', flow=flow, **LIMITS)
        else:
            running = inference_pool_gateway(workdir, replicas, log_level='"info"', flow=flow, **LIMITS)
        with running as g:
            yield g
    finally:
        stubs.stop()
        if OUTCOMES:
            print("\nfuzz outcomes (class, outcome): count")
            for (kind, outcome), count in sorted(OUTCOMES.items()):
                print(f"  {kind:<16} {outcome:<28} {count}")


def send(gw: Gateway, kind: str, body: bytes, headers: list[tuple[bytes, bytes]], method: str = "POST") -> None:
    """One request, checked against the invariant; its outcome counted under ``kind``."""
    try:
        reply = httpx.request(method, gw.url + URL, content=body, headers=headers, timeout=10.0)
    except (httpx.RemoteProtocolError, httpx.ReadError):  # closed, or reset
        # Behind an InferencePool data plane, Envoy's codec refusing a request (a Host that is no
        # host) sends its local 400 through the ext_proc filter's response phases, and the
        # connection closes before the picker could answer them: nothing reached a replica
        assert gw.replica_of, f"{kind}: our own Envoy closed the connection without an answer"
        OUTCOMES[kind, "closed by Envoy's codec"] += 1
        return
    routed = gw.routed_to(reply)
    if reply.status_code == 200:
        assert routed in REPLICAS, f"{kind}: answered unrouted ({routed!r})"
        OUTCOMES[kind, "routed"] += 1
        return
    assert 400 <= reply.status_code < 600, f"{kind}: status {reply.status_code}"
    assert routed not in REPLICAS or reply.status_code >= 500
    if not reply.headers.get("content-type", "").startswith("application/json"):
        # Envoy's HTTP codec refused the request before any filter ran (e.g. a Host that is no host)
        assert reply.status_code == 400, f"{kind}: {reply.status_code} {reply.text[:80]!r}"
        OUTCOMES[kind, "400 refused by Envoy's codec"] += 1
        return
    error = error_message(reply.json())  # the service's or Envoy's local reply: an error in OpenAI's shape
    OUTCOMES[kind, f"{reply.status_code} {re.sub(r'[0-9]+', 'N', ' '.join(error.split()[:3]))[:40]}"] += 1


def assert_healthy_after(gw: Gateway) -> None:
    state = gw.wait_idle()
    assert state["in_flight_requests"] == 0
    assert "ext_proc_stream_failed" not in gw.log.read_text()
    reply = httpx.post(gw.url + URL, json=chat("still routed?"), timeout=10.0)
    assert reply.status_code == 200 and gw.routed_to(reply) in REPLICAS


def own_envoy_only(gw: Gateway) -> None:
    if gw.replica_of:
        pytest.skip("a route of the gateway's own Envoy configuration answers this; an InferencePool gateway has none")


JSON_HEADERS = [(b"content-type", b"application/json")]
# what h11 lets a client send in a header value: visible ASCII and obs-text (0x80-0xff)
header_bytes = st.binary(min_size=1, max_size=40).map(
    lambda raw: bytes(b if 0x21 <= b <= 0x7E or b >= 0x80 else 0x78 for b in raw)
)
non_utf8 = header_bytes.filter(lambda raw: not _is_utf8(raw))
json_values: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@FUZZ
@given(
    header=st.sampled_from([b"x-conversation-id", b"x-turn", b"x-request-id", b"user-agent", b"content-type",
                            b"x-gateway-inference-fairness-id", b"x-gateway-inference-objective"]),
    value=non_utf8,
)
def test_non_utf8_headers(gw: Gateway, header: bytes, value: bytes) -> None:
    headers = [(b"content-type", b"application/json")] if header != b"content-type" else []
    send(gw, "non_utf8_header", json.dumps(chat("hi")).encode(), [*headers, (header, value)])


def _replace_at(body: Any, path: list[int], value: Any) -> Any:
    """``body`` with the node reached by walking ``path`` (indexes into each level's keys or items) set to value."""
    if not path or not isinstance(body, dict | list) or not body:
        return value
    if isinstance(body, dict):
        key = list(body)[path[0] % len(body)]
        return {**body, key: _replace_at(body[key], path[1:], value)}
    index = path[0] % len(body)
    return [*body[:index], _replace_at(body[index], path[1:], value), *body[index + 1 :]]


VALID_CHAT = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "image_url", "image_url": {}}]},
    ],
    "max_tokens": 8,
    "stream": False,
}


@FUZZ
@given(path=st.lists(st.integers(0, 8), min_size=1, max_size=5), value=json_values)
def test_wrong_json_types_anywhere(gw: Gateway, path: list[int], value: Any) -> None:
    send(gw, "wrong_json_type", json.dumps(_replace_at(VALID_CHAT, path, value)).encode(), JSON_HEADERS)


@FUZZ
@given(
    field=st.sampled_from(["max_tokens", "max_completion_tokens"]),
    value=st.integers(-(2**64), 2**64) | st.sampled_from([0, -1, 2**63 - 1, 2**31, 513]),
)
def test_output_token_numbers(gw: Gateway, field: str, value: int) -> None:
    send(gw, "output_tokens", json.dumps(chat("hi", **{field: value})).encode(), JSON_HEADERS)


@FUZZ
@given(messages=st.integers(1, 40), chars=st.integers(1, 300))
def test_bodies_around_the_limits(gw: Gateway, messages: int, chars: int) -> None:
    body = {"messages": [{"role": "user", "content": "x" * chars}] * messages, "max_tokens": 4}
    send(gw, "size_limits", json.dumps(body).encode(), JSON_HEADERS)


@FUZZ
@given(raw=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_malformed_bodies(gw: Gateway, raw: bytes) -> None:
    send(gw, "malformed_body", raw, JSON_HEADERS)


@FUZZ
@given(
    header=st.sampled_from([b"x-gateway-destination-endpoint", b"x-routed-to", b"x-llm-ring-observe", b"host",
                            b"x-route-queue-wait-ms"]),
    value=header_bytes,
)
def test_forged_routing_headers(gw: Gateway, header: bytes, value: bytes) -> None:
    send(gw, "forged_header", json.dumps(chat("hi")).encode(), [*JSON_HEADERS, (header, value)])


SPELLED_PATHS = [*GENERATION_PATHS, *(path + "/" for path in GENERATION_PATHS), *MODELS_PATHS, *HEALTH_PATHS,
                 MODEL_PREFIX + "stub", "/slots", "/slots/0?action=erase", "/props", "/metrics", "/tokenize",
                 "/v1/embeddings", "/V1/CHAT/COMPLETIONS", "/v1/chat/completions/../../slots", "/%761/models"]
spelled = st.sampled_from(SPELLED_PATHS)  # twice as likely as a random path
paths = spelled | spelled | st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="#?%"), max_size=30).map("/{}".format)


@FUZZ
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]), path=paths)
def test_any_method_on_any_path(gw: Gateway, method: str, path: str) -> None:
    """Only a POST on a generation path reaches a replica; a GET on a read-only path is answered by
    the gateway itself; every other answer is an error in OpenAI's shape (surface.py)."""
    bare = path.partition("?")[0]
    generation, read_only = generation_path(bare), read_only_path(bare)
    completion = generation is not None and generation.kind == "completion"
    body = {"prompt": "hi", "max_tokens": 4} if completion else chat("hi")
    try:
        reply = httpx.request(method, gw.url + path, json=body if method != "GET" else None, timeout=10.0)
    except httpx.RemoteProtocolError:  # a path Envoy's codec refuses outright: nothing reached anyone
        OUTCOMES["method_path", "closed by Envoy's codec"] += 1
        return
    routed = gw.routed_to(reply)
    if method == "POST" and generation is not None:
        assert reply.status_code == 200 and routed in REPLICAS, (method, path, reply.status_code)
        OUTCOMES["method_path", "routed"] += 1
        return
    assert routed not in REPLICAS, (method, path, reply.status_code, reply.text[:100])  # no replica saw it
    if method == "GET" and read_only is not None and reply.status_code == 200:
        OUTCOMES["method_path", "answered by the gateway"] += 1
        return
    if reply.status_code == 400 and not reply.headers.get("content-type", "").startswith("application/json"):
        OUTCOMES["method_path", "400 refused by Envoy's codec"] += 1
        return
    assert reply.status_code in (404, 405) or (read_only is not None and reply.status_code == 404), reply.text
    error_message(reply.json())
    OUTCOMES["method_path", f"{reply.status_code} {reply.json()['error']['code']}"] += 1


def test_the_invariants_hold_after_the_fuzzing(gw: Gateway) -> None:
    """Runs after the generated classes above (file order): the service is whole."""
    assert_healthy_after(gw)


# ------------------------------------------------------------------ findings, reproduced


def test_bad_request_ids_on_other_requests_pin_no_load(gw: Gateway) -> None:
    """40 chats mixed with 40 GETs whose x-request-id is not UTF-8: the access log batch that
    carries them must still release every chat (before: 7 of 40 stayed charged ~10 minutes)."""
    own_envoy_only(gw)

    def one(i: int) -> int:
        if i % 2:
            return httpx.get(gw.url + URL, headers=[(b"x-request-id", b"bad\xff")], timeout=10).status_code
        return httpx.post(gw.url + URL, json=chat(f"chat {i}"), timeout=10).status_code

    with ThreadPoolExecutor(16) as pool:
        statuses = Counter(pool.map(one, range(80)))
    assert statuses == {200: 40, 405: 40}
    assert gw.wait_idle(timeout=3.0)["in_flight_requests"] == 0
    assert "ext_proc_stream_failed" not in gw.log.read_text()


@pytest.mark.parametrize(
    ("header", "value"), [(b"x-conversation-id", b"conv-\xff\xfe"), (b"x-turn", b"\xc3\x28"), (b"x-turn", b"1\x80")]
)
def test_non_utf8_headers_are_routed_not_failed_open(gw: Gateway, header: bytes, value: bytes) -> None:
    reply = httpx.post(gw.url + URL, content=json.dumps(chat("hi")).encode(), headers=[*JSON_HEADERS, (header, value)])
    assert reply.status_code == 200 and gw.routed_to(reply) in REPLICAS
    assert "ext_proc_stream_failed" not in gw.log.read_text()


def test_a_non_utf8_content_type_is_refused_not_failed_open(gw: Gateway) -> None:
    reply = httpx.post(gw.url + URL, content=json.dumps(chat("hi")).encode(), headers=[(b"content-type", b"\xffjson")])
    assert reply.status_code == 415 and "content-type" in error_message(reply.json())


@pytest.mark.parametrize("text", [3, None, ["a"]])
def test_a_content_part_of_the_wrong_type_is_refused_naming_it(gw: Gateway, text: Any) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    reply = httpx.post(gw.url + URL, json=body, timeout=10)
    assert reply.status_code == 400 and "messages[0].content[0].text" in error_message(reply.json())


def test_an_unbounded_max_tokens_is_charged_as_a_slot_and_state_stays_readable(gw: Gateway) -> None:
    reply = httpx.post(gw.url + URL, json=chat("hi", max_tokens=2**63 - 1), timeout=10)
    assert reply.status_code == 200, reply.text  # the stub answers; a replica stops at its slot's context
    assert gw.state()["in_flight_requests"] >= 0  # GetState answers


def test_connect_is_refused_at_once(gw: Gateway) -> None:
    """Finding 7: CONNECT got no answer in 10 s (the body buffer waited for a tunnel to end)."""
    own_envoy_only(gw)
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
            answer += sock.recv(4096)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split()[1] in {b"403", b"405"}
    assert error_message(json.loads(body))  # in OpenAI's shape too


def _length(answer: bytes) -> int:
    """The content-length of an HTTP answer's head (0 until the head is whole)."""
    head = answer.partition(b"\r\n\r\n")[0].lower()
    found = re.search(rb"content-length: *(\d+)", head)
    return int(found.group(1)) if found else 0


def test_the_services_own_413_keeps_its_message(gw: Gateway) -> None:
    """Envoy's JSON 413 (body over max_body_bytes) must not replace the service's 413s."""
    body = {"messages": [{"role": "user", "content": "x"}] * (int(LIMITS["max_messages"]) + 1)}
    reply = httpx.post(gw.url + URL, json=body, timeout=10)
    assert reply.status_code == 413 and "service.max_messages" in error_message(reply.json())


class _ClosingUpstream(asyncio.Protocol):
    """Answers the first request on each connection; closes the connection, unanswered, when a
    second one arrives on it: what llama.cpp's server does to a request that comes in on a
    keep-alive connection just as its 5 s idle timeout closes it."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport, self.buffer, self.answered = transport, b"", 0

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := request_end(self.buffer)) is not None:
            self.buffer = self.buffer[end:]
            if self.answered:
                self.transport.close()
                return
            self.answered += 1
            self.transport.write(RESPONSE)  # type: ignore[attr-defined]


@pytest.fixture
def closing_upstreams() -> Iterator[list[int]]:
    loop = asyncio.new_event_loop()
    servers = [loop.run_until_complete(loop.create_server(_ClosingUpstream, "127.0.0.1", 0)) for _ in range(2)]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield [server.sockets[0].getsockname()[1] for server in servers]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_a_reused_connection_the_replica_closes_is_retried_not_a_503(
    closing_upstreams: list[int], tmp_path: Path
) -> None:
    """Finding 5: a request sent on a keep-alive connection the replica closes without
    answering got 503 "upstream connection termination"; now Envoy retries it."""
    replicas = {f"llm-{i}": f"127.0.0.1:{port}" for i, port in enumerate(closing_upstreams)}
    with gateway(tmp_path, static_discovery(replicas)) as g:
        statuses = [httpx.post(g.url + URL, json=chat(f"turn {i}"), timeout=10).status_code for i in range(6)]
    assert statuses == [200] * 6


def test_a_burst_beyond_the_slots_is_answered_whole(gw: Gateway) -> None:
    """24 clients at once, 25 chats each, over 2 replicas of 4 slots: with flow control on, most
    requests wait in the router. Every answer is a routed 200: the picker's stream stays in step
    with Envoy's phases (a read of the stream started while a request waited is its next read,
    never cancelled: grpc.aio may lose the message such a read was receiving)."""

    def client(index: int) -> list[tuple[int, str]]:
        with httpx.Client(timeout=30.0) as http:
            return [(reply.status_code, gw.routed_to(reply))
                    for turn in range(25)
                    for reply in (http.post(gw.url + URL, json=chat(f"burst {index}.{turn}"),
                                            headers={"x-conversation-id": f"burst-{index}"}),)]

    with ThreadPoolExecutor(24) as pool:
        answers = [answer for answers in pool.map(client, range(24)) for answer in answers]
    wrong = Counter(status for status, routed in answers if status != 200 or routed not in REPLICAS)
    assert not wrong, f"{sum(wrong.values())} of {len(answers)} answers were not a routed 200: {dict(wrong)}"
    assert_healthy_after(gw)
