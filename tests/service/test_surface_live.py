"""The gateway's surface (extproc/envoy/surface.py) through three real data planes: our own
Envoy, and Envoy AI Gateway's InferencePool plane with full-duplex and with buffered bodies (the
picker over TLS), in front of two real llama.cpp replicas started as the local stack starts them
(``--slot-save-path``: the slot actions are on).

- No control path reaches a replica, in any spelling or method: slot reads, erases, saves and
  restores, adapters, props, metrics, tokenizer, embeddings, model loading. A victim's cache is
  intact after all of them, and no file was written into the slot folder.
- A generation on every path llama.cpp serves it on (with and without /v1, a trailing slash) is
  routed, charged in flight and bounded: output tokens above a slot are charged as a slot.
- The OpenAI surface: /v1/models lists the served name, /v1/models/{id}, /health, a model no
  replica serves is 404 in OpenAI's shape, and every error the gateway makes is in that shape.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from extproc.envoy.surface import GENERATION_PATHS
from extproc.stack.processes import static_discovery
from tests.service.gateway_support import (
    PLANES,
    Gateway,
    LlamaReplicas,
    data_plane,
    error_message,
    gateway,
    llama_replicas,
)

pytestmark = pytest.mark.live
CONTROL_PATHS = [
    "/slots", "/slots/0?action=erase", "/slots/1?action=erase", "/slots/0?action=save",
    "/slots/0?action=restore", "/lora-adapters", "/props", "/metrics", "/tokenize", "/detokenize",
    "/embedding", "/v1/embeddings", "/infill", "/apply-template", "/v1/rerank", "/v1/messages",
    "/models/load", "/models/unload",
]


def spellings(path: str) -> list[str]:
    """The same target as a lenient server, a normalizing proxy or a sloppy match could read it."""
    bare, _, query = path.partition("?")
    tail = f"?{query}" if query else ""
    return [path, bare.upper() + tail, "/" + path, bare + "/" + tail, "/v1/chat/completions/../.." + path,
            "/%" + f"{ord(bare[1]):02x}" + bare[2:] + tail, "/." + path, bare + "%2f" + tail]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LlamaReplicas, Path]]:
    run = tmp_path_factory.mktemp("replicas")
    with llama_replicas(run) as replicas:
        yield replicas, run / "slots"


@pytest.fixture(scope="module", params=PLANES)
def plane(request: pytest.FixtureRequest, llama: tuple[LlamaReplicas, Path],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with data_plane(request.param, tmp_path_factory.mktemp(request.param), llama[0], routing_headers="true") as gw:
        yield gw


def reached_a_replica(gw: Gateway, reply: httpx.Response) -> bool:
    """The answer came from upstream: our Envoy adds the served endpoint on routed routes only; the
    InferencePool plane shows the upstream it used."""
    return bool(reply.headers.get("x-gateway-destination-endpoint-served") or reply.headers.get("x-upstream-host"))


def victim_turns(gw: Gateway, history: list[dict[str, str]], turns: int) -> list[dict[str, Any]]:
    """``turns`` more turns of the chat ``history`` (extended in place): llama.cpp's timings of each."""
    seen = []
    for _ in range(turns):
        history.append({"role": "user", "content": f"Turn {len(history)}: name a fruit and a colour."})
        reply = httpx.post(gw.url + "/v1/chat/completions", timeout=120,
                           json={"model": "smollm2", "messages": history, "max_tokens": 4, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        data = reply.json()
        seen.append({"replica": gw.routed_to(reply), **data["timings"]})
        history.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
    return seen


def test_no_control_path_reaches_a_replica_and_the_victims_cache_is_intact(
    plane: Gateway, llama: tuple[LlamaReplicas, Path]
) -> None:
    _, slot_folder = llama
    history = [{"role": "system", "content": "You are the victim's assistant. Keep it short."}]
    before = victim_turns(plane, history, 2)
    refused = 0
    for path in CONTROL_PATHS:
        for spelled in spellings(path):
            for method in ("GET", "POST"):
                body = {"filename": "attacker-written.bin"} if method == "POST" else None
                reply = httpx.request(method, plane.url + spelled, json=body, timeout=30)
                assert not reached_a_replica(plane, reply), (method, spelled, reply.status_code, reply.text[:200])
                assert reply.status_code in (400, 404, 405), (method, spelled, reply.status_code, reply.text[:200])
                if reply.headers.get("content-type", "").startswith("application/json"):
                    error_message(reply.json())
                    refused += 1
    assert refused >= len(CONTROL_PATHS) * 8  # most refusals are the gateway's own, in OpenAI's shape
    assert not list(slot_folder.glob("attacker*")), "a slot was saved through the gateway"
    (after,) = victim_turns(plane, history, 1)  # the victim's next turn
    assert after["replica"] == before[-1]["replica"]
    assert after["cache_n"] >= before[-1]["cache_n"] + before[-1]["prompt_n"], (before, after)
    assert plane.wait_idle()["in_flight_requests"] == 0


@pytest.mark.parametrize("path", [*GENERATION_PATHS, *(path + "/" for path in GENERATION_PATHS)])
def test_a_generation_on_every_path_is_routed_charged_and_bounded(plane: Gateway, path: str) -> None:
    canonical = path.rstrip("/")
    body: dict[str, Any] = {"max_tokens": 100_000, "ignore_eos": True, "stream": True}
    body |= ({"messages": [{"role": "user", "content": f"count for {path}"}]} if GENERATION_PATHS[canonical] == "chat"
             else {"prompt": f"Count for {path}: 1, 2,"})
    if plane.replica_of:  # an InferencePool plane: the charge is read from the decision, so the answer
        body["stop"] = [" ", ",", "\n"]  # may end at once (the buffered plane holds it until it ends)
    seen = len(plane.decisions())
    with httpx.stream("POST", plane.url + path, json=body, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        assert plane.routed_to(reply), dict(reply.headers)  # routed by the router: its replica is named
        next(line for line in reply.iter_lines() if line.startswith("data: "))  # generating
        if not plane.replica_of:  # our own Envoy: charged until its access log entry says the request is over
            state = plane.state()
            assert state["in_flight_requests"] == 1 and 4096 <= state["in_flight_tokens"] <= 4096 + 64, state
    assert plane.wait_idle(10)["in_flight_requests"] == 0  # the client went away: released
    deadline = time.monotonic() + 5
    while not (mine := [d for d in plane.decisions()[seen:] if d["path"] == canonical]):
        assert time.monotonic() < deadline, f"no decision for {path}"
        time.sleep(0.1)
    # charged the prompt and one slot of output (service.max_output_tokens), not 100,000
    assert mine[0]["max_tokens"] == 4096 and 4096 <= mine[0]["charged_tokens"] <= 4096 + 64, mine[0]


def test_the_fleet_lists_its_models_and_refuses_one_it_does_not_serve(plane: Gateway) -> None:
    client = openai.OpenAI(base_url=plane.url + "/v1", api_key="none", max_retries=0)
    deadline = time.monotonic() + 10
    while not (listed := [model.id for model in client.models.list()]) and time.monotonic() < deadline:
        time.sleep(0.2)  # the service asks the replicas as they appear
    assert listed == ["smollm2"]
    assert client.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert "gpt-4o" in str(missing.value) and missing.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as unserved:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "smollm2" in str(unserved.value)  # the message names what is served
    reply = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2)
    assert reply.model == "smollm2"  # the replica's alias, not its file's path
    health = httpx.get(plane.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}


@pytest.mark.parametrize(("method", "path", "body", "status", "param"), [
    ("POST", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": 3}]}, 400, "messages[0].role"),
    ("POST", "/v1/completions", {"prompt": 3}, 400, "prompt"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": "a"}, 400,
     "max_tokens"),
    ("GET", "/v1/chat/completions", None, 405, None),
    ("POST", "/v1/models", {}, 405, None),
    ("POST", "/slots/0?action=erase", {}, 404, None),
])
def test_every_error_of_the_gateway_is_in_openais_shape(
    plane: Gateway, method: str, path: str, body: Any, status: int, param: str | None
) -> None:
    reply = httpx.request(method, plane.url + path, json=body, timeout=30)
    assert reply.status_code == status, reply.text
    assert error_message(reply.json())
    assert reply.json()["error"]["param"] == param


def test_a_list_of_prompts_is_routed_and_charged_per_prompt(plane: Gateway) -> None:
    reply = httpx.post(plane.url + "/v1/completions", timeout=120,
                       json={"prompt": ["Red, green,", "One, two,"], "max_tokens": 3})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 2
    plane.wait_idle()
    deadline = time.monotonic() + 5
    while not any(d["path"] == "/v1/completions" and d["max_tokens"] == 6 for d in plane.decisions()):
        assert time.monotonic() < deadline, "no decision charged 3 output tokens per prompt"
        time.sleep(0.1)


def test_envoys_own_errors_are_in_openais_shape_too(tmp_path: Path) -> None:
    """A replica that refuses every connection: Envoy's own 503, mapped to OpenAI's shape, its
    response code details as the code."""
    with gateway(tmp_path, static_discovery({"llm-0": "127.0.0.1:1"})) as gw:
        reply = httpx.post(gw.url + "/v1/chat/completions", timeout=30,
                           json={"messages": [{"role": "user", "content": "anyone?"}]})
    assert reply.status_code == 503
    assert "upstream connect error" in error_message(reply.json())
    assert reply.json()["error"]["type"] == "server_error"
    assert reply.json()["error"]["code"].startswith("upstream_reset_before_response_started")
