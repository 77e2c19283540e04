"""Real OpenAI clients through the gateway, in both data planes (conftest.py): the `openai` SDK,
LiteLLM, langchain-openai and the `llm` command line (clients.py), none sending a custom header.

For each client in each plane: the fleet's models listed by the client's own call; a chat of
three turns, JSON and streamed, every follow-up served by the replica that served its first
turn and finding the whole previous prompt in its cache (the router's decision records); and a
request naming a model the fleet does not serve, whose reason (the gateway's message) is in what
the client shows its user.
"""

from __future__ import annotations

import httpx
import pytest

from tests.compat.clients import CLIENTS, MODEL, Client
from tests.service.gateway_support import Gateway, assert_each_turn_reused_the_whole_previous_prompt, error_message

pytestmark = pytest.mark.live
TURNS = ("Name a colour.", "Name a fruit of that colour.", "And a vegetable?")


@pytest.fixture(params=list(CLIENTS))
def client(request: pytest.FixtureRequest, plane: Gateway, tmp_path_factory: pytest.TempPathFactory) -> Client:
    return CLIENTS[request.param](plane.url, tmp_path_factory.mktemp(request.param))


def test_the_client_lists_the_fleets_models(client: Client) -> None:
    assert client.list_models() == [MODEL]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_a_chat_of_three_turns_stays_on_the_replica_holding_its_cache(
    client: Client, plane: Gateway, stream: bool, request: pytest.FixtureRequest
) -> None:
    system = f"You are the assistant of {request.node.name}. Answer in one word."  # a chat of its own
    seen = len(plane.decisions())
    answers = client.chat(system, TURNS, stream)
    assert len(answers) == len(TURNS)
    turns = plane.decisions_after(seen, len(TURNS))
    assert len(turns) == len(TURNS), turns  # one request per turn, nothing else
    assert all(t["path"] == "/v1/chat/completions" and t["stream"] is stream for t in turns), turns
    assert all(t["outcome"] == "ok" and t["status"] == 200 for t in turns), turns  # whole answers, timings read
    assert_each_turn_reused_the_whole_previous_prompt(turns)
    assert plane.wait_idle()["in_flight_requests"] == 0


def test_the_client_shows_the_gateways_reason_for_a_model_it_does_not_serve(client: Client, plane: Gateway) -> None:
    unserved = "gpt-4o"
    gateway_says = httpx.post(plane.url + "/v1/chat/completions", timeout=10,
                              json={"model": unserved, "messages": [{"role": "user", "content": "hi"}]})
    assert gateway_says.status_code == 404 and gateway_says.json()["error"]["code"] == "model_not_found"
    reason = error_message(gateway_says.json())
    assert unserved in reason and MODEL in reason  # what was asked, and what is served
    shown = client.refusal(unserved)
    assert reason in shown, shown
