"""LoRA adapters live: 2 real llama.cpp replicas (the tiny model, each loading tiny-lora-a and
tiny-lora-b as the local stack loads them, at scale 0) behind our own Envoy. One conversation's
turns alternate between the two adapters. llama.cpp drops a slot's cache when a request of
another adapter configuration takes it, so each configuration's turns are a conversation of their
own (the adapters in the key): each follow-up goes to the replica that served the same
configuration's last turn, and llama.cpp reports (``timings.cache_n``) that turn's prompt cached.
The id is chosen so that the two configurations' keys have different ring homes: on one replica
they would share its slots, which llama.cpp hands out by prompt likeness alone
(docs/clients.md#lora-adapters)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from extproc.routing.continuation import of_model
from extproc.service.bounds import bounded_scope
from tests.service.gateway_support import Gateway, LlamaReplicas, data_plane, llama_replicas
from tests.service.gateway_support import ring_home as shared_ring_home

pytestmark = pytest.mark.live
CHAT = "/v1/chat/completions"
REPLICAS = ["llm-0", "llm-1"]
ADAPTERS = {"a": ([{"id": 0, "scale": 1.0}], "lora:0=1.0"), "b": ([{"id": 1, "scale": 0.5}], "lora:1=0.5")}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaReplicas]:
    with llama_replicas(tmp_path_factory.mktemp("replicas"), model="tiny", lora=("tiny-lora-a", "tiny-lora-b")) as r:
        yield r


@pytest.fixture(scope="module")
def gw(llama: LlamaReplicas, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with data_plane("own-envoy", tmp_path_factory.mktemp("gw"), llama, routing_headers="true") as gateway:
        yield gateway


def ring_home(conversation: str) -> str:
    return shared_ring_home(conversation, REPLICAS)


def apart(prefix: str) -> str:
    """An id whose two adapter configurations' keys have different ring homes."""
    for index in range(100):
        name = f"{prefix}-{index}"
        homes = {ring_home(of_model(bounded_scope("tiny", label), name)) for _, label in ADAPTERS.values()}
        if len(homes) == 2:
            return name
    raise AssertionError("no such id")


def test_turns_alternating_between_two_adapters_each_find_their_own_cache(gw: Gateway) -> None:
    name = apart("lora")
    messages: list[dict[str, str]] = [{"role": "system", "content": "You answer in one line."}]
    last: dict[str, tuple[str, int]] = {}  # adapter -> (its replica, its last prompt's tokens)
    seen = len(gw.decisions())
    for turn in range(6):
        adapter = "ab"[turn % 2]
        messages.append({"role": "user", "content": f"{name} question {turn}: " + "rivers and lakes " * 12})
        reply = httpx.post(gw.url + CHAT, headers={"x-conversation-id": name}, timeout=120,
                           json={"model": "tiny", "messages": messages, "max_tokens": 4, "ignore_eos": True,
                                 "lora": ADAPTERS[adapter][0]})
        assert reply.status_code == 200, reply.text
        data, replica = reply.json(), gw.routed_to(reply)
        timings = data["timings"]
        print(f"turn {turn} adapter {adapter}: {replica}, cache_n {timings['cache_n']}, prompt_n {timings['prompt_n']}")
        if adapter in last:
            held_on, held = last[adapter]
            assert replica == held_on
            assert timings["cache_n"] >= held - 1, (timings, held)  # the last turn's prompt, as llama.cpp tokenized it
        else:
            assert timings["cache_n"] <= 1  # nothing of the conversation under this configuration yet
        last[adapter] = (replica, timings["cache_n"] + timings["prompt_n"])
        messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
    assert last["a"][0] != last["b"][0]
    logged = gw.decisions_after(seen, 6)
    for turn, record in enumerate(logged):
        _, label = ADAPTERS["ab"[turn % 2]]
        assert (record["model"], record["lora"]) == ("tiny", label)
        assert record["conversation"] == of_model(bounded_scope("tiny", label), name)
        assert (record["predicted_cached_tokens"] > 0) == (turn >= 2), record  # each follow-up: its cache predicted
