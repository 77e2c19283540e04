"""Flows: whom a request comes from (its tenant) and how urgent it is (its priority band).

The tenant is a header's value (``flow.tenant_header``, the Gateway API Inference Extension's
``x-gateway-inference-fairness-id`` by default); the priority is that of the objective a header
names (``flow.objective_header``, ``x-gateway-inference-objective``), looked up in
``flow.objectives``. A request naming neither is in the default flow. The operator's gateway or
auth layer sets these headers: the trust model is in docs/flow-control.md#trusting-the-headers.

The [flow] settings are here, beside [routing]'s, because the queue they shape is core code
(queue.py, flow_control.py); the service's file reads them (extproc/settings.py).
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import Field

from extproc.strict import Strict

HEADER_NAME = r"^[a-z0-9][a-z0-9-]{0,99}$"  # a lowercase HTTP header name, as Envoy hands them over
MAX_TENANT_CHARS = 64  # a longer tenant id is cut and hashed by the service (gateway.bounded)


class Flow(NamedTuple):
    """A queue's unit of fairness: the tenant within its priority band (higher first)."""

    priority: int
    tenant: str


class FlowSettings(Strict):
    """Flow control (docs/flow-control.md): off, every request goes to a replica at once, as ever."""

    enabled: bool = Field(description="hold requests in the router while their replicas are full, and dispatch "
                                      "them by priority and fair share as room frees")
    tenant_header: str = Field(pattern=HEADER_NAME, description="the header naming the request's tenant")
    objective_header: str = Field(pattern=HEADER_NAME, description="the header naming the request's objective")
    default_tenant: str = Field(min_length=1, max_length=MAX_TENANT_CHARS,
                                description="the tenant of a request without the tenant header")
    objectives: dict[str, int] = Field(description="objective name -> priority band (higher is served first)")
    default_priority: int = Field(description="the band of a request naming no objective, or an unknown one")
    anonymous_max_priority: int = Field(description="the highest band a request without the tenant header may "
                                                    "claim through its objective")
    reserved_slots: int = Field(ge=0, description="of each replica's slots (routing.replicas.slots), this many go "
                                                  "only to a flow holding fewer requests in flight or waiting "
                                                  "than the busiest flow")
    input_weight: float = Field(gt=0, description="work of a prompt token the replica computes (fair share)")
    output_weight: float = Field(gt=0, description="work of a generated token (fair share)")
    locality_deficit: float = Field(ge=0, description="tokens of work a flow may be ahead of the least served "
                                                      "one when its request keeps a cache")
    band_size: int = Field(gt=0, description="requests waiting in one priority band at most: more get 429")
    ttl_seconds: float = Field(gt=0, le=600, description="a request waiting longer gets 429")


def flow_of(settings: FlowSettings, tenant: str, objective: str) -> Flow:
    """The flow of a request carrying ``tenant`` and ``objective`` (header values, "" when
    absent): an unknown objective is the default band; without a tenant, at most
    ``anonymous_max_priority``."""
    priority = settings.objectives.get(objective, settings.default_priority) if objective else \
        settings.default_priority
    if not tenant:
        return Flow(min(priority, settings.anonymous_max_priority), settings.default_tenant)
    return Flow(priority, tenant)
