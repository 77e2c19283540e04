"""How the router counts a prompt's tokens: one seam, two kinds of counter.

The router sees text, not tokens. What it predicts cached and what it charges a replica are
in the replica's own tokens only when it counts them as the replica does: its tokenizer over
the prompt that its chat template renders. ``TokenCounter`` is that seam; the core knows only
the Protocol. ``CharCounter`` (characters / chars_per_token, the chat template ignored) is the
fallback when no tokenizer is known; the model's own tokenizer lives at the edge
(extproc/service/tokenizer.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, Protocol

Message = tuple[str, str]  # (role, text) of one chat message
OPENING_TOKENS = 64  # token ids of a prompt's opening kept to find what a replica shares with it


class ChatCount(NamedTuple):
    prompt: int  # tokens of the whole prompt (at least 1)
    answered: int  # tokens up to the end of the last assistant message (0: none): what the
    # replica that wrote that answer holds of this prompt
    opening: tuple[int, ...]  # the prompt's first OPENING_TOKENS token ids (() when unknown)


class TokenCounter(Protocol):
    """Tokens of a prompt as the replica counts them."""

    @property
    def name(self) -> str:
        """Which counter this is (start-up log, metrics label, Admin state)."""
        ...

    def count_text(self, text: str) -> int:
        """Tokens of a completion prompt given as text (at least 1)."""
        ...

    def count_chat(self, messages: Sequence[Message]) -> ChatCount:
        """The prompt a chat body becomes: its messages through the chat template, with the
        opening of the assistant's answer."""
        ...


def estimate_tokens(chars: int, chars_per_token: float) -> int:
    """Tokens in a text of ``chars`` characters (at least 1: an empty prompt still costs a step)."""
    return max(1, math.ceil(chars / chars_per_token))


class CharCounter:
    """characters / chars_per_token: close for English with BPE vocabularies, blind to the
    chat template (a chat counts its messages' text only)."""

    def __init__(self, chars_per_token: float) -> None:
        self.chars_per_token = chars_per_token

    @property
    def name(self) -> str:
        return f"chars/{self.chars_per_token:g}"

    def count_text(self, text: str) -> int:
        return estimate_tokens(len(text), self.chars_per_token)

    def count_chat(self, messages: Sequence[Message]) -> ChatCount:
        total = answered = 0  # characters of all messages, and of those up to the last assistant message
        answer_seen = False
        for role, text in messages:
            total += len(text)
            if role == "assistant":
                answered, answer_seen = total, True
        return ChatCount(estimate_tokens(total, self.chars_per_token),
                         estimate_tokens(answered, self.chars_per_token) if answer_seen else 0, ())


def shared_opening(opening: tuple[int, ...], seen: Sequence[tuple[int, ...]]) -> int:
    """The longest run of leading tokens ``opening`` shares with one of ``seen`` (openings of
    prompts a replica served): what a new conversation finds cached there, a common chat
    template opening and system prompt."""
    best = 0
    for other in seen:
        shared = 0
        for mine, theirs in zip(opening, other, strict=False):
            if mine != theirs:
                break
            shared += 1
        best = max(best, shared)
    return best
