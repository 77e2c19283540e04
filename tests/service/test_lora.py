"""LoRA adapters, decided by the gateway without gRPC: a request's adapter configuration is part of
its conversation's key, of its prefix blocks and of the histories a branch may prove; which
replicas may serve it is still its model's; a malformed ``lora`` gets 400 in OpenAI's shape."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from extproc.service.bodies import BadRequest, parse_request, request_blocks
from extproc.service.dataplanes.own_envoy import OWN_ENVOY
from extproc.service.lifecycle import Pending
from tests.service.test_fleet_models import CHAT, error, fleet
from tests.service.test_gateway_lifecycle import ENDPOINTS, TIMINGS, logged

A = [{"id": 0, "scale": 1.0}]
B = [{"id": 1, "scale": 0.5}]


def ask(gateway: Any, messages: list[dict[str, str]], lora: Any, session: str = "c-1") -> Pending | bytes:
    body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 8}
    if lora is not None:
        body["lora"] = lora
    answer, routed = gateway.route_request(
        shape=OWN_ENVOY,
        path=CHAT, content_type="application/json", session_headers={"x-conversation-id": session}, turn="",
        request_id="", body=orjson.dumps(body))
    return logged(gateway, answer, routed)


def routed(gateway: Any, messages: list[dict[str, str]], lora: Any, session: str = "c-1") -> Pending:
    pending = ask(gateway, messages, lora, session)
    assert isinstance(pending, Pending), pending
    return pending


def parsed_lora(lora: Any) -> str:
    return parse_request(CHAT, "", orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "lora": lora})).lora


def test_equal_configurations_spelt_differently_are_one_and_none_is_the_servers_own() -> None:
    spelt = [[{"id": 1, "scale": 0.5}, {"id": 0, "scale": 1}],
             [{"id": 0, "scale": 1.0}, {"id": 2, "scale": 0}, {"id": 1, "scale": 0.5}],
             [{"id": 1, "scale": 3}, {"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}]]
    assert {parsed_lora(lora) for lora in spelt} == {"lora:0=1.0,1=0.5"}
    assert parsed_lora(None) == parsed_lora([]) == ""
    assert parsed_lora([{"id": 0, "scale": 0}]) == "lora:none"


@pytest.mark.parametrize(("lora", "param"), [
    ({"id": 0, "scale": 1}, "lora"),
    ("0", "lora"),
    ([0], "lora[0]"),
    ([{"scale": 1}], "lora[0].id"),
    ([{"id": "0", "scale": 1}], "lora[0].id"),
    ([{"id": True, "scale": 1}], "lora[0].id"),
    ([{"id": -1, "scale": 1}], "lora[0].id"),
    ([{"id": 1.0, "scale": 1}], "lora[0].id"),
    ([{"id": 0}], "lora[0].scale"),
    ([{"id": 0, "scale": "1"}], "lora[0].scale"),
    ([{"id": 0, "scale": False}], "lora[0].scale"),
    ([{"id": 0, "scale": 1}, {"id": 1, "scale": 1e39}], "lora"),
])
def test_a_malformed_lora_gets_400_in_openais_shape_naming_the_field(lora: Any, param: str) -> None:
    with pytest.raises(BadRequest) as raised:
        parsed_lora(lora)
    assert (raised.value.status, raised.value.param) == (400, param)
    status, document = error(ask(fleet({name: ("tiny",) for name in ENDPOINTS}), [{"role": "user", "content": "x"}],
                                 lora))
    assert status == 400 and document["error"]["param"] == param
    assert document["error"]["type"] == "invalid_request_error" and "lora" in document["error"]["message"]


def test_one_conversation_under_two_adapters_is_two_each_continuing_its_own() -> None:
    gateway = fleet({name: ("tiny",) for name in ENDPOINTS})
    messages = [{"role": "user", "content": "hello " * 50}]
    first = {"a": routed(gateway, messages, A), "b": routed(gateway, messages, B)}
    plain = routed(gateway, messages, None)
    keys = {first["a"].request.conversation, first["b"].request.conversation, plain.request.conversation}
    assert len(keys) == 3 and "lora:0=1.0" in first["a"].request.conversation
    for turn in range(2):
        messages = [*messages, {"role": "assistant", "content": f"answer {turn}"},
                    {"role": "user", "content": f"more {turn}"}]
        for name, lora in (("a", A), ("b", B)):
            again = routed(gateway, messages, lora)
            assert again.continued and again.request.conversation == first[name].request.conversation
            assert again.decision.replica == first[name].decision.replica
            assert (again.model, again.lora) == ("tiny", first[name].lora)


def test_the_adapter_key_stays_under_the_continuation_rule() -> None:
    """A stranger naming the chat's id with its adapters but another history continues nothing."""
    gateway = fleet({name: ("tiny",) for name in ENDPOINTS})
    chat = [{"role": "user", "content": "my own question " * 20}]
    owner = routed(gateway, chat, A)
    stranger = routed(gateway, [{"role": "user", "content": "something else"}], [{"id": 0, "scale": 1}])
    assert not stranger.continued and stranger.request.conversation != owner.request.conversation


def test_an_adapter_configuration_seeds_its_own_prefix_blocks_and_logs_its_name() -> None:
    text = {"model": "tiny", "messages": [{"role": "user", "content": "the same long prompt " * 20}]}
    blocks = {name: request_blocks(CHAT, orjson.dumps({**text, "lora": lora}))
              for name, lora in (("a", A), ("b", B), ("none", None), ("a again", [*A, {"id": 3, "scale": 0}]))}
    assert not set(blocks["a"]) & set(blocks["b"]) and not set(blocks["a"]) & set(blocks["none"])
    assert blocks["a"] == blocks["a again"]
    assert parse_request(CHAT, "", orjson.dumps({**text, "lora": A}), block_chars=64).prefix_blocks == blocks["a"]
    gateway = fleet({name: ("tiny",) for name in ENDPOINTS})
    logged: list[dict[str, Any]] = []
    gateway.decision_log = logged.append
    routed(gateway, text["messages"], B)
    assert logged[-1]["model"] == "tiny" and logged[-1]["lora"] == "lora:1=0.5"
    assert logged[-1]["conversation"] == "tiny\x1flora:1=0.5\x1fc-1"


def test_a_request_knows_the_replicas_running_another_configuration_until_they_end() -> None:
    gateway = fleet({name: ("tiny",) for name in ENDPOINTS})

    def send(lora: Any, session: str) -> Pending:
        body = {"model": "tiny", "messages": [{"role": "user", "content": session * 20}], "max_tokens": 8, "lora": lora}
        _, routed_id = gateway.route_request(shape=OWN_ENVOY, path=CHAT, content_type="application/json",
                                             session_headers={"x-conversation-id": session}, turn="", request_id="",
                                             body=orjson.dumps(body))
        assert routed_id is not None
        return gateway.requests.pending[routed_id]

    running = send(A, "first")
    beside = send(A, "second")
    other = send(B, "third")
    assert beside.request.unbatched == frozenset()
    assert other.request.unbatched == {running.decision.replica, beside.decision.replica}
    for pending in (running, beside):
        gateway.requests.access_logged(pending.request.request_id, 200, pending.endpoint, cut_off=False,
                                       timings=TIMINGS)
    assert send(B, "fourth").request.unbatched == frozenset()  # only its own configuration runs now
