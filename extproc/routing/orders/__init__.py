"""The queue's orders by name (orders/base.py): ``vtc-local`` is this router's, the others are
the field's baselines."""

from __future__ import annotations

from collections.abc import Callable

from extproc.routing.orders.base import Candidate, Order
from extproc.routing.orders.fifo import Fifo
from extproc.routing.orders.least_attained import LeastAttainedService
from extproc.routing.orders.round_robin import RoundRobin
from extproc.routing.orders.vtc import Vtc
from extproc.routing.orders.vtc_local import LocalVtc

ORDERS: dict[str, Callable[[], Order]] = {
    "vtc-local": LocalVtc,
    "vtc": Vtc,
    "fifo": Fifo,
    "round-robin": RoundRobin,
    "las": LeastAttainedService,
}
DEFAULT_ORDER = "vtc-local"


def make_order(name: str) -> Order:
    """A fresh order (its own state) by name; ValueError names the known ones."""
    if name not in ORDERS:
        raise ValueError(f"unknown queue order {name!r} (known: {', '.join(ORDERS)})")
    return ORDERS[name]()


__all__ = ["Candidate", "DEFAULT_ORDER", "ORDERS", "Order", "make_order"]
