"""What a policy may look at for one request, and the decisions of the policies that do not walk the cap."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple

from extproc.routing.blocks import covered_tokens
from extproc.routing.decision import Candidate, Check, Decision, RouteRequest, Trace
from extproc.routing.ledger import LoadLedger, LoadUnit
from extproc.routing.placement import Placement
from extproc.routing.render import check_line, headline, load_line, peer_lines
from extproc.routing.residency import Residency
from extproc.routing.ring import HashRing
from extproc.routing.speeds import ReplicaSpeeds

# NamedTuple(...) goes through a Python-level __new__ (with keywords, through a dict too):
# 0.3-1.2 µs a tuple. On the per-request path tuples are built directly, positionally
# in field order, with tuple.__new__(Cls, (...)) (~0.1 µs); the tests pin every field.
new = tuple.__new__
HOME_REASON = {"home": "the conversation's ring home (or, without a cap, the ring's pick)"}  # a reason of several
LOWEST_WINS = frozenset({"kv-cost"})  # peer policies whose candidate score is a cost


class PeerTrace(NamedTuple):
    """A peer policy's trace details: what its view says of the prompt, the loads it weighed,
    its candidates' scores and its rule's figures; chwbl also walks the ring under a cap."""

    unit: str  # "requests": a peer's decision charges one request
    cached_tokens: int  # predicted cached on the pick (its view's matched blocks)
    prompt_blocks: int  # len(request.prefix_blocks)
    loads: Mapping[str, int]  # the eligible replicas' requests in flight (a copy)
    candidates: tuple[Candidate, ...]
    figures: tuple[tuple[str, float], ...]  # named numbers of the policy's rule (thresholds, weights)
    home: str | None = None  # chwbl: where its walk began ...
    total: int | None = None  # ... the requests in flight with this one ...
    cap: float | None = None  # ... its bound on a replica's load ...
    checks: tuple[Check, ...] = ()  # ... and the replicas it looked at

    def render(self, decision: Decision) -> list[str]:
        lines = [headline(decision)]
        if self.total is not None and self.cap is not None:  # chwbl's walk
            lines.append(load_line(self.unit, self.loads, self.total, self.cap))
            lines.extend(check_line(check, decision.reason) for check in self.checks)
        lines.extend(peer_lines(decision, self.prompt_blocks, self.loads, self.cap, self.figures, self.candidates,
                                decision.trace.policy in LOWEST_WINS))
        return lines


class Situation(NamedTuple):
    """Everything a policy may look at for one request (read-only)."""

    request: RouteRequest
    key_hash: int  # stable hash of the conversation (ring position)
    ring: HashRing
    ledger: LoadLedger
    placement: Placement | None  # remembered placement, only if that replica is eligible
    avoid: frozenset[str]  # replicas not to pick (unhealthy)
    eligible: tuple[str, ...]  # the ring's replicas minus ``avoid``, in name order
    speeds: ReplicaSpeeds  # each replica's speed, learnt from its answers
    residency: Residency  # which models each replica holds loaded (router mode, sleep)

    def walk(self) -> Iterator[str]:
        """Eligible replicas clockwise from the conversation's ring position."""
        avoid = self.avoid
        if not avoid:
            return self.ring.walk(self.key_hash)
        return (name for name in self.ring.walk(self.key_hash) if name not in avoid)

    def home(self) -> str | None:
        if not self.avoid:
            return self.ring.home(self.key_hash)
        return next(self.walk(), None)

    def total(self, unit: LoadUnit) -> int:
        if not self.avoid:
            return self.ledger.total(unit)
        loads = self.ledger.loads(unit)
        return self.ledger.total(unit) - sum(loads.get(name, 0) for name in self.avoid)

    def load_copy(self, unit: LoadUnit) -> dict[str, int]:
        """The eligible replicas' loads now: a copy for the trace (a dict copy costs a seventh
        of a tuple of its items at 64 replicas)."""
        loads = self.ledger.loads(unit)
        if not self.avoid:
            return dict(loads)
        return {name: loads[name] for name in self.eligible}

    def cached_tokens_on(self, replica: str) -> int:
        """The prefix the router expects ``replica`` to hold for this conversation."""
        placement = self.placement
        if placement is None or placement.replica != replica:
            return 0
        return min(placement.prompt_tokens, self.request.prompt_tokens)


def unbounded_decision(policy: str, situation: Situation, replica: str, reason: str) -> Decision:
    """A pick made without looking at load: counts as one request, brings its whole prompt. No
    trace details: the pick is all there is to it (mod-n's and consistent's is the home)."""
    request = situation.request
    prompt, max_tokens = request.prompt_tokens, request.max_tokens
    placement = situation.placement
    cached = 0
    if placement is not None and placement.replica == replica:
        cached = min(placement.prompt_tokens, prompt)
    trace = new(Trace, (policy, prompt, max_tokens, None))
    return new(Decision, (replica, reason, 1, prompt + max_tokens, cached, trace))


def best_candidate(candidates: list[Candidate], key_hash: int, highest: bool) -> Candidate:
    """The pick step of the scoring peer policies: the highest (or lowest) score; ties go to the
    tied candidate at key_hash mod ties (deterministic where their sources draw at random)."""
    best = max(c.score for c in candidates) if highest else min(c.score for c in candidates)
    tied = [candidate for candidate in candidates if candidate.score == best]
    return tied[key_hash % len(tied)]


def peer_decision(policy: str, situation: Situation, replica: str, reason: str, matched_blocks: int,
                  candidates: tuple[Candidate, ...] = (), figures: tuple[tuple[str, float], ...] = (),
                  walk: tuple[str, int, float, tuple[Check, ...]] | None = None) -> Decision:
    """A peer policy's pick: one request on the ledger, its whole prompt charged in tokens,
    and the prompt share its view says the pick holds as the predicted cache. ``walk``: chwbl's
    (home, total, cap, checks)."""
    request = situation.request
    prompt, max_tokens = request.prompt_tokens, request.max_tokens
    blocks = len(request.prefix_blocks)
    cached = covered_tokens(prompt, blocks, matched_blocks)
    details = PeerTrace("requests", cached, blocks, situation.load_copy("requests"), candidates, figures,
                        *(walk or ()))
    return new(Decision, (replica, reason, 1, prompt + max_tokens, cached, Trace(policy, prompt, max_tokens, details)))
