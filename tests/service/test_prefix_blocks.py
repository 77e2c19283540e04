"""Prefix blocks from request bodies, and the gateway hashing them only for policies that need them."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import extproc.routing.blocks as blocks_module
from extproc.routing import Router
from extproc.routing.blocks import BLOCK_CHARS, BlockMemory, model_seed, prefix_blocks
from extproc.routing.policies.llm_aware import INDEX_BLOCK_CHARS
from extproc.routing.settings import with_knobs
from extproc.service.bodies import parse_request, request_blocks
from extproc.service.dataplanes.own_envoy import OWN_ENVOY
from extproc.service.gateway import Gateway
from extproc.service.metrics import Metrics
from extproc.settings import load_settings, parse_routing

SETTINGS = load_settings(Path(__file__).parents[2] / "extproc" / "service" / "router.toml")
CHAT = "/v1/chat/completions"


def chat(*messages: tuple[str, str]) -> bytes:
    return orjson.dumps({"messages": [{"role": role, "content": text} for role, text in messages]})


def test_a_later_turn_begins_with_the_earlier_turns_whole_blocks() -> None:
    first = [("system", "You answer in French. " * 9), ("user", "What is a radix tree? " * 5)]
    later = [*first, ("assistant", "Un arbre radix est ... " * 7), ("user", "And a trie?")]
    earlier, now = request_blocks(CHAT, chat(*first)), request_blocks(CHAT, chat(*later))
    rendered = sum(len(role) + len(text) + 2 for role, text in first)
    whole = rendered // BLOCK_CHARS
    assert whole >= 3 and now[:whole] == earlier[:whole] and len(now) > len(earlier)
    assert request_blocks(CHAT, chat(("system", "Tu réponds en anglais."), *first[1:]))[0] != earlier[0]


def test_completion_prompts_as_text_or_token_ids() -> None:
    text = "Once upon a time " * 10
    assert request_blocks("/completion", orjson.dumps({"prompt": text})) == prefix_blocks(text)
    ids = request_blocks("/v1/completions", orjson.dumps({"prompt": [1, 22, 333] * 30}))
    assert ids == prefix_blocks("1,22,333," * 30)


@pytest.mark.parametrize(("policy", "prefix_index", "block_chars"), [
    ("kv-cost", False, BLOCK_CHARS), ("radix-balance", False, BLOCK_CHARS), ("llm-aware", False, 0),
    ("llm-aware", True, INDEX_BLOCK_CHARS)])
def test_the_gateway_hashes_blocks_only_for_a_policy_that_needs_them_and_as_long_as_it_asks(
        policy: str, prefix_index: bool, block_chars: int) -> None:
    knobs = {"policy": policy, **({"prefix_index": prefix_index} if policy == "llm-aware" else {})}
    routing = parse_routing(with_knobs(SETTINGS.routing.table(), knobs))
    gateway = Gateway(Router(routing), SETTINGS.service, Metrics())
    gateway.set_replicas({"llm-0": "127.0.0.1:9000", "llm-1": "127.0.0.1:9001"})
    body = chat(("user", "hello there, " * 60))
    _, routed = gateway.route_request(shape=OWN_ENVOY,
                               path=CHAT, content_type="application/json", session_headers={}, turn="1",
                               request_id="r1", body=body)
    assert routed
    (pending,) = gateway.requests.pending.values()
    assert pending.request.prefix_blocks == (request_blocks(CHAT, body, block_chars) if block_chars else ())
    if block_chars:  # the rendered prompt: role NUL content NUL
        assert len(pending.request.prefix_blocks) == -(-len("user\x00" + "hello there, " * 60 + "\x00") // block_chars)


def test_the_blocks_come_from_the_one_parse_of_the_body() -> None:
    body = chat(("system", "tools " * 30), ("user", "hello there, " * 20))
    parsed = parse_request(CHAT, "application/json", body, block_chars=BLOCK_CHARS)
    assert parsed.prefix_blocks == request_blocks(CHAT, body)
    assert parse_request(CHAT, "application/json", body).prefix_blocks == ()


# mostly ASCII (blocks remembered), sometimes not (hashed in full)
texts = st.one_of(st.text(alphabet="ab c\x00", max_size=700), st.text(alphabet="abé", max_size=40))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["k1", "k2"]), texts, st.booleans()), min_size=1, max_size=30),
       st.sampled_from([4, 64, 256]), st.sampled_from(["", "tiny"]))
def test_remembered_blocks_are_the_blocks_however_the_texts_change(calls, block_chars: int, model: str) -> None:
    """BlockMemory hashes only a next turn's new blocks; whatever comes (a turn that resends
    the last prompt, one that changes or drops it, another chat under the same key, non-ASCII),
    its blocks are prefix_blocks', under the model's seed."""
    memory = BlockMemory(block_chars, max_blocks=20)
    last: dict[str, str] = {}
    for key, text, extends in calls:
        if extends and key in last:
            text = last[key] + text  # a next turn: the last prompt, resent, and more
        seed = model_seed(model)
        assert memory.blocks(key, text, seed) == prefix_blocks(text, block_chars, seed)
        last[key] = text
        assert memory.held() <= 20  # bounded in blocks, whatever the prompts' lengths


def test_the_gateway_hashes_a_next_turn_once_per_new_block(monkeypatch: pytest.MonkeyPatch) -> None:
    routing = parse_routing(with_knobs(SETTINGS.routing.table(), {"policy": "llm-aware", "prefix_index": True}))
    gateway = Gateway(Router(routing), SETTINGS.service, Metrics())
    gateway.set_replicas({"llm-0": "127.0.0.1:9000"})
    hashed: list[bytes] = []
    real = blocks_module.hash_bytes
    monkeypatch.setattr(blocks_module, "hash_bytes", lambda piece, seed: hashed.append(piece) or real(piece, seed))
    first = chat(("system", "tools " * 200), ("user", "hello there, " * 20))
    gateway.route_request(shape=OWN_ENVOY, path=CHAT, content_type="application/json", session_headers={}, turn="1",
                          request_id="r1", body=first)
    whole = len(hashed)
    later = chat(("system", "tools " * 200), ("user", "hello there, " * 20), ("assistant", "hi"),
                 ("user", "more " * 100))
    gateway.route_request(shape=OWN_ENVOY, path=CHAT, content_type="application/json", session_headers={}, turn="2",
                          request_id="r2", body=later)
    second = len(hashed) - whole
    before, now = request_blocks(CHAT, first, INDEX_BLOCK_CHARS), request_blocks(CHAT, later, INDEX_BLOCK_CHARS)
    assert whole == len(before) and len(now) > len(before)
    assert list(gateway.requests.pending.values())[-1].request.prefix_blocks == now
    assert second == len(now) - (len(before) - 1)  # the first turn's whole blocks were not hashed again
