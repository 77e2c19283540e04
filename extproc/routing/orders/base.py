"""The order in which a priority band's waiting requests leave: one strategy per queueing
discipline, the FairQueue (queue.py) asks it to pick among the band's flows that could go.

The queue keeps what every discipline shares (bands, per-flow queues oldest first, the virtual
token counters it reports in decision traces); an order only chooses. Pure: the clock is an
argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from extproc.routing.flows import Flow


class Candidate(NamedTuple):
    """A flow's request that could go now, as an order sees it."""

    kind: int  # LOCAL, NEW or FAIR (queue.py)
    counter: float  # its flow's virtual token counter
    arrived: float  # when this request arrived
    head_arrived: float  # when its flow's oldest waiting request arrived
    flow: Flow
    position: int  # the caller's handle on the request


class Order(Protocol):
    # True: a flow offers its request that best keeps a cache (of its first LOOKAHEAD);
    # False: its oldest request that could go
    locality: bool

    def pick(self, candidates: Sequence[Candidate], deficit: float, now: float) -> Candidate:
        """The candidate to dispatch (``candidates`` is never empty, all of one band)."""
        ...

    def completed(self, flow: Flow, work: float, now: float) -> None:
        """A request of ``flow`` ended having cost ``work`` (its replica's reported tokens, weighted)."""
        ...


def oldest(candidates: Sequence[Candidate]) -> Candidate:
    return min(candidates, key=lambda candidate: candidate.arrived)
