"""What the other routers know, as one router needs it for one decision (pure, no I/O).

Several routers share a store (extproc/service/store.py); before deciding, a router reads
from it the other live routers' published load per replica, its conversation's shared
placement and the conversation's requests pending on other routers. ``peer_view`` turns
that into a ``PeerView``: the load held elsewhere (the ledger's elsewhere part) and the
placement to decide with.

A pending request elsewhere that this request's body shows answered (bodies.py: the body
resends it plus its answer) is over as far as routing goes: its load is left out, and where
it was served is where the conversation's cache now is, even though its router has not yet
had Envoy's access log entry to release it and write the placement (it releases it itself
when that comes). Requests of routers that are not live (no load published within its TTL)
are ignored: their router is gone, its load with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from extproc.routing.placement import Placement

ReplicaLoads = Mapping[str, tuple[int, int]]  # replica -> (requests, tokens)


class PeerRequest(NamedTuple):
    """A request in flight on another router, as that router published it."""

    router: str
    replica: str
    charged_tokens: int  # what it charged that router's ledger
    prompt_tokens: int  # what the replica's cache holds once it is answered
    history: int  # bodies.py's history hash: a later body's ``answered`` may contain it


class PeerView(NamedTuple):
    elsewhere: dict[str, tuple[int, int]]  # replica -> (requests, tokens) held by other live routers
    placement: Placement | None  # the latest known placement of this conversation among them


def peer_view(
    loads: Mapping[str, ReplicaLoads],
    pending: Iterable[PeerRequest],
    answered: frozenset[int],
    stored: Placement | None,
) -> PeerView:
    """loads: each other live router's published load; pending: the conversation's pending
    requests (any router's: only live others' count); answered: the histories this request's
    body shows answered; stored: the conversation's shared placement."""
    held = {router: dict(by_replica) for router, by_replica in loads.items()}
    placement = stored
    for peer in pending:
        on_router = held.get(peer.router)
        if on_router is None or peer.history not in answered:
            continue
        requests, tokens = on_router.get(peer.replica, (0, 0))
        on_router[peer.replica] = (max(0, requests - 1), max(0, tokens - peer.charged_tokens))
        placement = latest(placement, Placement(peer.replica, peer.prompt_tokens))
    elsewhere: dict[str, tuple[int, int]] = {}
    for by_replica in held.values():
        for replica, (requests, tokens) in by_replica.items():
            so_far = elsewhere.get(replica, (0, 0))
            elsewhere[replica] = (so_far[0] + max(0, requests), so_far[1] + max(0, tokens))
    return PeerView(elsewhere, placement)


def latest(known: Placement | None, other: Placement | None) -> Placement | None:
    """The later of two placements of one conversation: every turn resends the whole history,
    so the one with more prompt tokens was served later; ``known`` on a tie."""
    if other is None:
        return known
    if known is None or other.prompt_tokens > known.prompt_tokens:
        return other
    return known
