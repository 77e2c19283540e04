"""The guard rail of the decisions on predicted time to first token: past ttft_guard_factor ×
the average load in tokens (this request included) a replica is no candidate, and a preferred
replica past it goes to the bounded walk."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple


class GuardRail(NamedTuple):
    """ttft_guard_factor × the average load in tokens, this request included (``tokens_limit``)."""

    tokens: Mapping[str, int]  # the ledger's loads in tokens ...
    requests: Mapping[str, int]  # ... and in requests, which the predictions read too
    tokens_limit: float

    def past(self, replica: str, cost: int, running_floor: int = 1) -> bool:
        """Whether ``replica`` would be past the guard with this request (``cost`` tokens there);
        never while it runs fewer than ``running_floor`` requests."""
        load = self.tokens[replica]
        return load > 0 and load + cost > self.tokens_limit and self.requests[replica] >= running_floor
