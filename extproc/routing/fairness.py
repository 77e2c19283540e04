"""Jain's fairness index of the work served to tenants that had to wait, over a sliding window.

Jain's index of x_1..x_n is (Σx)² / (n Σx²): 1 when all are equal, 1/n when one gets
everything. Fair queueing promises equal service to the tenants that are *backlogged* (VTC's
definition, Sheng et al., OSDI'24): a tenant that asks for less than its share gets all it
asks and is no sign of unfairness. So x_t is the work (tokens, flow_control.py's weights)
dispatched to tenant t in the last ``window_s`` seconds, over the tenants that had a request
waiting in that window; none waited: 1.0 (nothing was contended). Pure: the clock is an
argument.
"""

from __future__ import annotations

from collections import deque

SWEEP_TENANTS = 1024  # tenants remembered as having waited before the first sweep of old ones


class FairnessWindow:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._served: deque[tuple[float, str, float]] = deque()  # (time, tenant, work), oldest first
        self._totals: dict[str, float] = {}
        self._waited: dict[str, float] = {}  # tenant -> the last time one of its requests waited
        self._sweep_at = SWEEP_TENANTS

    def served(self, now: float, tenant: str, work: float) -> None:
        self._served.append((now, tenant, work))
        self._totals[tenant] = self._totals.get(tenant, 0.0) + work
        self._forget_served_before(now - self.window_s)  # bounded when nothing reads the index

    def waited(self, now: float, tenant: str) -> None:
        self._waited[tenant] = now
        if len(self._waited) > self._sweep_at:  # bounded when nothing reads the index (amortized)
            self._forget_waited_before(now - self.window_s)
            self._sweep_at = max(SWEEP_TENANTS, 2 * len(self._waited))

    def jain(self, now: float) -> float:
        self._forget_before(now - self.window_s)
        shares = [self._totals.get(tenant, 0.0) for tenant in self._waited]
        total, squares = sum(shares), sum(share * share for share in shares)
        return 1.0 if squares == 0 else total * total / (len(shares) * squares)

    def _forget_before(self, start: float) -> None:
        self._forget_served_before(start)
        self._forget_waited_before(start)

    def _forget_served_before(self, start: float) -> None:
        while self._served and self._served[0][0] < start:
            _, tenant, work = self._served.popleft()
            left = self._totals[tenant] - work
            if left <= 1e-9:
                del self._totals[tenant]
            else:
                self._totals[tenant] = left

    def _forget_waited_before(self, start: float) -> None:
        for tenant in [tenant for tenant, last in self._waited.items() if last < start]:
            del self._waited[tenant]
