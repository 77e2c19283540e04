"""CORS end to end (service.cors_origins, docs/security.md#what-a-client-can-reach): a browser's
preflight and its real requests, through our own Envoy (its CORS filter, rendered from the
setting) and through Envoy AI Gateway's InferencePool plane (full duplex: the picker answers the
preflight and adds the headers), in front of real llama.cpp replicas (2, the tiny model).

The allowed origin gets the headers on the preflight, a generation, a streamed one, the models
list and an error; another origin gets none; with cors_origins empty nothing differs from a
request without Origin, and a preflight is refused.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.service.gateway_support import Gateway, LlamaReplicas, data_plane, error_message, llama_replicas

pytestmark = pytest.mark.live
ALLOWED = "https://chat.example.com"
OTHER = "https://elsewhere.example.org"
CHAT = "/v1/chat/completions"
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello from a browser"}], "max_tokens": 2}
ASKED_HEADERS = "authorization,content-type,x-stainless-os"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaReplicas]:
    with llama_replicas(tmp_path_factory.mktemp("replicas"), model="tiny") as replicas:
        yield replicas


@pytest.fixture(scope="module", params=["own-envoy", "ai-gateway-duplex"])
def plane_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def allowing(plane_name: str, llama: LlamaReplicas, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with data_plane(plane_name, tmp_path_factory.mktemp("cors"), llama, cors_origins=[ALLOWED]) as gw:
        yield gw


@pytest.fixture(scope="module")
def closed(plane_name: str, llama: LlamaReplicas, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with data_plane(plane_name, tmp_path_factory.mktemp("no-cors"), llama) as gw:
        yield gw


def preflight(gw: Gateway, origin: str, path: str = CHAT) -> httpx.Response:
    return httpx.options(gw.url + path, timeout=30, headers={
        "origin": origin, "access-control-request-method": "POST", "access-control-request-headers": ASKED_HEADERS,
    })


def cors_headers(reply: httpx.Response) -> dict[str, str]:
    return {name: value for name, value in reply.headers.items() if name.startswith("access-control-")}


def test_the_allowed_origin_gets_its_preflight_answered(allowing: Gateway) -> None:
    for path in (CHAT, "/v1/models", "/v1/completions/"):
        reply = preflight(allowing, ALLOWED, path)
        assert reply.status_code in (200, 204), (path, reply.status_code, reply.text)
        headers = cors_headers(reply)
        assert headers.get("access-control-allow-origin") == ALLOWED, (path, headers)
        assert "POST" in headers.get("access-control-allow-methods", ""), headers
        allowed = {name.strip().lower() for name in headers.get("access-control-allow-headers", "").split(",")}
        # a wildcard never covers authorization: it is named
        assert {"authorization", "content-type"} <= allowed and ("x-stainless-os" in allowed or "*" in allowed)
    assert preflight(allowing, ALLOWED, "/slots").status_code == 404  # the allow-list holds for preflights too


def test_the_allowed_origin_reads_answers_and_errors(allowing: Gateway) -> None:
    origin = {"origin": ALLOWED}
    answers = [
        httpx.post(allowing.url + CHAT, json=BODY, headers=origin, timeout=60),
        httpx.get(allowing.url + "/v1/models", headers=origin, timeout=30),
        httpx.post(allowing.url + CHAT, json={"messages": "not a list"}, headers=origin, timeout=30),
    ]
    with httpx.stream("POST", allowing.url + CHAT, json={**BODY, "stream": True}, headers=origin, timeout=60) as sse:
        sse.read()
        answers.append(sse)
    assert [reply.status_code for reply in answers] == [200, 200, 400, 200], [r.text for r in answers]
    assert error_message(answers[2].json())
    for reply in answers:
        assert reply.headers.get("access-control-allow-origin") == ALLOWED, (reply.request.url, dict(reply.headers))
        assert "x-request-id" in reply.headers.get("access-control-expose-headers", "").lower()
    assert allowing.wait_idle()["in_flight_requests"] == 0


def test_another_origin_gets_no_cors_header(allowing: Gateway) -> None:
    refused = preflight(allowing, OTHER)
    assert not (200 <= refused.status_code < 300) and not cors_headers(refused), (refused.status_code,
                                                                                   dict(refused.headers))
    answer = httpx.post(allowing.url + CHAT, json=BODY, headers={"origin": OTHER}, timeout=60)
    assert answer.status_code == 200 and not cors_headers(answer), dict(answer.headers)


def test_without_origins_nothing_changes(closed: Gateway) -> None:
    refused = preflight(closed, ALLOWED)
    assert refused.status_code == 405 and not cors_headers(refused), (refused.status_code, dict(refused.headers))
    assert error_message(refused.json())
    with_origin = httpx.post(closed.url + CHAT, json=BODY, headers={"origin": ALLOWED}, timeout=60)
    without = httpx.post(closed.url + CHAT, json=BODY, timeout=60)
    assert with_origin.status_code == without.status_code == 200
    assert not cors_headers(with_origin) and not cors_headers(without)
    assert with_origin.headers.get("vary") == without.headers.get("vary")
