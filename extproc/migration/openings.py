"""A slot's text back to the router's opening key (extproc/service/bodies.py: xxh64 over
``role\\0text\\0`` of the messages up to and including the first user message).

A slot holds the prompt as the server's chat template rendered it. The template's framing is
learnt from the server itself (/apply-template on sentinel messages), so no template is
written down here: the text before a user-only opening (which includes a default system
prompt the template adds), the text before a system message, between it and the user's,
and after the user's message. An opening of more than one system message is not recovered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import xxhash

SYSTEM, USER, ANSWER = "\x07S\x07", "\x07U\x07", "\x07A\x07"
HEAD_SLACK = 16  # characters a detokenized slot may carry before the template's text (a BOS)


@dataclass(frozen=True)
class Framing:
    user_head: str  # before the user's text when the opening is a user message alone
    system_head: str  # before a system message's text
    system_to_user: str  # after it, before the user's text
    user_end: str  # after the user's text, before the answer

    @classmethod
    def learn(cls, render: Callable[[list[dict[str, str]]], str]) -> Framing:
        alone = render([{"role": "user", "content": USER}])
        with_system = render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}])
        answered = render([{"role": "user", "content": USER}, {"role": "assistant", "content": ANSWER}])
        head, after = with_system.split(SYSTEM, 1)
        return cls(alone.split(USER, 1)[0], head, after.split(USER, 1)[0],
                   answered.split(USER, 1)[1].split(ANSWER, 1)[0])


def opening_key(messages: list[tuple[str, str]]) -> str:
    """What bodies.py computes for an opening of these (role, text) messages."""
    hasher = xxhash.xxh64()
    for role, text in messages:
        hasher.update(f"{role}\x00{text}\x00".encode())
    return "h:" + hasher.hexdigest()


def opening_keys(text: str, framing: Framing) -> set[str]:
    """The opening keys `text` (a slot's prompt) may have: a user message alone, or a system
    message and a user message; empty when the text is not the template's."""
    keys = set()
    user = _between(text, framing.user_head, framing.user_end)
    if user is not None:
        keys.add(opening_key([("user", user)]))
    at = text.find(framing.system_head, 0, HEAD_SLACK + len(framing.system_head))
    if at >= 0:
        rest = text[at + len(framing.system_head):]
        system, separator, after = rest.partition(framing.system_to_user)
        end = after.find(framing.user_end)
        if separator and end >= 0:
            keys.add(opening_key([("system", system), ("user", after[:end])]))
    return keys


def _between(text: str, head: str, end: str) -> str | None:
    at = text.find(head, 0, HEAD_SLACK + len(head))
    if at < 0:
        return None
    start = at + len(head)
    stop = text.find(end, start)
    return text[start:stop] if stop >= 0 else None
