"""A conversation id is not a capability (pure, no I/O; docs/security.md#conversation-ids).

A client names its conversation (``x-conversation-id``), but knowing an id must not be enough
to use what the router holds for it: its placement (where its cache is, how long it is), its
predicted cached tokens, its pending requests, its entry in the store. What proves a request
belongs to the conversation is its body: a next turn resends the earlier turns, so the history
digest of a request of the conversation it continues is among the digests of the new body's
prefixes (bodies.py: ``answered``, plus the body's own ``history`` for a retry).

Each router remembers (conversations.py), per conversation key, the digests of its *tips*: its
completed requests that no later completed one shows (``tips_after``). One turn after another leaves one tip; an
agent's fan-out (requests sent at once on the same history) leaves one per branch, and the
conversation goes on from any of them. They sit next to placement memory and are bounded the
same way (lru.py), at most ``TIPS`` a conversation. ``claim`` decides:
  - the conversation is unknown here (and in the store): the request opens it;
  - the body shows one of its known digests (a tip, or the store's last): the request
    continues it (and may use it all);
  - otherwise the request is routed as a new conversation under a key derived from the id and
    the body's opening (``unclaimed``): it finds nothing of the conversation and its completion
    cannot overwrite the conversation's placement. Its own next turns continue that derived
    conversation (an edited chat goes on there), by the same rule: a body that continues
    neither the id's conversation nor the derived one (a stranger after an edit, a second
    edit) gets a key of its own history (``owned``), where it finds only what it sends.
A completion body (no chat history) has one digest: its opening's.

A conversation lives under its model (``of_model``): the same id or opening sent to two models
names two conversations, whose caches are on different replicas; a completed request proves its
history to a branch under the same model alone (``model_point``). With LoRA adapters, "model" in
both is the request's cache scope: its model under its adapter configuration (adapters.scope).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import xxhash

TIPS = 8  # a conversation's branches remembered at once: a wider fan-out forgets its oldest
SEPARATOR = "\x1f"  # cannot occur in an id (a header's, or a body's: printable) nor in an opening key


class Shown(NamedTuple):
    """What a body proves about its history."""

    digest: int  # the digest a later turn continuing this request will show
    prefixes: frozenset[int]  # the digests of its earlier requests it shows (its own included)


class Claim(NamedTuple):
    conversation: str  # the key the request is routed under
    continues: bool  # it continues a conversation known here (or in the store)
    foreign: bool  # it named a conversation it does not continue: routed as a new one


def shown(history: int, answered: frozenset[int], opening_key: str) -> Shown:
    """A chat body's history digests, or a completion body's opening digest."""
    if history:
        return Shown(history, answered | {history})
    digest = xxhash.xxh64_intdigest(opening_key.encode())
    return Shown(digest, frozenset((digest,)))


def claim(conversation: str, opening_key: str, known: Callable[[str], tuple[int, ...]], body: Shown) -> Claim:
    """The first key one of whose known digests ``body`` shows, or of which nothing is known: the
    id named, then ``unclaimed``; else the body's ``owned`` key. ``known(key)``: the digests held
    for ``key`` (this router's tips, the store's; may be empty)."""
    foreign = False
    for key in (conversation, unclaimed(conversation, opening_key)):
        held = known(key)
        if not held:
            return Claim(key, False, foreign)
        if any(digest in body.prefixes for digest in held):
            return Claim(key, True, foreign)
        foreign = True
    return Claim(owned(conversation, opening_key, body.digest), False, True)


def tips_after(held: tuple[int, ...], completed: Shown) -> tuple[int, ...]:
    """A conversation's tips once a request showing ``completed`` is done: the ones it shows are
    behind it, its own digest is the newest (the oldest forgotten beyond ``TIPS``)."""
    kept = tuple(digest for digest in held if digest not in completed.prefixes)
    return (*kept, completed.digest)[-TIPS:]


def unclaimed(conversation: str, opening_key: str) -> str:
    """The key of a request that names ``conversation`` without continuing it: its own, stable
    over its own turns (same opening), never equal to a header's id."""
    return f"{conversation}{SEPARATOR}{opening_key}"


def owned(conversation: str, opening_key: str, digest: int) -> str:
    """The key of a body that continues neither ``conversation`` nor its ``unclaimed`` key: its
    history's own (the same body sent again shares it, nothing else does)."""
    return f"{unclaimed(conversation, opening_key)}{SEPARATOR}{digest:x}"


def of_model(model: str, conversation: str) -> str:
    """The key of ``conversation`` under ``model`` (the conversation itself when none is named)."""
    return f"{model}{SEPARATOR}{conversation}" if model else conversation


def model_point(digest: int, model: str) -> int:
    """A completed request's history digest under its model: where a branch of it, under the
    same model, finds its prefix (the digest itself when no model is named)."""
    return xxhash.xxh64_intdigest(model.encode(), seed=digest) if model else digest
