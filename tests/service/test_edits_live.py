"""Edited, regenerated and retried histories keep their cache (docs/security.md#edited-histories),
live: 3 real llama.cpp replicas (SmolLM2-135M, started as the local stack starts them) behind our
own Envoy and behind Envoy AI Gateway's InferencePool plane (full duplex, the service as its picker).

A 4-turn chat, then, under the chat's id, a body that continues nothing the gateway knows of it:
turn 2 edited and resent, turn 2 resent as it was (its answer regenerated), or the first message
resent with ``tool_choice: "required"`` (a client's retry). Each must reach the replica holding the
chat, and llama.cpp must report (``timings.cache_n``) at least the prefix the body shares with what
that replica holds, less one block: BLOCK_TOKENS, our prefix block (extproc/routing/blocks.py, 64
characters: ~16 tokens). llama.cpp itself reuses a common prefix to the token (this model has no
sliding window; measured: cache_n equal to the shared prefix).
The ids are chosen so that the key such a body is routed under has another ring home than the
chat's: without branch points it lands there and finds nothing cached.

Strangers (routing headers off, our own Envoy): the chat's opening and a guessed answer, under no
id, the chat's id or another's. No header says where the request went or what was predicted; it
is predicted at most the opening it proves, and routed under a key of its own; the chat's next
turn still goes to its replica, placed with its whole history (what llama.cpp kept of it there is
printed: a request sharing a slot's prefix takes that slot, docs/security.md#edited-histories).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from extproc.envoy.contract import PREDICTED_CACHED, ROUTE_REASON, ROUTED_TO, SERVED
from extproc.routing.continuation import unclaimed
from extproc.service.bodies import parse_request
from tests.service.gateway_support import Gateway, LlamaReplicas, data_plane, llama_replicas
from tests.service.gateway_support import ring_home as shared_ring_home

pytestmark = pytest.mark.live
CHAT = "/v1/chat/completions"
BLOCK_TOKENS = 16
REPLICAS = ["llm-0", "llm-1", "llm-2"]
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
Messages = list[dict[str, str]]
PARAGRAPH = ("Where does the water of a river come from, how does it find its way down the hills to a lake, "
             "and why is the sea salty when the rivers that feed it are not? Answer as you would to a child "
             "who walks along the river every morning on the way to school and asks a new question each day.")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaReplicas]:
    with llama_replicas(tmp_path_factory.mktemp("replicas"), count=3, cache_ram_mib=64) as replicas:
        yield replicas


@pytest.fixture(scope="module", params=["own-envoy", "ai-gateway-duplex"])
def plane(request: pytest.FixtureRequest, llama: LlamaReplicas,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with data_plane(request.param, tmp_path_factory.mktemp(request.param), llama, routing_headers="true") as gw:
        yield gw


def opening(name: str) -> Messages:
    return [{"role": "system", "content": f"You help {name}. Keep it short."},
            {"role": "user", "content": f"{name}: tell me about rivers, lakes and the sea. " + PARAGRAPH}]


def ring_home(conversation: str) -> str:
    return shared_ring_home(conversation, REPLICAS)


def branching_elsewhere(prefix: str) -> str:
    """A conversation id whose branches' key (the id with the chat's opening) has another ring home."""
    for index in range(100):
        name = f"{prefix}-{index}"
        body = orjson.dumps({"messages": opening(name)})
        branch = unclaimed(name, parse_request(CHAT, "application/json", body).opening_key)
        if ring_home(branch) != ring_home(name):
            return name
    raise AssertionError("no such id")


def ask(gw: Gateway, messages: Messages, conversation: str, **extra: Any) -> tuple[httpx.Response, dict[str, Any]]:
    headers = {"x-conversation-id": conversation} if conversation else {}
    reply = httpx.post(gw.url + CHAT, headers=headers, timeout=120,
                       json={"messages": messages, "max_tokens": 4, "ignore_eos": True, **extra})
    assert reply.status_code == 200, reply.text
    return reply, reply.json()


def four_turns(gw: Gateway, name: str, where: Callable[[httpx.Response], str] | None = None,
               ) -> tuple[Messages, str, list[dict[str, Any]]]:
    """A 4-turn chat under the id ``name``: its messages (the last answer included), its replica
    (``where`` an answer came from; the gateway's routing headers by default) and timings."""
    messages, replicas, timings = opening(name), [], []
    for turn in range(4):
        if turn:
            messages.append({"role": "user", "content": f"{name}: question {turn}, about mountains."})
        reply, data = ask(gw, messages, name)
        replicas.append((where or gw.routed_to)(reply))
        timings.append(data["timings"])
        messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
    assert len(set(replicas)) == 1, replicas
    return messages, replicas[0], timings


def shared_tokens(llama: LlamaReplicas, replica: str, held: Messages, sent: Messages) -> int:
    """The tokens ``sent`` shares with the prompt ``held`` as the replica renders and tokenizes them."""
    with httpx.Client(base_url=f"http://{llama.addresses[replica]}", headers=llama.headers, timeout=30) as client:
        def tokens(messages: Messages) -> list[int]:
            prompt = client.post("/apply-template", json={"messages": messages}).json()["prompt"]
            reply = client.post("/tokenize", json={"content": prompt, "add_special": False, "parse_special": True})
            return list(reply.json()["tokens"])

        first, second = tokens(held), tokens(sent)
    return next((at for at, (a, b) in enumerate(zip(first, second, strict=False)) if a != b),
                min(len(first), len(second)))


@pytest.mark.parametrize("branch", ["edit", "regenerate", "retry"])
def test_a_branch_of_a_chat_goes_where_its_prefix_is_cached(plane: Gateway, llama: LlamaReplicas,
                                                            branch: str) -> None:
    name = branching_elsewhere(f"{branch}-{plane.replica_of and 'pool' or 'own'}")
    messages, replica, _ = four_turns(plane, name)
    extra: dict[str, Any] = {}
    if branch == "edit":
        sent = [*messages[:3], {"role": "user", "content": f"{name}: an edited question 1, about deserts."}]
    elif branch == "regenerate":
        sent = messages[:4]
    else:
        sent, extra = messages[:2], {"tools": [TOOL], "tool_choice": "required"}
    reply, data = ask(plane, sent, name, **extra)
    shared = shared_tokens(llama, replica, messages[:-1], sent)
    print(f"{branch}: replica {plane.routed_to(reply)} (chat on {replica}), cache_n {data['timings']['cache_n']}, "
          f"shared {shared}, prompt {data['usage']['prompt_tokens']}")
    assert plane.routed_to(reply) == replica
    assert data["timings"]["cache_n"] >= shared - BLOCK_TOKENS, (data["timings"], shared)
    assert plane.wait_idle()["in_flight_requests"] == 0


@pytest.fixture(scope="module")
def quiet(llama: LlamaReplicas, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Our own Envoy as deployed: routing headers off."""
    with data_plane("own-envoy", tmp_path_factory.mktemp("quiet"), llama, routing_headers="false") as gw:
        yield gw


def test_a_stranger_with_the_chats_opening_learns_and_moves_nothing(quiet: Gateway, llama: LlamaReplicas) -> None:
    replica_of = {address: name for name, address in llama.addresses.items()}

    def served(reply: httpx.Response) -> str:  # what a client sees: the upstream address, no replica name
        return replica_of.get(reply.headers.get(SERVED, ""), "")

    messages, replica, timings = four_turns(quiet, "victim", served)
    quiet.wait_idle()
    victim = [record for record in quiet.decisions() if record["conversation"] == "victim"]
    guess = "a guessed answer"
    for name in ("", "victim", "someone else"):
        forged = [*messages[:2], {"role": "assistant", "content": guess}, {"role": "user", "content": f"{name}?"}]
        reply, _ = ask(quiet, forged, name)
        assert not {ROUTED_TO, ROUTE_REASON, PREDICTED_CACHED} & set(reply.headers), dict(reply.headers)
        quiet.wait_idle()
        record = next(r for r in quiet.decisions() if r["request_id"] == reply.headers["x-request-id"])
        assert record["conversation"] != "victim", record  # routed under a key that is not the chat's
        # told at most the opening it proves (and its own guess), never the chat's 4 turns
        assert record["predicted_cached_tokens"] <= victim[0]["prompt_tokens"] + len(guess) // 4 + 4, record
    messages.append({"role": "user", "content": "victim: and the last question?"})
    reply, data = ask(quiet, messages, "victim")
    assert served(reply) == replica
    quiet.wait_idle()
    record = next(r for r in quiet.decisions() if r["request_id"] == reply.headers["x-request-id"])
    # the router still places the whole history there (what llama.cpp kept of it: docs/security.md)
    assert record["predicted_cached_tokens"] >= victim[-1]["prompt_tokens"], record
    print(f"victim's next turn: cache_n {data['timings']['cache_n']} of {data['usage']['prompt_tokens']} "
          f"(its last turn held {timings[-1]['cache_n'] + timings[-1]['prompt_n']})")
