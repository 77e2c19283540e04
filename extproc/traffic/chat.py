"""The chat client's pure parts: request bodies, headers, answers, record rows.

Locust (locustfiles/chat.py) does the I/O; everything it sends and records is
built here so it can be tested without a server. Every turn resends the whole
history, like a real chat client; ``ignore_eos`` with a fixed ``max_tokens`` keeps
answer lengths fixed whatever the (tiny or random-weight) model emits.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from extproc.routing.tokens import estimate_tokens

CHAT_PATH = "/v1/chat/completions"
TIMING_FIELDS = ("cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms")


def request_headers(conversation_id: str, turn_number: int) -> dict[str, str]:
    return {
        "content-type": "application/json",
        "x-conversation-id": conversation_id,
        "x-turn": str(turn_number),
    }


def session_message(session: str, system: str = "") -> dict[str, str]:
    """A first line unique to the run: no run ever finds another run's conversations cached,
    even on replicas whose caches cannot be emptied. The user messages stay identical. The
    conversation's own system prompt, if any, follows it in the same message."""
    return {"role": "system", "content": f"Session {session}.\n\n{system}" if system else f"Session {session}."}


def session_tag(run_id: str, started: float) -> str:
    """Eight hex digits naming one run (fixed length: every run's prompts have the same size)."""
    return hashlib.blake2b(f"{run_id}@{started}".encode(), digest_size=4).hexdigest()


def request_body(messages: list[dict[str, str]], max_tokens: int, stream: bool, model: str) -> dict:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,  # answers have exactly max_tokens tokens, even from junk models
        "cache_prompt": True,
        "stream": stream,
    }


def prompt_estimate(messages: list[dict[str, str]], chars_per_token: float) -> int:
    """The client's prompt estimate: message characters through the router's estimator."""
    return estimate_tokens(sum(len(m["content"]) for m in messages), chars_per_token)


@dataclass
class Answer:
    """What came back: the text (for the next turn's history) and llama.cpp's timings."""

    content: str = ""
    timings: dict[str, Any] = field(default_factory=dict)
    first_token: bool = False  # set once the first content chunk has arrived (streaming)


def read_json_answer(body: bytes) -> Answer:
    data = json.loads(body)
    message = data["choices"][0]["message"]
    return Answer(content=message.get("content") or "", timings=data.get("timings") or {})


def read_sse_line(line: bytes | str, answer: Answer) -> bool:
    """Fold one SSE line into ``answer``; True when this line carried the first token."""
    text = line.decode() if isinstance(line, bytes) else line
    if not text.startswith("data:"):
        return False
    payload = text[5:].strip()
    if not payload or payload == "[DONE]":
        return False
    data = json.loads(payload)
    if data.get("timings"):  # llama.cpp puts them on the last chunk
        answer.timings = data["timings"]
    choices = data.get("choices") or [{}]
    piece = (choices[0].get("delta") or {}).get("content")
    if not piece:
        return False
    answer.content += piece
    if answer.first_token:
        return False
    answer.first_token = True
    return True


def timing_fields(timings: dict[str, Any]) -> dict[str, Any]:
    return {name: timings.get(name) for name in TIMING_FIELDS}


def header_int(headers: Any, name: str) -> int | None:
    value = headers.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
