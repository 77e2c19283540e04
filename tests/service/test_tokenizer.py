"""The token counters (service.tokenizer): the model's own tokenizer read from its GGUF file,
counting only what a turn adds, against the same vocabulary encoding each prompt whole; the
characters / 4 fallback; the gateway's predictions built on the counts. Against a real
replica's /tokenize: test_tokenizer_llama.py."""

from __future__ import annotations

import asyncio
import functools
import pickle
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer

from extproc.routing import Router
from extproc.routing.tokens import CharCounter, Message, shared_opening
from extproc.service import admin_pb2
from extproc.service.admin import AdminService
from extproc.service.dataplanes.own_envoy import OWN_ENVOY
from extproc.service.gateway import Gateway
from extproc.service.metrics import Metrics
from extproc.service.tokenizer import CHARS, GgufTokenizer, TokenizerError, _compile_template, make_counter
from extproc.stack.models import smollm2_gguf
from tests.service.test_gateway_lifecycle import ENDPOINTS, SETTINGS, TIMINGS

CHAT = "/v1/chat/completions"


@functools.cache
def smollm2() -> GgufTokenizer:
    return GgufTokenizer.load(smollm2_gguf())


@functools.cache
def whole_prompt_encoder() -> Tokenizer:
    """The same vocabulary, its special tokens registered with the tokenizers package itself:
    every prompt encoded whole, nothing remembered between calls."""
    counter = smollm2()
    encoder = Tokenizer.from_str(counter._encoder.to_str())
    encoder.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in counter._special_ids])
    return encoder


def whole(text: str) -> int:
    return len(whole_prompt_encoder().encode(text, add_special_tokens=False).ids)


specials = st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
text = st.text(st.characters(exclude_categories=["Cs"]), max_size=60) | st.builds(
    lambda a, s, b: a + s + b, st.text(max_size=20), specials, st.text(max_size=20))
turn = st.tuples(st.sampled_from(["user", "tool"]), text, text)  # (role, question, answer)


@given(system=st.none() | text, turns=st.lists(turn, min_size=1, max_size=5))
def test_counting_what_each_turn_adds_equals_counting_the_whole_prompt(
    system: str | None, turns: list[tuple[str, str, str]]
) -> None:
    """BPE never merges across a special token, so a prompt is the sum of its pieces between
    them: a conversation counted turn by turn (earlier pieces remembered) gives, at every turn,
    what encoding the whole rendered prompt gives."""
    counter = smollm2()
    messages: list[Message] = [] if system is None else [("system", system)]
    for role, question, answer in turns:
        messages.append((role, question))
        counted = counter.count_chat(messages)
        rendered = counter.render(messages)
        assert counted.prompt == max(1, whole(rendered))
        assert counted.opening == tuple(whole_prompt_encoder().encode(rendered).ids[:64])
        messages.append(("assistant", answer))
    follow_up = [*messages, ("user", "and then?")]
    rendered, answer = counter.render(follow_up), turns[-1][2]
    through_answer = rendered[: rendered.rfind(answer) + len(answer)] if answer else ""
    assert counter.count_chat(follow_up).answered == (max(1, whole(through_answer)) if answer else 0)


def test_the_chat_template_is_the_models_own() -> None:
    counter = smollm2()
    assert counter.render([("user", "Hi")]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = counter.render([("system", "Be terse."), ("user", "Hi")])
    assert with_system.startswith("<|im_start|>system\nBe terse.<|im_end|>")


def test_a_tokenizer_sent_to_the_body_worker_counts_the_same() -> None:
    counter = smollm2()
    restored = pickle.loads(pickle.dumps(counter))
    messages = [("system", "Session 1a2b.\n\nYou answer in French."), ("user", "Où est la gare ? 1234 ⅷ")]
    assert restored.count_chat(messages) == counter.count_chat(messages)
    assert restored.name == counter.name == "gguf:" + smollm2_gguf().name


def test_characters_are_the_fallback_and_ignore_the_template() -> None:
    counter = make_counter(CHARS, 4.0)
    assert isinstance(counter, CharCounter) and counter.name == "chars/4"
    counted = counter.count_chat([("user", "x" * 10), ("assistant", "y" * 6), ("user", "z" * 3)])
    assert counted == (5, 4, ())  # ceil(19 / 4), ceil(16 / 4), no token ids
    assert counter.count_text("") == 1


def test_a_file_that_is_no_model_is_refused_with_its_name(tmp_path: Path) -> None:
    missing = tmp_path / "missing.gguf"
    with pytest.raises(TokenizerError, match="missing.gguf: no such file"):
        make_counter(str(missing), 4.0)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(TokenizerError, match="junk.gguf: not a GGUF file"):
        make_counter(str(junk), 4.0)


def test_the_shared_opening_is_the_longest_common_run_of_tokens() -> None:
    assert shared_opening((1, 2, 3, 4), [(1, 2, 9), (1, 2, 3, 8), ()]) == 3
    assert shared_opening((1, 2), []) == 0


# ------------------------------------------------------------------ the gateway's predictions


def counting_gateway() -> Gateway:
    gateway = Gateway(Router(SETTINGS.routing), SETTINGS.service, Metrics(), counter=smollm2())
    gateway.set_replicas(ENDPOINTS)
    return gateway


def route(gateway: Gateway, messages: list[dict[str, str]], conversation: str) -> tuple[str, Any]:
    gateway.route_request(shape=OWN_ENVOY, path=CHAT, content_type="application/json",
                          session_headers={"x-conversation-id": conversation}, turn="", request_id=conversation,
                          body=orjson.dumps({"messages": messages, "max_tokens": 8}))
    ours = next(reversed(gateway.requests.pending))
    return ours, gateway.requests.pending[ours]


def test_a_follow_up_is_predicted_to_find_the_previous_prompt_and_answer() -> None:
    gateway = counting_gateway()
    first = [{"role": "system", "content": "Session 1a2b3c4d."}, {"role": "user", "content": "Name a planet."}]
    request_id, pending = route(gateway, first, "c-1")
    assert pending.request.prompt_tokens == smollm2().count_chat([(m["role"], m["content"]) for m in first]).prompt
    gateway.requests.access_logged(request_id, 200, pending.endpoint, cut_off=False, timings=TIMINGS)
    answer = "Mars, the fourth planet from the Sun, is red."
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Another?"}]
    _, follow_up = route(gateway, second, "c-1")
    counted = smollm2().count_chat([(m["role"], m["content"]) for m in second])
    # measured on llama.cpp: cache_n = the tokens through the answer's end but its last one
    assert follow_up.predicted_cached_tokens == counted.answered - 1
    assert follow_up.decision.replica == pending.decision.replica
    assert follow_up.request.prompt_tokens == counted.prompt > counted.answered


def test_a_new_conversation_is_predicted_to_find_the_opening_it_shares_while_a_filled_slot_is_idle() -> None:
    gateway = counting_gateway()
    system = {"role": "system", "content": "Session 1a2b3c4d.\n\nYou answer briefly."}
    request_id, pending = route(gateway, [system, {"role": "user", "content": "Why is the sky blue?"}], "c-1")
    assert pending.predicted_cached_tokens == 0  # nothing was sent there before
    gateway.requests.access_logged(request_id, 200, pending.endpoint, cut_off=False, timings=TIMINGS)
    replica = pending.decision.replica
    shared = smollm2().count_text("<|im_start|>system\nSession 1a2b3c4d.\n\nYou answer")
    for conversation in (f"c-{n}" for n in range(2, 40)):  # a second conversation landing on the same replica
        _, other = route(gateway, [system, {"role": "user", "content": f"{conversation}: tell me more."}],
                         conversation)
        if other.decision.replica == replica:
            assert other.predicted_cached_tokens >= shared - 1
            break
    else:
        pytest.fail("no new conversation went to the first one's replica")
    asyncio.run(AdminService(gateway).Reset(admin_pb2.ResetRequest(), None))  # type: ignore[arg-type]
    assert not gateway.conversations.openings  # a reset starts on emptied caches (a run restarts its replicas first)


def test_the_templates_loop_object_is_read_as_the_plain_sandbox_reads_it() -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    source = ("{% for m in messages %}[{{ loop.first }} {{ loop.last }} {{ loop.index0 }} {{ loop.cycle('a', 'b') }} "
              "{{ loop.length }} {{ loop.missing }} {{ loop._length }} {{ loop.__class__ }}]{% endfor %}")
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
    rendered = _compile_template("test", source).render(messages=[1, 2, 3])
    assert rendered == plain.render(messages=[1, 2, 3])
    assert rendered.startswith("[True False 0 a 3   ][False")  # missing and private: empty, as in the sandbox


def test_a_conversation_sent_again_after_a_reset_is_routed_under_its_own_key() -> None:
    """An experiment's runs send the same conversations one after another; after the reset
    between them a conversation's first turn is new again, on its ring home, not a branch of
    the last run's history under another key."""
    gateway = counting_gateway()
    first = [{"role": "user", "content": "Name a planet."}]
    request_id, opening = route(gateway, first, "c-1")
    gateway.requests.access_logged(request_id, 200, opening.endpoint, cut_off=False, timings=TIMINGS)
    follow_up = [*first, {"role": "assistant", "content": "Venus."}, {"role": "user", "content": "Another?"}]
    request_id, pending = route(gateway, follow_up, "c-1")
    gateway.requests.access_logged(request_id, 200, pending.endpoint, cut_off=False, timings=TIMINGS)
    asyncio.run(AdminService(gateway).Reset(admin_pb2.ResetRequest(), None))  # type: ignore[arg-type]
    _, again = route(gateway, first, "c-1")
    assert again.request.conversation == opening.request.conversation
    assert again.request.key == gateway.router.conversation_key(opening.request.conversation)
