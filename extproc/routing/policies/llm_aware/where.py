"""Where llm-aware looks for the request's cache: what a source of it answers, and placement
memory's answer (the conversation's last replica). The prefix index's is in index.py."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from extproc.routing.policies.situation import Situation

# (the replica holding the cache, replica -> cached tokens expected there, replica -> the request's
# cost there (new tokens only), the prefix index's trace fields or (), the holders to try after the
# preferred replica, most expected reuse first, before the ring: asked for only then)
WhereCached = tuple[str | None, dict[str, int], dict[str, int], tuple, Callable[[], tuple[str, ...]] | None]


class WhereCache(Protocol):
    """A source of where the request's prompt is cached (placement memory, the prefix index)."""

    def where_cached(self, situation: Situation, home: str) -> WhereCached: ...

    def least_recent_fit(self, situation: Situation, loads: Mapping[str, int], work: int,
                         cap: float) -> tuple[str, int] | None:
        """(replica, when its least recent prompt was used) for a prompt no replica holds, of
        the replicas where it fits under the cap; None: none, or nothing known of what they forget."""
        ...


class PlacementMemoryCache:
    """Where placement memory says the cache is; it knows nothing of what the replicas forget."""

    def where_cached(self, situation: Situation, home: str) -> WhereCached:
        """The conversation's last replica holds its last prompt."""
        placement = situation.placement
        if placement is None:
            return None, {}, {}, (), None
        request = situation.request
        replica, cached = placement.replica, min(placement.prompt_tokens, request.prompt_tokens)
        cost = max(1, request.prompt_tokens - cached) + request.max_tokens
        return replica, {replica: cached}, {replica: cost}, (), None

    def least_recent_fit(self, situation: Situation, loads: Mapping[str, int], work: int,
                         cap: float) -> tuple[str, int] | None:
        return None
