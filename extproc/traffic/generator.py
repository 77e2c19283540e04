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
class Side:
    """A request sent at the same moment as its turn, on the same history (an agent's fan-out);
    the conversation goes on from its turn's answer, not from this one's."""

    text: str
    est_prompt_tokens: int


@dataclass(frozen=True)
class Turn:
    text: str  # the user message (a question, or a tool result)
    think_time_s: float  # pause before sending it
    max_tokens: int  # answer length requested (with ignore_eos)
    est_prompt_tokens: int  # estimated prompt of this turn: whole history, answers at max_tokens
    parallel: tuple[Side, ...] = ()  # sent at once with this turn; the next turn waits for all


@dataclass(frozen=True)
class Conversation:
    id: str  # sent as x-conversation-id; includes the seed so seeds place conversations differently
    index: int
    seed: int
    has_document: bool
    turns: tuple[Turn, ...]
    system: str = ""  # the system prompt opening it ("" for none)

    @property
    def requests(self) -> int:
        """Requests it sends: one per turn, plus each fan-out's parallel sides."""
        return sum(1 + len(turn.parallel) for turn in self.turns)


def generate_conversations(profile: Profile, seed: int) -> list[Conversation]:
    return [generate_conversation(profile, seed, index) for index in range(profile.conversations)]


def generate_conversation(profile: Profile, seed: int, index: int) -> Conversation:
    rng = random.Random(_stream_seed(seed, index))
    has_document = rng.random() < profile.doc_share
    wanted_turns = rng.randint(*profile.turns)
    # Agent features draw from the stream only when the profile has them, so the profiles
    # without them keep their conversations exactly.
    system = paragraphs(rng, rng.randint(*profile.system_words)) if profile.system_words[1] > 0 else ""
    fan_out_at = -1
    if profile.fanout_share > 0 and rng.random() < profile.fanout_share:
        fan_out_at = rng.randrange(wanted_turns)
    turns: list[Turn] = []
    history_chars = len(system)
    for number in range(wanted_turns):
        text = _message(rng, profile, with_document=has_document and number == 0, follow_up=number > 0)
        think = round(rng.uniform(*profile.think_time_s), 3)
        est = _estimate_prompt(profile, history_chars + len(text), number + 1)
        if est + profile.max_tokens > profile.max_context_tokens:
            # The conversation ends here, as a chat client would when the context is full.
            if number == 0:
                raise ProfileError(
                    f"profile {profile.name}: a first turn of ~{est} tokens does not fit in "
                    f"max_context_tokens={profile.max_context_tokens}; lower doc_words/user_words/system_words"
                )
            break
        parallel: tuple[Side, ...] = ()
        if number == fan_out_at:
            extra = rng.randint(*profile.fanout_requests) - 1
            sides = [_message(rng, profile, with_document=False, follow_up=number > 0) for _ in range(extra)]
            parallel = tuple(Side(t, _estimate_prompt(profile, history_chars + len(t), number + 1)) for t in sides)
        history_chars += len(text)
        turns.append(Turn(text, think, profile.max_tokens, est, parallel))
    return Conversation(
        id=f"s{seed}-c{index:05d}",
        index=index,
        seed=seed,
        has_document=has_document,
        turns=tuple(turns),
        system=system,
    )


def _stream_seed(seed: int, index: int) -> int:
    # A stable hash (not Python's salted hash()) so every process derives the same stream.
    digest = hashlib.blake2b(f"llm-ring:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _message(rng: random.Random, profile: Profile, with_document: bool, follow_up: bool) -> str:
    if follow_up and profile.tool_share > 0 and rng.random() < profile.tool_share:
        # Sent as a user message: the replicas' chat template has no tool role without tool calls.
        return "Tool result: " + sentence(rng, rng.randint(*profile.tool_words))
    question = sentence(rng, rng.randint(*profile.user_words)).rstrip(".") + "?"
    if not with_document:
        return question
    document = paragraphs(rng, rng.randint(*profile.doc_words))
    return f"Please read this document and answer my questions.\n\n{document}\n\n{question}"


def _estimate_prompt(profile: Profile, user_chars: int, turn_number: int) -> int:
    """History tokens at turn ``turn_number``: all user text, earlier answers at max_tokens."""
    messages = 2 * turn_number - 1  # the system prompt shares the session's system message
    return (
        estimate_tokens(user_chars, profile.chars_per_token)
        + (turn_number - 1) * profile.max_tokens
        + messages * TEMPLATE_TOKENS_PER_MESSAGE
    )
