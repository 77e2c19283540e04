"""What the simulator's engine (engine.py) offers the parts it drives, flow control (flow.py) and
router mode (router_mode.py): a seam typed here, so that neither imports the engine that
imports them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from extproc.routing import Ticket
from extproc.routing.speeds import AnswerTimings
from extproc.sim.paged import PagedReplica
from extproc.sim.replica import Replica
from extproc.sim.request import Request
from extproc.sim.routers import RouterTier


class Simulation(Protocol):
    now: float
    router: RouterTier
    release: Callable[[Ticket, bool], object]
    release_answered: Callable[[str, frozenset[int]], list[str]]  # (conversation, histories shown) -> released
    report: Callable[[Ticket, str, int, int, AnswerTimings], None]

    def push_hook(self, at: float, hook: Callable[[Any, float], None]) -> None: ...

    def routed(self, request: Request, ticket: Ticket | None, now: float) -> None: ...

    def serve(self, request: Request, replica: Replica | PagedReplica, now: float) -> None: ...

    def done(self, request: Request, now: float) -> None: ...
