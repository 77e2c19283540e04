"""A local stack of two models as `llm-ring up` starts it ([replicas] model = ["smollm2",
"smollm2", "tiny"]): real xllamacpp replicas, the routing service and Envoy. Every request is
answered by a replica serving the model it names (the answer's own ``model`` field), a
follow-up finds its cache, an unknown model gets 404 and a model whose replicas left 503 in
OpenAI's shape, and the openai SDK lists both models."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import openai
import pytest

from extproc.stack import models
from extproc.stack.lab import LocalLab
from extproc.stack.settings import load_stack_settings
from tests.service.gateway_support import error_message

pytestmark = pytest.mark.live
FREE_PORTS = {"gateway": 0, "envoy_admin": 0, "router": 0, "metrics": 0, "replica_base": 0}
FLEET = ["smollm2", "smollm2", "tiny"]
SERVES = {"llm-0": "smollm2", "llm-1": "smollm2", "llm-2": "tiny"}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalLab]:
    for name in set(FLEET):
        models.prepare(name, models.data_dir(), progress=lambda _: None)  # cached in the data dir
    settings = load_stack_settings(overrides={
        "replicas": {"count": 3, "model": FLEET, "ctx_size": 4096, "parallel": 2, "cache_ram_mib": 0},
        "ports": FREE_PORTS,
        "router": {"policy": "llm-aware"},
        "check": {"profile": "quick"},
    })
    with LocalLab.start(settings, run=tmp_path_factory.mktemp("fleet"), progress=lambda _: None) as running:
        yield running


def client(lab: LocalLab) -> openai.OpenAI:
    return openai.OpenAI(base_url=lab.gateway_url + "/v1", api_key="unused", max_retries=0)


def test_the_stack_starts_each_replica_with_its_model(lab: LocalLab) -> None:
    assert {r["name"]: r["model"] for r in lab.stack.status()["replicas"]} == SERVES
    for name, address in lab.replicas().items():
        listed = httpx.get(f"http://{address}/v1/models", headers=lab.replica_headers(), timeout=10).json()
        assert [entry["id"] for entry in listed["data"]] == [SERVES[name]]


def test_the_sdk_lists_both_models(lab: LocalLab) -> None:
    assert sorted(model.id for model in client(lab).models.list()) == ["smollm2", "tiny"]


def test_every_answer_comes_from_its_model_and_follow_ups_find_their_cache(lab: LocalLab) -> None:
    sdk = client(lab)
    for number in range(6):  # the same opening and id under both models, turn after turn
        for model in ("smollm2", "tiny"):
            messages: list[Any] = [{"role": "user", "content": f"Tell me about harbour number {number}."}]
            served, cached = [], []
            for _ in range(2):
                raw = sdk.chat.completions.with_raw_response.create(
                    model=model, messages=messages, max_tokens=6, extra_body={"ignore_eos": True},
                    extra_headers={"x-conversation-id": f"chat-{number}"})
                answer = raw.parse()
                assert answer.model == model, (answer.model, model)  # the replica's own word
                assert SERVES[raw.headers["x-routed-to"]] == model
                served.append(raw.headers["x-routed-to"])
                cached.append(answer.usage.prompt_tokens_details.cached_tokens if answer.usage else None)
                messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                             {"role": "user", "content": "And then?"}]
            assert served[0] == served[1] and cached[1], (model, served, cached)


def test_an_unknown_model_gets_404_and_a_model_whose_replicas_left_503(lab: LocalLab) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    unknown = httpx.post(lab.gateway_url + "/v1/chat/completions", json={**body, "model": "no-such-model"},
                         timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert "smollm2" in error_message(unknown.json()) and "tiny" in error_message(unknown.json())
    # llm-2, the only tiny replica, leaves: no replica can take its caches, so it does not wait
    # for their move until the drain's deadline (stack.toml's drain_seconds, 60) but drains at once
    [step] = lab.scale_in(2, migrate=None)
    took = datetime.fromisoformat(str(step["drained"])) - datetime.fromisoformat(str(step["out"]))
    assert step["replica"] == "llm-2" and step["migration"]["slots"] == 0 and took.total_seconds() < 30, step
    try:
        gone = httpx.post(lab.gateway_url + "/v1/chat/completions", json={**body, "model": "tiny"}, timeout=30)
        assert gone.status_code == 503 and error_message(gone.json()).startswith("the model 'tiny' has no ready")
        still = httpx.post(lab.gateway_url + "/v1/chat/completions", json={**body, "model": "smollm2"}, timeout=60)
        assert still.status_code == 200 and still.json()["model"] == "smollm2"
    finally:
        lab.scale(3)
    back = httpx.post(lab.gateway_url + "/v1/chat/completions", json={**body, "model": "tiny"}, timeout=60)
    assert back.status_code == 200 and back.headers["x-routed-to"] == "llm-2" and back.json()["model"] == "tiny"
