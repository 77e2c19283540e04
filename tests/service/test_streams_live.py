"""A stream the client received whole is never logged ``abandoned``: the `openai` SDK reads a
streamed answer up to ``[DONE]`` and closes the connection at once, which Envoy records as the
client going away. Real llama.cpp replicas (2, the tiny model), the SDK as its users run it, several
conversations at once, through our own Envoy and Envoy AI Gateway's InferencePool plane (full
duplex, the service as its picker): every turn's decision record is ``ok`` with llama.cpp's timings.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.service.gateway_support import Gateway, LlamaReplicas, data_plane, llama_replicas

pytestmark = pytest.mark.live
# (plane, conversations, turns each): 200 turns through each
RUNS = [("own-envoy", 20, 10), ("ai-gateway-duplex", 20, 10)]
CLIENTS = 4  # conversations sent at once


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaReplicas]:
    with llama_replicas(tmp_path_factory.mktemp("replicas"), model="tiny") as replicas:
        yield replicas


def streamed_chat(gw: Gateway, name: str, turns: int) -> None:
    """A chat of ``turns`` streamed turns through the SDK, which closes each stream after [DONE]."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "system", "content": f"You are {name}'s assistant."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{name}, turn {turn}: say something."})
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, stream=True,
                                                extra_body={"ignore_eos": True},
                                                extra_headers={"x-conversation-id": name})
        answer = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        messages.append({"role": "assistant", "content": answer})


@pytest.mark.parametrize(("plane", "conversations", "turns"), RUNS, ids=[run[0] for run in RUNS])
def test_no_stream_the_sdk_read_to_its_end_is_abandoned(llama: LlamaReplicas, tmp_path_factory: pytest.TempPathFactory,
                                                       plane: str, conversations: int, turns: int) -> None:
    with data_plane(plane, tmp_path_factory.mktemp(plane), llama) as gw:
        names = [f"{plane}-{index}" for index in range(conversations)]
        with ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(lambda name: streamed_chat(gw, name, turns), names))
        assert gw.wait_idle(10)["in_flight_requests"] == 0
        deadline = time.monotonic() + 10
        while len(records := [r for r in gw.decisions() if r["stream"]]) < conversations * turns:
            assert time.monotonic() < deadline, f"{len(records)} decision records"
            time.sleep(0.1)
    outcomes = Counter(record["outcome"] for record in records)
    print(f"{plane}: {len(records)} streamed turns, outcomes {dict(outcomes)}")
    assert outcomes == {"ok": conversations * turns}, outcomes
    assert all(record.get("cache_n") is not None for record in records)
