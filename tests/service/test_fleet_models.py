"""A fleet of several models, decided by the gateway without gRPC: the model is part of the
conversation's key, of its prefix blocks and of the histories a branch may prove; a model that
was served but has no replica now gets 503, one never served 404 (OpenAI's shape)."""

from __future__ import annotations

from typing import Any

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.routing.blocks import prefix_blocks
from extproc.service.answers import error_document
from extproc.service.bodies import parse_request
from extproc.service.catalog import ModelEntry
from extproc.service.dataplanes.own_envoy import OWN_ENVOY
from extproc.service.gateway import Gateway
from extproc.service.lifecycle import Pending
from tests.service.test_gateway_lifecycle import ENDPOINTS, logged, make_gateway

CHAT = "/v1/chat/completions"


def fleet(served: dict[str, tuple[str, ...]]) -> Gateway:
    """A gateway whose replicas serve these models (replica -> model ids)."""
    gateway = make_gateway()
    for replica, models in served.items():
        gateway.catalog.learn(replica, tuple(ModelEntry(model, 0, "llamacpp", f"/m/{model}.gguf") for model in models))
    return gateway


def turn(gateway: Gateway, messages: list[dict[str, str]], model: str, session: str = "") -> Pending | bytes:
    """One chat request, answered whole when routed; the immediate answer when refused."""
    headers = {"x-conversation-id": session} if session else {}
    answer, routed = gateway.route_request(
        shape=OWN_ENVOY, path=CHAT, content_type="application/json", session_headers=headers, turn="", request_id="",
        body=orjson.dumps({"model": model, "messages": messages, "max_tokens": 8}))
    return logged(gateway, answer, routed)


def routed(gateway: Gateway, messages: list[dict[str, str]], model: str, session: str = "") -> Pending:
    pending = turn(gateway, messages, model, session)
    assert isinstance(pending, Pending), pending
    return pending


def test_one_id_under_two_models_is_two_conversations_each_on_its_models_replicas() -> None:
    gateway = fleet({"llm-0": ("smollm2",), "llm-1": ("smollm2",), "llm-2": ("tiny",)})
    first = [{"role": "user", "content": "hello " * 50}]
    small = routed(gateway, first, "smollm2", "c-1")
    tiny = routed(gateway, first, "tiny", "c-1")
    assert small.decision.replica in ("llm-0", "llm-1") and tiny.decision.replica == "llm-2"
    assert small.request.conversation != tiny.request.conversation
    following = [*first, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    again = routed(gateway, following, "smollm2", "c-1")
    assert again.decision.replica == small.decision.replica and again.continued  # its own history, its own cache
    assert routed(gateway, following, "tiny", "c-1").decision.replica == "llm-2"


def test_equal_prompts_under_two_models_share_no_prefix_block() -> None:
    body = {"messages": [{"role": "user", "content": "the same long prompt " * 20}]}
    blocks = {model: parse_request(CHAT, "", orjson.dumps({**body, "model": model}), block_chars=64).prefix_blocks
              for model in ("smollm2", "tiny", "")}
    assert not set(blocks["smollm2"]) & set(blocks["tiny"])
    assert len(blocks["smollm2"]) == len(blocks["tiny"]) == len(blocks[""])
    text = "".join(f"{m['role']}\x00{m['content']}\x00" for m in body["messages"])
    assert blocks[""] == prefix_blocks(text, 64)  # no model named: as before


def test_a_branch_finds_its_prefix_only_under_the_model_that_served_it() -> None:
    """Router mode: one replica serving both models. An edited turn proves a completed history;
    under the other model that history's cache is no cache of its."""
    both = ("smollm2", "tiny")
    gateway = fleet({name: both for name in ENDPOINTS})
    messages = [{"role": "system", "content": "You help."}]
    served = []
    for number in range(3):
        messages.append({"role": "user", "content": f"question {number} " + "lorem ipsum " * 40})
        served.append(routed(gateway, messages, "smollm2"))
        messages.append({"role": "assistant", "content": f"answer {number}"})
    edited = [*messages[:3], {"role": "user", "content": "an edited second question"}]
    routed(gateway, edited, "tiny")
    assert gateway.metrics.branches == 0
    branch = routed(gateway, edited, "smollm2")
    assert gateway.metrics.branches == 1 and branch.decision.replica == served[0].decision.replica


def error(answer: Any) -> tuple[int, dict[str, Any]]:
    response = pb.ProcessingResponse.FromString(answer).immediate_response
    return response.status.code, orjson.loads(response.body)


def test_a_model_served_before_gets_503_and_one_never_served_404() -> None:
    gateway = fleet({"llm-0": ("smollm2",), "llm-1": ("smollm2",), "llm-2": ("tiny",)})
    gateway.set_replicas({name: address for name, address in ENDPOINTS.items() if name != "llm-2"})  # tiny's left
    hello = [{"role": "user", "content": "hello"}]
    status, document = error(turn(gateway, hello, "tiny"))
    assert status == 503 and document == error_document(503, "the model 'tiny' has no ready replica: retry shortly",
                                                         "no_replica", "model")
    status, document = error(turn(gateway, hello, "/m/tiny.gguf"))  # as the replica reported it
    assert status == 503
    status, document = error(turn(gateway, hello, "nope"))
    assert status == 404 and document["error"]["code"] == "model_not_found"
    assert "smollm2" in document["error"]["message"]
    gateway.set_replicas(ENDPOINTS)  # back, not heard from yet: it may serve anything
    assert routed(gateway, hello, "tiny").decision.replica == "llm-2"
