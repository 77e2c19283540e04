"""A restore is checked in its slot and tried again in another idle slot when a request took the
first one; a llama.cpp replica stood in for by a small model of its slots (the live tests run
the real one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from extproc.migration.llama import LlamaServer, Slot
from extproc.migration.migrate import _idle_slots, _restore_all
from extproc.migration.planner import Move

TOKENS = {1: list(range(100, 180)), 2: list(range(200, 260))}


@dataclass
class Replica:
    """Slots holding token lists; `steal` names slots that a new request takes right after a restore."""

    held_tokens: dict[int, list[int]] = field(default_factory=lambda: {0: [], 1: [], 2: [9, 9, 9]})
    steal: set[int] = field(default_factory=set)

    def restore(self, slot: int, filename: str) -> dict[str, int]:
        key = int(filename.split(".")[0])
        self.held_tokens[slot] = [] if slot in self.steal else list(TOKENS[key])
        self.steal.discard(slot)
        return {"n_restored": len(TOKENS[key])}

    def held(self, tokens: list[int]) -> tuple[int, int]:
        """As llama.cpp picks a slot for an unpinned request: the one sharing the most of it."""
        def common(held: list[int]) -> int:
            return next((i for i, (a, b) in enumerate(zip(held, tokens, strict=False)) if a != b),
                        min(len(held), len(tokens)))
        slot = max(self.held_tokens, key=lambda s: common(self.held_tokens[s]))
        return slot, max(0, min(common(self.held_tokens[slot]), len(tokens) - 1))

    def slots(self) -> list[Slot]:
        return [Slot(i, len(t), False, -1) for i, t in sorted(self.held_tokens.items())]


FILES = {key: (f"{key}.bin", len(tokens)) for key, tokens in TOKENS.items()}  # as delivered to the receiver


def moves_to(receiver: str) -> list[Move]:
    return [Move(key, 0, receiver, len(tokens), 0, 1.0) for key, tokens in TOKENS.items()]


def run(replica: Replica) -> list[str | None]:
    server = cast(LlamaServer, replica)
    return _restore_all(moves_to("r"), {"r": server}, {"r": _idle_slots(server)}, FILES, TOKENS)


def test_each_restore_lands_in_its_own_slot_and_is_found_there() -> None:
    replica = Replica()
    assert run(replica) == [None, None]
    assert sorted(map(tuple, replica.held_tokens.values())) == sorted([tuple(TOKENS[1]), tuple(TOKENS[2]), (9, 9, 9)])


def test_a_slot_taken_after_the_restore_is_tried_again_in_another_idle_slot() -> None:
    replica = Replica(steal={0})
    assert run(replica) == [None, None]
    assert replica.held_tokens[0] == []  # taken
    assert replica.held_tokens[1] == TOKENS[2] and replica.held_tokens[2] == TOKENS[1]  # not over the other move


def test_a_restore_that_finds_no_other_slot_is_a_miss_that_says_so() -> None:
    replica = Replica(held_tokens={0: [], 1: []}, steal={0})
    results = run(replica)
    assert results[1] is None and results[0] is not None
    assert "0 of 80 tokens found after the restore" in results[0] and "no other idle slot" in results[0]
