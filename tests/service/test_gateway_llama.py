"""The gateway in front of real llama.cpp replicas (xllamacpp + SmolLM2-135M, 2 replicas,
started as the local stack starts them: they want an API key): cache reuse across turns, SSE
chunk by chunk, load released for finished and abandoned requests, replica list from a
watched file; the replicas refuse whoever lacks their key, and Envoy adds it to every
generation, also failing open."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from extproc.envoy.contract import write_endpoints_file
from extproc.routing import reasons
from extproc.stack.processes import free_port, start_gateway_envoy
from tests.service.gateway_support import (
    Gateway,
    LlamaReplicas,
    assert_each_turn_reused_the_whole_previous_prompt,
    assert_sdk_turns_stay_on_one_cache,
    back_to_back,
    gateway,
    llama_replicas,
)

pytestmark = pytest.mark.live
CHAT = "/v1/chat/completions"
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaReplicas]:
    with llama_replicas(tmp_path_factory.mktemp("replicas")) as replicas:
        yield replicas


@pytest.fixture(scope="module")
def gw(llama: LlamaReplicas, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("gw")
    replica_file = workdir / "replicas.json"
    replica_file.write_text(json.dumps(llama.addresses))
    discovery = {"SOURCE": '"file"', "FILE__PATH": f'"{replica_file}"', "FILE__POLL_SECONDS": "0.1"}
    with gateway(workdir, discovery, replica_key_file=llama.key_file) as running:
        yield running


def test_turns_of_a_conversation_stay_on_one_replica_and_reuse_its_cache(gw: Gateway) -> None:
    history = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
    headers = {"x-conversation-id": "paris", "x-turn": "1"}
    first = httpx.post(gw.url + CHAT, json={"messages": history, "max_tokens": 8}, headers=headers, timeout=60)
    assert first.status_code == 200, first.text
    history += [first.json()["choices"][0]["message"], {"role": "user", "content": "And of Italy?"}]
    second = httpx.post(
        gw.url + CHAT, json={"messages": history, "max_tokens": 8}, headers={**headers, "x-turn": "2"}, timeout=60
    )
    assert second.status_code == 200
    assert second.headers["x-routed-to"] == first.headers["x-routed-to"]
    assert {first.headers["x-route-reason"], second.headers["x-route-reason"]} <= set(reasons())
    assert second.json()["timings"]["cache_n"] > 0  # the replica reused turn 1's prefix
    logged = _decision(gw, second.headers["x-request-id"])
    assert logged["cache_n"] == second.json()["timings"]["cache_n"] and logged["prompt_n"] > 0
    assert logged["predicted_cached_tokens"] > 0 and logged["outcome"] == "ok" and logged["turn"] == "2"
    # the client sees the router's guess too (records compare it with cache_n)
    assert first.headers["x-route-predicted-cached-tokens"] == "0"
    assert int(second.headers["x-route-predicted-cached-tokens"]) == logged["predicted_cached_tokens"]
    assert gw.wait_idle()["in_flight_requests"] == 0


@pytest.mark.parametrize(("header", "conversation"), [("x-claude-code-session-id", 40), ("session_id", 41)])
def test_an_agent_sending_only_its_session_header_keeps_its_turns_on_their_cache(gw: Gateway, header: str,
                                                                                 conversation: int) -> None:
    """Claude Code's session header, and Codex's (a name with "_", which Envoy passes on): no
    x-conversation-id, turns sent back to back; each finds the whole last prompt cached, and the
    service routes them under the session's id."""
    turns = back_to_back(gw.url, conversation, stream=True, with_header=True, session_header=header)
    assert_each_turn_reused_the_whole_previous_prompt(turns)
    gw.wait_idle()
    named = [r for r in gw.decisions() if r["conversation"] == f"b2b-True-{conversation}"]
    assert len(named) == len(turns), [r["conversation"] for r in gw.decisions()[-len(turns):]]


def test_completion_endpoint_is_routed_and_its_timings_read(gw: Gateway) -> None:
    reply = httpx.post(
        gw.url + "/completion",
        json={"prompt": "Once upon a time", "n_predict": 4},
        headers={"x-conversation-id": "story"},
        timeout=60,
    )
    assert reply.status_code == 200 and reply.headers["x-routed-to"] in ("llm-0", "llm-1")
    logged = _decision(gw, reply.headers["x-request-id"])
    assert logged["max_tokens"] == 4 and logged["predicted_n"] == reply.json()["timings"]["predicted_n"]


def test_sse_arrives_chunk_by_chunk_through_envoy(gw: Gateway, llama: LlamaReplicas) -> None:
    body = {
        "messages": [SYSTEM, {"role": "user", "content": "Count from one to twenty in words."}],
        "max_tokens": 32,
        "stream": True,
        "ignore_eos": True,
    }
    cold = _stream(gw.url + CHAT, body, {"x-conversation-id": "count"})  # the prompt is now cached there
    direct = _stream(f"http://{llama.addresses[cold['routed_to']]}{CHAT}", body, llama.headers)
    through = _stream(gw.url + CHAT, body, {"x-conversation-id": "count"})
    assert through["routed_to"] == cold["routed_to"]
    assert through["chunks"] >= 8  # not buffered into one piece
    assert through["first_s"] < 0.5 * through["total_s"]  # the first words came long before the end
    assert through["first_s"] < direct["first_s"] + 0.5  # the gateway adds little to the first chunk
    logged = _decision(gw, through["request_id"])
    assert logged["stream"] is True and logged["predicted_n"] > 0 and logged["outcome"] == "ok"
    print(f"first chunk: {through['first_s'] * 1000:.1f} ms via Envoy, {direct['first_s'] * 1000:.1f} ms direct")


def test_abandoned_stream_releases_its_load(gw: Gateway) -> None:
    body = {
        "messages": [SYSTEM, {"role": "user", "content": "Write a long poem about the sea."}],
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    gw.wait_idle()  # the previous test's request ends with its access log entry (flushed every 20 ms)
    with httpx.stream("POST", gw.url + CHAT, json=body, headers={"x-conversation-id": "poem"}, timeout=60) as reply:
        request_id = reply.headers["x-request-id"]
        # Keep the iterator: a discarded generator is collected at once and httpx then closes
        # the connection, which would hang up before the check below (a race with the release).
        chunks = reply.iter_raw()
        next(chunks)  # one chunk, then hang up when the block ends
        assert gw.state()["in_flight_requests"] == 1
    state = gw.wait_idle()
    assert state["in_flight_requests"] == 0 and state["in_flight_tokens"] == 0
    assert _decision(gw, request_id)["outcome"] == "abandoned"


def test_replica_file_changes_are_followed(gw: Gateway, llama: LlamaReplicas) -> None:
    replica_file = gw.log.parent.parent / "replicas.json"
    replica_file.write_text(json.dumps({"llm-0": llama.addresses["llm-0"]}))
    try:
        _until(lambda: [r["name"] for r in gw.state()["replicas"]] == ["llm-0"])
        for i in range(4):
            reply = httpx.post(
                gw.url + CHAT,
                json={"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2},
                headers={"x-conversation-id": f"file-{i}"},
                timeout=60,
            )
            assert reply.headers["x-routed-to"] == "llm-0"
    finally:
        replica_file.write_text(json.dumps(llama.addresses))
        _until(lambda: len(gw.state()["replicas"]) == 2)


# ---------------------------------------------------------------- the replicas' API key
# llama.cpp's --api-key-file, as the local stack and the Kubernetes replicas run it: the slot
# actions (--slot-save-path) and everything else but /health refuse a request without the key,
# so a wrong route or NetworkPolicy still reaches no control action (docs/security.md).
CONTROL = [("GET", "/slots"), ("POST", "/slots/0?action=erase"), ("POST", "/slots/0?action=save"),
           ("POST", "/slots/0?action=restore"), ("POST", "/lora-adapters"), ("GET", "/props"), ("POST", "/props"),
           ("GET", "/metrics"), ("POST", "/tokenize"), ("POST", CHAT), ("POST", "/completion")]


@pytest.mark.parametrize("method, path", CONTROL)
def test_a_replica_refuses_whoever_lacks_its_key(llama: LlamaReplicas, method: str, path: str) -> None:
    body = {"filename": "attacker-written.bin"} if "action" in path else {"messages": [], "prompt": "x"}
    for address in llama.addresses.values():
        for credentials in ({}, {"authorization": "Bearer not-the-key"}, {"x-api-key": "not-the-key"}):
            reply = httpx.request(method, f"http://{address}{path}", json=body, headers=credentials, timeout=10)
            assert reply.status_code == 401, (address, credentials, reply.text)
    assert not list(llama.key_file.parent.glob("slots/attacker-written.bin"))


def test_with_the_key_the_same_replica_answers_and_health_needs_none(llama: LlamaReplicas) -> None:
    """The refusals above are the key's doing: with it /slots answers (and the probes need none)."""
    for address in llama.addresses.values():
        slots = httpx.get(f"http://{address}/slots", headers=llama.headers, timeout=10)
        assert slots.status_code == 200 and len(slots.json()) == 2
        assert httpx.get(f"http://{address}/health", timeout=10).status_code == 200


def test_envoy_adds_the_key_to_a_generation_over_whatever_the_client_sent(gw: Gateway) -> None:
    for credentials in ({}, {"authorization": "Bearer not-the-key"}, {"x-api-key": "not-the-key"}):
        reply = httpx.post(gw.url + CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                           headers=credentials, timeout=60)
        assert reply.status_code == 200 and reply.headers["x-routed-to"] in ("llm-0", "llm-1"), reply.text


def test_envoy_failing_open_still_adds_the_key(llama: LlamaReplicas, tmp_path: Path) -> None:
    """No routing service (nothing listens on its socket): Envoy serves round robin, with the key."""
    endpoints = tmp_path / "replicas.json"
    write_endpoints_file(endpoints, llama.addresses)
    envoy = start_gateway_envoy(tmp_path / "envoy", f"@llm-ring-nobody-{free_port()}", endpoints, True, 1,
                                replica_key_file=llama.key_file)
    try:
        served = set()
        for turn in range(4):
            reply = httpx.post(f"http://{envoy.listen}{CHAT}", timeout=60,
                               json={"messages": [{"role": "user", "content": f"open {turn}"}], "max_tokens": 2})
            assert reply.status_code == 200 and "x-routed-to" not in reply.headers, reply.text
            served.add(reply.headers["x-gateway-destination-endpoint-served"])
        assert served == set(llama.addresses.values()), "round robin over both"
    finally:
        envoy.stop()


def _stream(url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    started = time.perf_counter()
    first = None
    chunks = 0
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as reply:
        assert reply.status_code == 200
        for _ in reply.iter_raw():
            chunks += 1
            first = first or time.perf_counter() - started
        return {
            "first_s": first,
            "total_s": time.perf_counter() - started,
            "chunks": chunks,
            "routed_to": reply.headers.get("x-routed-to"),
            "request_id": reply.headers.get("x-request-id"),
        }


def _decision(gw: Gateway, request_id: str, timeout: float = 5.0) -> dict[str, Any]:
    found: list[dict[str, Any]] = []
    _until(lambda: bool(found.extend(r for r in gw.decisions() if r["request_id"] == request_id) or found), timeout)
    return found[0]


def _until(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


# ---------------------------------------------------------------- back-to-back turns
# Each turn is sent the instant the previous answer is in, as an agent loop does: the router
# must already know where the conversation's cache is (gateway.py: a turn carrying the
# previous answer releases that request before its own decision).


@pytest.mark.parametrize(
    "stream, with_header", [(False, True), (True, True), (False, False)], ids=["json", "sse", "no-header"]
)
def test_back_to_back_turns_stay_on_their_replica_and_reuse_the_whole_previous_prompt(
    gw: Gateway, stream: bool, with_header: bool
) -> None:
    gw.wait_idle()
    for conversation in range(8):
        assert_each_turn_reused_the_whole_previous_prompt(back_to_back(gw.url, conversation, stream, with_header))
    state = gw.wait_idle()
    assert state["in_flight_requests"] == 0 and state["in_flight_tokens"] == 0


def test_the_openai_sdk_back_to_back_without_headers(gw: Gateway) -> None:
    assert_sdk_turns_stay_on_one_cache(gw.url, lambda headers: headers["x-routed-to"])


def test_parallel_requests_of_one_conversation_are_each_charged_until_their_own_end(gw: Gateway) -> None:
    """An agent fans out three requests on one prefix; the short one's answer comes back and the
    agent goes on at once. At that next turn's decision the two long ones are still charged
    (their generations run on) and the short one is not: the load the decision saw is exactly
    the long ones' charges. All load is gone once every answer is in. SmolLM2-135M is fast here
    (900-token answers have ended within 0.4-1.2 s), so on a busy machine the long ones may end
    first: the fan-out is tried again then (the test needs the overlap, the router's rule does not)."""
    shared = [SYSTEM, {"role": "user", "content": "Plan three tasks."}, {"role": "assistant", "content": "OK."}]

    def fan_out(conversation: str) -> tuple[dict[str, Any], list[str]] | None:
        """(the next turn's decision, the long requests' ids); None when the long ones ended first."""
        gw.wait_idle()
        headers = {"x-conversation-id": conversation}

        def ask(task: str, max_tokens: int) -> httpx.Response:
            body = {"messages": [*shared, {"role": "user", "content": task}], "max_tokens": max_tokens,
                    "ignore_eos": True}
            return httpx.post(gw.url + CHAT, json=body, headers=headers, timeout=120)

        with ThreadPoolExecutor(2) as pool:
            long_ones = [pool.submit(ask, f"Task {i}: write a long story.", 900) for i in (1, 2)]
            _until(lambda: gw.state()["in_flight_requests"] == 2)  # both decided and charged
            short = ask("Task 0: say yes.", 2).json()
            follow = [*shared, {"role": "user", "content": "Task 0: say yes."},
                      {"role": "assistant", "content": short["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "Good, next."}]  # fmt: skip
            reply = httpx.post(gw.url + CHAT, json={"messages": follow, "max_tokens": 2}, headers=headers, timeout=60)
            assert reply.status_code == 200
            overlapped = not any(future.done() for future in long_ones)
            long_ids = [future.result().headers["x-request-id"] for future in long_ones]
        return (_decision(gw, reply.headers["x-request-id"]), long_ids) if overlapped else None

    seen = next(filter(None, (fan_out(f"fan-out-{attempt}") for attempt in range(3))), None)
    assert seen is not None, "in 3 tries the long generations always ended before the next turn: no overlap"
    decision, long_ids = seen
    charged = sum(_decision(gw, request_id)["charged_tokens"] for request_id in long_ids)
    assert sum(decision["trace"]["loads"].values()) == charged  # the long ones, not the short one
    assert gw.wait_idle()["in_flight_requests"] == 0
