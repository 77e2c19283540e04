"""Router mode as `llm-ring up --backend llama-server --models-max 1 --model smollm2,tiny`
starts it: two llama.cpp llama-servers (the binary `make setup` builds) each serving both
models, at most one loaded; the routing service (llm-aware) following each replica's model
statuses; Envoy; the openai SDK. Loads are counted from the replicas' own event streams."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from extproc.stack import llama_build, models
from extproc.stack.lab import LocalLab
from extproc.stack.settings import load_stack_settings
from tests.stack.test_live_stack import FREE_PORTS

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(not llama_build.up_to_date(models.data_dir()),
                       reason="no llama-server built (make setup builds it: llm-ring models build-llama-server)"),
]


class LoadCounter:
    """Each model load a replica reports on GET /models/sse (its status turning to "loading")."""

    def __init__(self, lab: LocalLab) -> None:
        self.loads: list[tuple[str, str]] = []
        self.connected = [threading.Event() for _ in lab.replicas()]
        for (name, address), connected in zip(lab.replicas().items(), self.connected, strict=True):
            threading.Thread(target=self._follow, args=(name, address, lab.replica_headers(), connected),
                             daemon=True).start()
        assert all(event.wait(10) for event in self.connected)

    def _follow(self, name: str, address: str, headers: dict[str, str], connected: threading.Event) -> None:
        loading: set[str] = set()
        with httpx.stream("GET", f"http://{address}/models/sse", headers=headers,
                          timeout=httpx.Timeout(10, read=None)) as response:
            connected.set()
            for line in response.iter_lines():
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    model, status = event["model"], event.get("data", {}).get("status")
                    if status == "loading" and model not in loading:
                        self.loads.append((name, model))
                    (loading.add if status == "loading" else loading.discard)(model)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalLab]:
    for name in ("smollm2", "tiny"):
        models.prepare(name, models.data_dir(), progress=lambda _: None)
    settings = load_stack_settings(overrides={
        "replicas": {"count": 2, "model": ["smollm2", "tiny"], "backend": "llama-server", "models_max": 1,
                     "ctx_size": 8192, "parallel": 4, "cache_ram_mib": 0},  # a slot for each chat
        "ports": FREE_PORTS,
        "router": {"policy": "llm-aware"},
        "check": {"profile": "quick"},
    })
    with LocalLab.start(settings, run=tmp_path_factory.mktemp("router-mode"), progress=lambda _: None) as running:
        yield running


def chat(sdk: openai.OpenAI, model: str, history: list[Any], text: str) -> tuple[str, int]:
    """One streamed turn: (the answer's model, prompt tokens found cached)."""
    history.append({"role": "user", "content": text})
    answer, served, cached = "", "", 0
    for chunk in sdk.chat.completions.create(model=model, messages=history, max_tokens=8, stream=True,
                                             stream_options={"include_usage": True}):
        served = chunk.model
        answer += chunk.choices[0].delta.content or "" if chunk.choices else ""
        if chunk.usage and chunk.usage.prompt_tokens_details:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    history.append({"role": "assistant", "content": answer})
    return served, cached


def test_each_model_keeps_its_replica_and_nothing_is_loaded_twice(lab: LocalLab) -> None:
    counter = LoadCounter(lab)
    sdk = openai.OpenAI(base_url=lab.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert sorted(model.id for model in sdk.models.list()) == ["smollm2", "tiny"]
    log = Path(lab.stack.state.run_dir) / "logs" / "router.log"
    # three chats a model, one model's after the other's: placed by their prompts alone (the ring
    # home, or the replica whose least recent prompt is oldest, which alternates) the models would
    # share the replicas and load each other out
    # a long opening of its own (no prefix shared): a turn shares more than the slot similarity (0.5)
    # with its chat's last prompt
    chats = [(model, number, [{"role": "system", "content": f"Guide {number} of {model}. " + "You know every "
                                                            "harbour of the coast. " * 8}])
             for model in ("smollm2", "tiny") for number in range(3)]
    for turn in range(2):
        for model, number, history in chats:
            served, cached = chat(sdk, model, history, f"Tell me about harbour {number}, part {turn}.")
            assert served == model
            if turn:
                assert cached > 0, f"{model} chat {number}'s turn {turn + 1} found no cache"
    routed = [json.loads(line) for line in log.read_text().splitlines() if '"request_id"' in line]
    replica_of = {model: {entry["replica"] for entry in routed if entry["model"] == model} for model in ("smollm2",
                                                                                                         "tiny")}
    assert all(len(replicas) == 1 for replicas in replica_of.values()), replica_of
    assert replica_of["smollm2"] != replica_of["tiny"]  # each model on a replica of its own
    assert sorted(model for _, model in counter.loads) == ["smollm2", "tiny"]  # one load each, never again
    assert log.read_text().count('"event":"replica_router_mode"') == 2
