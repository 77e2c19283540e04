"""The functional core: ring, policies, load ledger, placement memory, decision traces.

No I/O here: the gRPC service, the simulator and the tests drive the same objects.
"""

from extproc.routing.decision import Check, Decision, RouteRequest, Trace
from extproc.routing.hashing import stable_hash
from extproc.routing.ledger import LoadLedger
from extproc.routing.placement import Placement, PlacementMemory
from extproc.routing.policies import REGISTRY as POLICIES
from extproc.routing.policies import make_policy, reasons
from extproc.routing.render import render_trace
from extproc.routing.ring import HashRing
from extproc.routing.router import Router
from extproc.routing.ticket import Ticket
from extproc.routing.tokens import estimate_tokens

__all__ = [
    "POLICIES", "Check", "Decision", "HashRing", "LoadLedger", "Placement",
    "PlacementMemory", "RouteRequest", "Router", "Ticket", "Trace", "estimate_tokens", "make_policy",
    "reasons", "render_trace", "stable_hash",
]
