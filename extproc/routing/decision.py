"""What a policy is given and what it returns: the pick, why, and the numbers that led there, as data.

Text is made from these fields only at the edge (``render.render_trace``); logs and
the simulator store ``Trace.as_dict()`` so every decision can be queried later.
Immutable NamedTuples, not frozen dataclasses: a frozen dataclass's __init__ costs
~8x more, and one is built on every request.

A trace holds what every decision shares (the policy, the request's size) and the
policy's own numbers as ``details``: a NamedTuple its file defines (``BoundedTrace``,
``LlmAwareTrace``, ...), flattened into ``as_dict()`` by ``detail_fields``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple


class RouteRequest(NamedTuple):
    """One request as the router sees it."""

    request_id: str
    conversation: str
    prompt_tokens: int  # estimated from the body's text
    max_tokens: int  # the output the client asked for
    prefix_blocks: tuple[int, ...] = ()  # chained hashes of fixed-size prompt blocks, oldest first (empty: unknown)
    model: str = ""  # the model the request names ("": none)
    # replicas running a request of its model under another LoRA adapter configuration, which llama.cpp
    # does not batch with it (routing/adapters.py)
    unbatched: frozenset[str] = frozenset()
    # its conversation's key (Router.conversation_key: 64-bit unsigned), computed where the request is
    # read (the service) or sent (the simulator) and carried from there; -1: built without it (tests),
    # computed when routed
    key: int = -1


class Check(NamedTuple):
    """One candidate the bounded walk looked at."""

    replica: str
    load: int
    cost: int
    limit: float
    accepted: bool
    long_limit: bool = False  # ``limit`` is the long-conversation cap


class Candidate(NamedTuple):
    """One replica as a peer policy scored it."""

    replica: str
    matched_blocks: int  # leading prompt blocks the policy's view says the replica holds
    load: int  # what the policy weighs as load (requests in flight; kv-cost: active blocks)
    score: float  # the policy's number for it (see the policy's rule: higher or lower wins)


class Trace(NamedTuple):
    """Every decision's trace: the request as its policy saw it, and the policy's own numbers."""

    policy: str
    prompt_tokens: int
    max_tokens: int
    details: tuple[Any, ...] | None = None  # a NamedTuple of the policy's file (None: it has none)

    def as_dict(self) -> dict[str, Any]:
        """One flat record: these fields, then the details' fields that are set. ``cached_tokens``
        is always there (0 when the policy does not predict any)."""
        data: dict[str, Any] = {"policy": self.policy, "prompt_tokens": self.prompt_tokens,
                                "max_tokens": self.max_tokens, "cached_tokens": 0}
        if self.details is not None:
            data.update(detail_fields(self.details))
        return data


def detail_fields(details: tuple[Any, ...]) -> dict[str, Any]:
    """A policy's trace details as data: every field that is set (None and empty left out); a
    mapping as a dict, a tuple of records (``Check``, ``Candidate``) as a list of dicts, a tuple
    of (name, number) pairs as a dict."""
    data: dict[str, Any] = {}
    for name, value in zip(details._fields, details, strict=True):  # type: ignore[attr-defined]  # a NamedTuple
        if value is None or (isinstance(value, (tuple, Mapping)) and not value):
            continue
        if isinstance(value, Mapping):
            value = dict(value)
        elif isinstance(value, tuple):
            value = [item._asdict() for item in value] if hasattr(value[0], "_asdict") else dict(value)
        data[name] = value
    return data


class Decision(NamedTuple):
    replica: str
    reason: str
    cost: int  # charged in the policy's load unit (1 in requests mode)
    charged_tokens: int  # charged to the token ledger (the work this request brings)
    predicted_cached_tokens: int  # prefix the router expects the replica to have cached
    trace: Trace
