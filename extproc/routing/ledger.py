"""In-flight load per replica, in requests and in tokens.

Charged when a request is routed, released when its stream ends. Releasing is
idempotent: a second release, or the release of an unknown request, changes nothing,
so an error path that releases "just in case" can never drive a counter negative.

With several routers (docs/several-gateways.md) each one charges and releases only its own
requests here (one writer); what the others hold on each replica is set as a whole, the
*elsewhere* part, from a snapshot of the shared store. The policies read both together
through ``loads`` and ``total``; ``requests``, ``tokens`` and the ``total_*`` figures stay
this router's own (what it publishes, and what it must bring back to zero). With a ``journal``
(a list), each own charge and release is also kept there, in order, for a caller that passes them
on to the other routers (the simulator's store model, extproc/sim/routers.py); what the others
hold comes back as the elsewhere part.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

LoadUnit = Literal["requests", "tokens"]


# (request id, replica, tokens) of a charge; (request id, "", 0) of the release of one held
LedgerChange = tuple[str, str, int]


# compiled (extproc/compiled.py)
class LoadLedger:
    __slots__ = ("_requests", "_tokens", "_charges", "_total_requests", "_total_tokens",
                 "_elsewhere", "_seen_requests", "_seen_tokens", "_elsewhere_requests", "_elsewhere_tokens",
                 "journal")

    def __init__(self, replicas: Iterable[str] = ()) -> None:
        self._requests: dict[str, int] = {}
        self._tokens: dict[str, int] = {}
        self._charges: dict[str, tuple[str, int]] = {}
        self._total_requests = 0
        self._total_tokens = 0
        # other routers' load: (requests, tokens) per replica, empty without a peer snapshot
        self._elsewhere: dict[str, tuple[int, int]] = {}
        self._elsewhere_requests = self._elsewhere_tokens = 0
        # what the policies see: the own dicts themselves while nothing is elsewhere
        self._seen_requests, self._seen_tokens = self._requests, self._tokens
        self.journal: list[LedgerChange] | None = None  # a list: this ledger's charges and releases, oldest first
        self.set_replicas(replicas)

    def set_replicas(self, replicas: Iterable[str]) -> None:
        """Track exactly ``replicas``. New ones start empty.

        A removed replica's in-flight requests are forgotten: its counters go, and
        completing those requests later releases nothing. If the replica comes back
        it starts from zero, which is true: a re-added replica has a fresh server.
        """
        wanted = set(replicas)
        for gone in [name for name in self._requests if name not in wanted]:
            self._total_requests -= self._requests.pop(gone)
            self._total_tokens -= self._tokens.pop(gone)
            for request_id in [rid for rid, (name, _) in self._charges.items() if name == gone]:
                del self._charges[request_id]
        for name in sorted(wanted - self._requests.keys()):
            self._requests[name] = 0
            self._tokens[name] = 0
        self.set_elsewhere(self._elsewhere)

    def set_elsewhere(self, elsewhere: Mapping[str, tuple[int, int]]) -> None:
        """Replace what other routers hold: (requests, tokens) per replica. Replicas this
        ledger does not track are ignored, negative figures count as zero; {} forgets it all."""
        kept = {name: (max(0, requests), max(0, tokens)) for name, (requests, tokens) in elsewhere.items()
                if name in self._requests and (requests > 0 or tokens > 0)}
        self._elsewhere = kept
        self._elsewhere_requests = sum(requests for requests, _ in kept.values())
        self._elsewhere_tokens = sum(tokens for _, tokens in kept.values())
        if not kept:
            self._seen_requests, self._seen_tokens = self._requests, self._tokens
            return
        self._seen_requests = {name: count + kept.get(name, (0, 0))[0] for name, count in self._requests.items()}
        self._seen_tokens = {name: count + kept.get(name, (0, 0))[1] for name, count in self._tokens.items()}

    def elsewhere(self) -> Mapping[str, tuple[int, int]]:
        """Other routers' (requests, tokens) per replica, as last set (only non-zero entries)."""
        return self._elsewhere

    def charge(self, request_id: str, replica: str, tokens: int) -> None:
        if request_id in self._charges:
            raise ValueError(f"request {request_id!r} is already charged")
        if replica not in self._requests:
            raise KeyError(f"unknown replica {replica!r}")
        self._charges[request_id] = (replica, tokens)
        self._requests[replica] += 1
        self._tokens[replica] += tokens
        self._total_requests += 1
        self._total_tokens += tokens
        if self._elsewhere:
            self._seen_requests[replica] += 1
            self._seen_tokens[replica] += tokens
        if self.journal is not None:
            self.journal.append((request_id, replica, tokens))

    def release(self, request_id: str) -> tuple[str, int] | None:
        """Release a request's load; returns (replica, tokens), or None if nothing was held."""
        charge = self._charges.pop(request_id, None)
        if charge is not None:
            replica, tokens = charge
            self._requests[replica] -= 1
            self._tokens[replica] -= tokens
            self._total_requests -= 1
            self._total_tokens -= tokens
            if self._elsewhere:
                self._seen_requests[replica] -= 1
                self._seen_tokens[replica] -= tokens
            if self.journal is not None:
                self.journal.append((request_id, "", 0))
        return charge

    def clear(self) -> None:
        self._charges.clear()
        self._total_requests = self._total_tokens = 0
        for name in self._requests:
            self._requests[name] = 0
            self._tokens[name] = 0
        self.set_elsewhere({})

    def loads(self, unit: LoadUnit) -> Mapping[str, int]:
        """Live read-only view of the per-replica load in ``unit``: this router's and elsewhere."""
        return self._seen_requests if unit == "requests" else self._seen_tokens

    def total(self, unit: LoadUnit) -> int:
        """The whole load in ``unit``: this router's and elsewhere."""
        if unit == "requests":
            return self._total_requests + self._elsewhere_requests
        return self._total_tokens + self._elsewhere_tokens

    def requests(self, replica: str) -> int:
        return self._requests.get(replica, 0)

    def tokens(self, replica: str) -> int:
        return self._tokens.get(replica, 0)

    def total_requests(self) -> int:
        return self._total_requests

    def total_tokens(self) -> int:
        return self._total_tokens

    def in_flight(self) -> int:
        return len(self._charges)

    def charges(self) -> Mapping[str, tuple[str, int]]:
        """This router's requests in flight: request id -> (replica, tokens), in the order charged."""
        return self._charges
