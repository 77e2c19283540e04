"""A routed request's hold on the router that picked it: its ``Ticket``.

A tuple, built on the per-request path with ``tuple.__new__``: as Python a slotted class's
``__init__`` cost a route about 85 ns against 45 ns for this. The module stays out of the
compiled core (under mypyc a NamedTuple with methods is a Python class either way), so the
compiled router builds it in the same way.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from extproc.routing.decision import Decision, RouteRequest


class Holder(Protocol):
    """What a ticket asks the router that routed it (router.py's ``Router``)."""

    def _release(self, ticket: Ticket, ok: bool, served: str | None) -> bool: ...

    def _holds(self, ticket: Ticket) -> bool: ...

    def _overtaken(self, ticket: Ticket) -> bool: ...


class Ticket(NamedTuple):
    """What a router decided for a routed request, and the release of its load. Released once:
    a second release, or one after ``reset`` or after its replica left the fleet (its load went
    with it), does nothing. Compared by identity where it matters (``held``)."""

    request: RouteRequest
    decision: Decision
    key: int  # the conversation's key in placement memory
    router: Holder

    def release(self, ok: bool = True, served: str | None = None) -> bool:
        """Release the load; on success remember where the conversation's cache now is: on the
        pick, or on ``served`` when another replica answered (the proxy failed over), unless
        ``overtaken``. False when it was released already."""
        return self.router._release(self, ok, served)

    @property
    def held(self) -> bool:
        """Routed and not yet released."""
        return self.router._holds(self)

    @property
    def overtaken(self) -> bool:
        """A migration moved its conversation's cache after it was routed (and the conversation
        was not routed since): its release leaves placement memory to that move."""
        return self.router._overtaken(self)
