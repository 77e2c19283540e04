"""A conversation id is not a capability (continuation.py): a body that continues the
conversation's last request claims it, any other body is routed as a new conversation under a
key of its own; the digests are bounded."""

from __future__ import annotations

from collections.abc import Callable
from random import Random

import orjson
from hypothesis import given
from hypothesis import strategies as st

from extproc.routing.continuation import SEPARATOR, TIPS, claim, shown, tips_after, unclaimed
from extproc.service.bodies import parse_request

texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
turns = st.lists(st.tuples(texts, texts), min_size=1, max_size=6)  # (question, answer)


def body_of(system: str, turns_so_far: list[tuple[str, str]], question: str) -> tuple[int, frozenset[int], str]:
    messages = [{"role": "system", "content": system}]
    for asked, answer in turns_so_far:
        messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": question})
    parsed = parse_request("/v1/chat/completions", "application/json", orjson.dumps({"messages": messages}))
    return parsed.history, parsed.answered, parsed.opening_key


@given(texts, turns, st.integers(0, 5))
def test_every_later_turn_continues_every_earlier_one(system: str, conversation: list[tuple[str, str]],
                                                      back: int) -> None:
    """The digest a completed turn leaves is shown by every later turn of the same chat (and by
    the same body sent again)."""
    bodies = [shown(*body_of(system, conversation[:k], conversation[k][0])) for k in range(len(conversation))]
    last = len(bodies) - 1
    earlier = max(0, last - back)
    known = (bodies[earlier].digest,)
    assert claim("c-1", "", held({"c-1": known}), bodies[last]) == ("c-1", True, False)
    assert claim("c-1", "", held({"c-1": (bodies[last].digest,)}), bodies[last]).continues  # a retry


@given(texts, turns, texts, texts)
def test_a_body_without_the_last_turn_is_a_new_conversation(system: str, conversation: list[tuple[str, str]],
                                                            other_system: str, question: str) -> None:
    """A forger who knows the id but not the history gets a key of its own, stable over its own
    body, never the id itself."""
    victim = shown(*body_of(system, conversation[:-1], conversation[-1][0]))
    history, answered, opening = body_of(other_system + "\x00forged", [], question)
    forged = shown(history, answered, opening)
    result = claim("c-1", opening, held({"c-1": (victim.digest,)}), forged)
    assert result.foreign and not result.continues
    assert result.conversation != "c-1" and result.conversation.startswith("c-1" + SEPARATOR)
    assert result.conversation == claim("c-1", opening, held({"c-1": (victim.digest,)}), forged).conversation


@given(st.text(max_size=20))
def test_an_unknown_conversation_is_opened_by_any_body(opening: str) -> None:
    assert claim("c-9", opening, held({}), shown(0, frozenset(), opening)) == ("c-9", False, False)


@given(texts, st.lists(st.tuples(texts, texts), min_size=2, max_size=6), texts)
def test_a_branch_goes_on_under_its_key_and_a_stranger_after_it_gets_one_of_its_own(
    system: str, conversation: list[tuple[str, str]], question: str
) -> None:
    """A chat whose turn 2 is edited (the id's conversation not continued) opens the id's derived
    key and its next turn continues it; a body that continues neither (a stranger with the same
    opening, another edit) is told nothing of either: a key of its own history, the same for the
    same body only."""
    last = shown(*body_of(system, conversation[:-1], conversation[-1][0]))
    first, (asked, answer) = conversation[0], conversation[1]
    edit = shown(*body_of(system, [first], asked + "\x00edited"))
    opening = body_of(system, [], first[0])[2]
    digests = {"c-1": (last.digest,)}
    branch = claim("c-1", opening, held(digests), edit)
    assert branch == (unclaimed("c-1", opening), False, True)
    digests[branch.conversation] = (edit.digest,)  # the edit was answered
    next_turn = shown(*body_of(system, [first, (asked + "\x00edited", answer)], question))
    assert claim("c-1", opening, held(digests), next_turn) == (branch.conversation, True, True)
    stranger = shown(*body_of(system, [(first[0], first[1] + "\x01")], question))  # the opening, not the answer
    own = claim("c-1", opening, held(digests), stranger)
    assert not own.continues and own.foreign
    assert own.conversation not in digests and own.conversation.startswith(branch.conversation + SEPARATOR)
    assert own == claim("c-1", opening, held(digests), stranger)


@given(texts, turns, st.lists(texts, min_size=1, max_size=12, unique=True), st.randoms(use_true_random=False))
def test_every_branch_of_a_fan_out_goes_on_and_an_edit_before_it_does_not(
    system: str, conversation: list[tuple[str, str]], questions: list[str], random: Random
) -> None:
    """Requests sent at once on one history (an agent's fan-out), ended in any order: a next turn
    on any of the last TIPS to end continues the conversation; a body showing only the history
    before the fan-out (an edit of its turn) does not; never more than TIPS tips."""
    history = conversation[:-1]
    before = shown(*body_of(system, history[:-1], history[-1][0])) if history else None
    tips: tuple[int, ...] = () if before is None else (before.digest,)
    branches = [shown(*body_of(system, history, question)) for question in questions]
    ending = list(range(len(branches)))
    random.shuffle(ending)
    for index in ending:
        tips = tips_after(tips, branches[index])
        assert len(tips) <= TIPS
    for index in ending[-TIPS:]:
        later = shown(*body_of(system, [*history, (questions[index], "an answer")], "go on"))
        assert claim("c-1", "", held({"c-1": tips}), later) == ("c-1", True, False)
    if before is not None:
        edit = shown(*body_of(system, history[:-1], history[-1][0] + "\x00edited"))
        assert not claim("c-1", "", held({"c-1": tips}), edit).continues


def held(digests: dict[str, tuple[int, ...]]) -> Callable[[str], tuple[int, ...]]:
    return lambda key: digests.get(key, ())
