"""The conversation generator: the same traffic for every policy, from a seed.

Pure and deterministic: ``generate_conversations(profile, seed)`` returns the same
conversations in every process and whichever policy runs. Each conversation draws
from its own RNG stream (seeded by ``seed`` and its index), so changing one
conversation's length never shifts the text of the others, and Locust users that
pick conversations in any order still send identical messages.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from extproc.routing.tokens import estimate_tokens
from extproc.traffic.profile import Profile, ProfileError
from extproc.traffic.words import paragraphs, sentence

# Chat-template tokens around each message (ChatML: <|im_start|>role\n ... <|im_end|>\n).
TEMPLATE_TOKENS_PER_MESSAGE = 5


@dataclass(frozen=True)
class Turn:
    text: str  # the user message
    think_time_s: float  # pause before sending it
    max_tokens: int  # answer length requested (with ignore_eos)
    est_prompt_tokens: int  # estimated prompt of this turn: whole history, answers at max_tokens


@dataclass(frozen=True)
class Conversation:
    id: str  # sent as x-conversation-id; includes the seed so seeds place conversations differently
    index: int
    seed: int
    has_document: bool
    turns: tuple[Turn, ...]


def generate_conversations(profile: Profile, seed: int) -> list[Conversation]:
    return [generate_conversation(profile, seed, index) for index in range(profile.conversations)]


def generate_conversation(profile: Profile, seed: int, index: int) -> Conversation:
    rng = random.Random(_stream_seed(seed, index))
    has_document = rng.random() < profile.doc_share
    wanted_turns = rng.randint(*profile.turns)
    turns: list[Turn] = []
    history_chars = 0
    for number in range(wanted_turns):
        text = _message(rng, profile, with_document=has_document and number == 0)
        think = round(rng.uniform(*profile.think_time_s), 3)
        history_chars += len(text)
        est = _estimate_prompt(profile, history_chars, number + 1)
        if est + profile.max_tokens > profile.max_context_tokens:
            # The conversation ends here, as a chat client would when the context is full.
            if number == 0:
                raise ProfileError(
                    f"profile {profile.name}: a first turn of ~{est} tokens does not fit in "
                    f"max_context_tokens={profile.max_context_tokens}; lower doc_words/user_words"
                )
            break
        turns.append(Turn(text=text, think_time_s=think, max_tokens=profile.max_tokens, est_prompt_tokens=est))
    return Conversation(
        id=f"s{seed}-c{index:05d}",
        index=index,
        seed=seed,
        has_document=has_document,
        turns=tuple(turns),
    )


def _stream_seed(seed: int, index: int) -> int:
    # A stable hash (not Python's salted hash()) so every process derives the same stream.
    digest = hashlib.blake2b(f"llm-ring:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _message(rng: random.Random, profile: Profile, with_document: bool) -> str:
    question = sentence(rng, rng.randint(*profile.user_words)).rstrip(".") + "?"
    if not with_document:
        return question
    document = paragraphs(rng, rng.randint(*profile.doc_words))
    return f"Please read this document and answer my questions.\n\n{document}\n\n{question}"


def _estimate_prompt(profile: Profile, user_chars: int, turn_number: int) -> int:
    """History tokens at turn ``turn_number``: all user text, earlier answers at max_tokens."""
    messages = 2 * turn_number - 1
    return (
        estimate_tokens(user_chars, profile.chars_per_token)
        + (turn_number - 1) * profile.max_tokens
        + messages * TEMPLATE_TOKENS_PER_MESSAGE
    )
