"""Which conversations leaving a replica are worth moving, and to which replica (pure).

A conversation is worth moving when its cache is long enough (min_tokens) and moving it costs
less than computing its prompt again on the receiver: save + transfer + restore of its bytes
against prefill of its tokens. The most recent slots go first (a larger task id: used later,
likelier to come back), the receiver is the first replica on the ring walk from the
conversation's key (the home the router's ring gives it once the leaving replica is gone) that
has a free slot, and the plan stops at the disk budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from extproc.routing.ring import HashRing


@dataclass(frozen=True)
class Costs:
    bytes_per_token: int  # of a slot file (the KV cache: layers x KV heads x (K + V) x dtype)
    prefill_seconds_per_token: float  # the receiver computing the prompt again
    transfer_bytes_per_second: float  # save + copy + restore, end to end


@dataclass(frozen=True)
class Candidate:
    conversation_key: int
    slot: int  # on the leaving replica
    tokens: int
    last_task: int  # the slot's last task id (recency)


@dataclass(frozen=True)
class Move:
    conversation_key: int
    slot: int
    receiver: str
    tokens: int
    bytes: int
    saves_seconds: float  # prefill avoided minus the transfer


def plan(candidates: Sequence[Candidate], ring: HashRing, free_slots: Mapping[str, int], costs: Costs,
         min_tokens: int, max_bytes: int) -> list[Move]:
    """The moves, in the order to make them; `ring` holds the replicas that stay."""
    left = dict(free_slots)
    budget = max_bytes
    moves = []
    for candidate in sorted(candidates, key=lambda c: (-c.last_task, -c.tokens)):
        size = candidate.tokens * costs.bytes_per_token
        saves = candidate.tokens * costs.prefill_seconds_per_token - size / costs.transfer_bytes_per_second
        if candidate.tokens < min_tokens or saves <= 0 or size > budget:
            continue
        receiver = next((name for name in ring.walk(candidate.conversation_key) if left.get(name, 0) > 0), None)
        if receiver is None:
            continue
        left[receiver] -= 1
        budget -= size
        moves.append(Move(candidate.conversation_key, candidate.slot, receiver, candidate.tokens, size, saves))
    return moves
