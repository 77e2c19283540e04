"""The model's own tokenizer against a real llama.cpp replica (xllamacpp + SmolLM2-135M): the
same token ids as its POST /tokenize on varied text, the same rendered prompt as its POST
/apply-template, the prompt size its timings report for a first turn, and what a follow-up
finds cached (the previous prompt and answer but the answer's last token)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from extproc.service.tokenizer import GgufTokenizer
from extproc.stack.models import smollm2_gguf
from tests.service.gateway_support import llama_replicas

pytestmark = pytest.mark.live

TEXTS = [
    "Hello world",
    "  leading spaces, trailing spaces  ",
    "Numbers 1234567 and 3.14159, a date 2026-12-02, ⅷ and ²",
    "Ünïcödé café naïve — an em dash… 日本語のテキスト 한국어 emoji 🙂🚀",
    "code:\n\tdef f(x):\n\t\treturn x**2  # a comment\n\n\n",
    "it's they're we've I'm you'll he'd DON'T",
    "<|im_start|>user\nspecial tokens inside a text<|im_end|>\n",
    "\r\n\r\nwindows line ends\r\n",
    "$$$ ### !!! ??? ... ,,, ((( ))) {json: [1, 2]}",
    "a" * 300,
]


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A client of one replica, its API key among its headers."""
    with llama_replicas(tmp_path_factory.mktemp("replicas")) as replicas, \
            httpx.Client(base_url=f"http://{replicas.addresses['llm-0']}", headers=replicas.headers) as client:
        yield client


@pytest.fixture(scope="module")
def counter() -> GgufTokenizer:
    return GgufTokenizer.load(smollm2_gguf())


def test_token_ids_are_the_replicas_own(replica: httpx.Client, counter: GgufTokenizer) -> None:
    for text in TEXTS:
        answer = replica.post("/tokenize", json={"content": text, "add_special": True, "parse_special": True})
        expected = answer.raise_for_status().json()["tokens"]
        assert list(counter.encode(text)) == expected, text
        assert counter.count_text(text) == len(expected), text


def test_a_first_turn_counts_the_prompt_the_replica_reports(replica: httpx.Client, counter: GgufTokenizer) -> None:
    for messages in ([("user", "Hi there, how are you?")],
                     [("system", "Session ab12cd34.\n\nYou are terse."), ("user", "What is 2+2?")]):
        body = [{"role": role, "content": text} for role, text in messages]
        rendered = replica.post("/apply-template", json={"messages": body}).raise_for_status().json()
        assert rendered["prompt"] == counter.render(messages)
        answer = replica.post("/v1/chat/completions", timeout=60,
                              json={"messages": body, "max_tokens": 1, "cache_prompt": False}).raise_for_status()
        timings = answer.json()["timings"]
        assert counter.count_chat(messages).prompt == timings["cache_n"] + timings["prompt_n"]


def test_a_follow_up_finds_the_previous_prompt_and_answer_cached(replica: httpx.Client,
                                                                 counter: GgufTokenizer) -> None:
    messages = [("system", "Session 9f8e7d6c."), ("user", "Tell me about the moon.")]
    for _ in range(2):
        body = {"messages": [{"role": role, "content": text} for role, text in messages], "max_tokens": 8,
                "ignore_eos": True, "cache_prompt": True}
        answer = replica.post("/v1/chat/completions", json=body, timeout=60).raise_for_status().json()
        messages += [("assistant", answer["choices"][0]["message"]["content"]), ("user", "And then?")]
    counted = counter.count_chat(messages)
    body = {"messages": [{"role": role, "content": text} for role, text in messages], "max_tokens": 1,
            "cache_prompt": True}
    timings = replica.post("/v1/chat/completions", json=body, timeout=60).raise_for_status().json()["timings"]
    assert timings["cache_n"] == counted.answered - 1
    assert timings["cache_n"] + timings["prompt_n"] == counted.prompt
