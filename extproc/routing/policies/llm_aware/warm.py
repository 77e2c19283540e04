"""Where the request's model is loaded (router mode, sleep: residency.py): a cold replica has
lost the cache, makes the request wait for a load or a wake, and a new conversation goes to a
warm one first."""

from __future__ import annotations

from collections.abc import Callable

from extproc.routing.policies.situation import Situation


def warm_only(situation: Situation, cached_on: str | None, expected: dict[str, int],
              costs: dict[str, int]) -> tuple[str | None, dict[str, int], dict[str, int]]:
    """Where the request's model sleeps or is not loaded its cache is gone: (cached_on, expected,
    costs) without those replicas."""
    model, cold = situation.request.model, situation.residency.cold
    gone = [name for name in expected if cold(name, model)]
    if not gone:
        return cached_on, expected, costs
    kept = {name: tokens for name, tokens in expected.items() if name not in gone}
    return (None if cached_on in gone else cached_on), kept, {name: costs[name] for name in costs if name in kept}


def warm_first(situation: Situation, preferred: str,
               holders: Callable[[], tuple[str, ...]] | None) -> tuple[str, Callable[[], tuple[str, ...]] | None]:
    """(the first replica clockwise where the request's model is loaded, the walk's replicas to try
    first: ``holders``', then the other warm replicas clockwise): the ring of the model's warm
    replicas. Unchanged when it is cold everywhere."""
    model, cold = situation.request.model, situation.residency.cold
    warm = tuple(name for name in situation.walk() if not cold(name, model))
    if not warm:
        return preferred, holders

    def warm_later() -> tuple[str, ...]:
        earlier = holders() if holders is not None else ()
        return (*earlier, *(name for name in warm if name not in earlier))

    return warm[0], warm_later


def warm_slots(situation: Situation, slots: int) -> int:
    """The guard rail's floor in requests on a replica where the request's model is loaded: all
    its ``slots`` while the model is cold on another eligible replica (a free slot there beats a
    load or a wake elsewhere), else 1."""
    residency, model = situation.residency, situation.request.model
    if not residency.tracked:
        return 1
    return slots if any(residency.cold(name, model) for name in situation.eligible) else 1


def warm_floor(situation: Situation, replica: str, slots_floor: int) -> int:
    """The requests below which ``replica`` is never past the guard rail (``slots_floor``: ``warm_slots``)."""
    if slots_floor == 1 or situation.residency.cold(replica, situation.request.model):
        return 1
    return slots_floor


def model_wait(situation: Situation, replica: str) -> float:
    """The seconds a request waits on ``replica`` for its model's load or wake (residency.py)."""
    residency = situation.residency
    return residency.penalty(replica, situation.request.model) if residency.tracked else 0.0
