"""The `openai` SDK's calls beyond a chat (test_clients.py has its listing, chats and refusal),
through both data planes: one model retrieved and an unserved one refused, legacy completions
(JSON and streamed), and ``with_raw_response``, whose headers name the replica the router's
record names, turn after turn, with the SDK's own ``cached_tokens`` growing."""

from __future__ import annotations

import openai
import pytest

from tests.compat.clients import API_KEY, MODEL
from tests.service.gateway_support import Gateway, assert_sdk_turns_stay_on_one_cache

pytestmark = pytest.mark.live


@pytest.fixture
def sdk(plane: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=plane.url + "/v1", api_key=API_KEY, max_retries=0)


def test_a_model_is_retrieved_and_an_unserved_one_refused_with_the_reason(sdk: openai.OpenAI) -> None:
    model = sdk.models.retrieve(MODEL)
    assert (model.id, model.object) == (MODEL, "model")
    with pytest.raises(openai.NotFoundError) as refused:
        sdk.models.retrieve("gpt-4o")
    assert refused.value.code == "model_not_found" and "'gpt-4o' is not served here" in str(refused.value)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_legacy_completions_are_routed(sdk: openai.OpenAI, plane: Gateway, stream: bool) -> None:
    seen = len(plane.decisions())
    prompt = f"Count, {'streamed' if stream else 'json'}: one, two,"
    if stream:
        text = "".join(chunk.choices[0].text for chunk in sdk.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, stream=True) if chunk.choices)
    else:
        completion = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert completion.model == MODEL
        text = completion.choices[0].text
    assert text
    (record,) = plane.decisions_after(seen, 1)
    assert (record["path"], record["stream"], record["outcome"]) == ("/v1/completions", stream, "ok"), record


def test_raw_responses_name_the_replica_the_router_recorded(plane: Gateway) -> None:
    seen = len(plane.decisions())
    assert_sdk_turns_stay_on_one_cache(plane.url, lambda headers: headers["x-routed-to"])
    turns = plane.decisions_after(seen, 3)
    assert len({turn["replica"] for turn in turns}) == 1 and all(t["outcome"] == "ok" for t in turns), turns


def test_no_replica_cors_header_reaches_the_sdk(sdk: openai.OpenAI) -> None:
    """llama.cpp sets access-control-allow-origin on every answer (empty without an Origin):
    the gateway removes it (service.cors_origins alone sets it)."""
    raw = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert raw.parse().model == MODEL
    assert "access-control-allow-origin" not in raw.headers, dict(raw.headers)
